"""scripts/sudoku_diagnostics.py on tiny Sudoku runs made in this process (one trained, one saved
at initialisation): a report row per checkpoint, numbers in range, both prompt formats, one-line
errors for a missing step and bad flags."""

import jax
import numpy as np
import pytest

from diffgemma import cli
from diffgemma.io import model_dirs
from diffgemma.model import attention_probe, transformer
from diffgemma.runs import checkpointing
from diffgemma.tasks import sudoku
from diffgemma.training import diffusion, evaluation, loop, training_state
from tests.helpers import load_script
from tests.helpers import setup_of, tiny_sudoku_config

TRAIN_STEPS = 4
CHECKPOINT_EVERY = 2  # checkpoints at steps 2 and 4
NUM_PUZZLES = 4
SAMPLER_PUZZLES = 2
LEVELS = (0.5, 1.0)
SEED = 9090  # run_diagnostics' default puzzle and noise seed
RTOL = 1e-5  # float32 reductions against float64 sums


@pytest.fixture(scope="module")
def script():
  return load_script("sudoku_diagnostics")


def test_peer_mask_has_twenty_peers_per_cell(script):
  peers = script.peer_mask()
  assert peers.shape == (81, 81) and (peers == peers.T).all() and not peers.diagonal().any()
  assert (peers.sum(1) == 20).all()
  # Cell 0's peers: the rest of row 0, of column 0 and of the top-left box.
  assert sorted(np.flatnonzero(peers[0])) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 18, 19, 20,
                                              27, 36, 45, 54, 63, 72]


def check_results(results, steps, model_cfg, script, sampled: bool):
  """Every checkpoint and level present, accuracies and attention shares in [0, 1]."""
  assert sorted(results) == steps
  for step, entry in results.items():
    assert sorted(entry["levels"]) == sorted(LEVELS)
    for t, numbers in entry["levels"].items():
      assert np.isfinite(numbers["ce"]) and numbers["ce"] > 0
      for cells in ("given_replaced", "blank_replaced", "given", "blank"):
        assert 0.0 <= numbers[f"acc_{cells}"] <= 1.0, (step, t, cells)
      assert numbers["num_given"] + numbers["num_blank"] == NUM_PUZZLES * sudoku.CANVAS_LEN
      assert numbers["num_given_replaced"] <= numbers["num_given"]
      for key in ("attn_own_prompt", "attn_peer_prompts"):
        attention = np.asarray(numbers[key])
        assert attention.shape == (model_cfg.num_layers, model_cfg.num_heads)
        assert ((attention >= 0) & (attention <= 1)).all()
    # At t = 1 every cell is replaced, unless the uniform draw repeats its clean token.
    at_one = entry["levels"][1.0]
    assert at_one["num_blank_replaced"] > 0.5 * at_one["num_blank"]
    assert ("sampler" in entry) == sampled
    if sampled:
      assert all(0.0 <= entry["sampler"][key] <= 1.0 for key in script.SAMPLER_KEYS
                 if key != "tokens_per_forward")


def peers_by_rule(cell):
  """The cells sharing a row, column or box with `cell`, listed from the rules."""
  row, col = divmod(cell, 9)
  box = {(r, c) for r in range(row // 3 * 3, row // 3 * 3 + 3)
         for c in range(col // 3 * 3, col // 3 * 3 + 3)}
  same = {(row, c) for c in range(9)} | {(r, col) for r in range(9)} | box
  return sorted(r * 9 + c for r, c in same if (r, c) != (row, col))


def check_against_brute_force(results, workdir, step, script):
  """The numbers of checkpoint `step` recomputed by hand: the same puzzles and noise draws
  (level i draws with fold_in(PRNGKey(SEED), i), as the probe states), one decoder pass, then
  float64 CE and per-cell counts in Python loops, and the attention shares summed cell by cell
  over peers listed from the rules."""
  run = script.open_sudoku_run(workdir)
  prompts, clean_NxC, given_NxC = script.held_out_set(run, NUM_PUZZLES, SEED)
  model_cfg, params, _ = model_dirs.load_workdir(workdir, step=step)
  cfg = attention_probe.recordable(model_cfg)
  n, c = clean_NxC.shape
  p = prompts.prompt_NxP.shape[1]

  @jax.jit
  def decode(noisy):
    _, cache = transformer.encode(params, cfg, prompts.prompt_NxP,
                                  transformer.init_cache(cfg, n, p), prompts.valid_NxP)
    with attention_probe.record_attention() as probs:
      logits = transformer.decode(params, cfg, noisy, cache)
    return logits, [x[..., :p] for x in probs]  # [N, H, C, P] per layer

  for index, t in enumerate(sorted(LEVELS)):
    numbers = results[step]["levels"][t]
    noisy = np.asarray(diffusion.corrupt(
        jax.random.fold_in(jax.random.PRNGKey(SEED), index), clean_NxC, np.full((n,), t),
        cfg.vocab_size, run.config.loss.noise_schedule))
    logits, to_prompt = decode(noisy)
    logits = np.asarray(logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ce = -np.mean([logp[i, j, clean_NxC[i, j]] for i in range(n) for j in range(c)])
    assert numbers["ce"] == pytest.approx(ce, rel=RTOL), (step, t)
    right, count = {}, {}
    for i in range(n):
      for j in range(c):
        kind = "given" if given_NxC[i, j] else "blank"
        correct = int(np.argmax(logits[i, j]) == clean_NxC[i, j])
        kinds = [kind] + ([kind + "_replaced"] if noisy[i, j] != clean_NxC[i, j] else [])
        for k in kinds:
          count[k] = count.get(k, 0) + 1
          right[k] = right.get(k, 0) + correct
    for k in ("given", "blank", "given_replaced", "blank_replaced"):
      assert numbers[f"num_{k}"] == count.get(k, 0), (step, t, k)
      assert numbers[f"acc_{k}"] == pytest.approx(right.get(k, 0) / max(count.get(k, 0), 1),
                                                  rel=RTOL), (step, t, k)
    for layer, probs in enumerate(to_prompt):
      probs = np.asarray(probs, np.float64)
      for head in range(cfg.num_heads):
        own = np.mean([probs[i, head, j, j] for i in range(n) for j in range(c)])
        peer = np.mean([sum(probs[i, head, j, q] for q in peers_by_rule(j))
                        for i in range(n) for j in range(c)])
        assert numbers["attn_own_prompt"][layer][head] == pytest.approx(own, rel=RTOL)
        assert numbers["attn_peer_prompts"][layer][head] == pytest.approx(peer, rel=RTOL)
  return run, prompts, model_cfg, params


def test_diagnostics_of_a_tiny_trained_run(tmp_path, script):
  """The default prompt format, on a run train_loop wrote: decoder passes and the sampler."""
  config = tiny_sudoku_config(workdir_steps=TRAIN_STEPS)
  config.checkpoint_every = CHECKPOINT_EVERY
  config.sampler.max_denoising_steps = 2
  config.eval.batch_size = SAMPLER_PUZZLES
  workdir = str(tmp_path / "run")
  loop.train(config, workdir)

  results, report = script.run_diagnostics(workdir, num_puzzles=NUM_PUZZLES, levels=LEVELS,
                                           attention_t=LEVELS[0],
                                           sampler_puzzles=SAMPLER_PUZZLES)
  check_results(results, [2, 4], config.model, script, sampled=True)
  run, prompts, model_cfg, params = check_against_brute_force(results, workdir, 4, script)
  # The sampler's numbers are eval.py's on the first puzzles (same seed), for this checkpoint.
  metrics, _ = evaluation.evaluate(run.task, params, model_cfg, run.sampler_cfg,
                                   prompts.take(slice(0, SAMPLER_PUZZLES)),
                                   config.eval.batch_size, seed=SEED)
  assert results[4]["sampler"] == {key: metrics[key] for key in script.SAMPLER_KEYS}
  lines = report.splitlines()
  # Rows per step: CE, accuracy, one attention row per layer, sampler.
  rows_of = lambda step: [line for line in lines if line.startswith(f"{step:5d}  ")]
  assert all(len(rows_of(s)) == 3 + config.model.num_layers for s in (2, 4)), report
  assert lines[1].split() == ["step"] + [f"t={t:g}" for t in LEVELS]

  with pytest.raises(cli.UserError, match=r"no checkpoint at step 3 .*kept steps: \[2, 4\]"):
    script.run_diagnostics(workdir, steps=[3])
  with pytest.raises(cli.UserError, match="must lie in"):
    script.run_diagnostics(workdir, levels=(1.5,))
  with pytest.raises(cli.UserError, match="sampler_puzzles"):
    script.run_diagnostics(workdir, num_puzzles=NUM_PUZZLES, sampler_puzzles=NUM_PUZZLES + 1)


def test_diagnostics_read_cell_token_prompts(tmp_path, script):
  """The "cell_tokens" format, on a run saved at initialisation (no train step to compile):
  the prompts come from the task, in the run's format."""
  config = tiny_sudoku_config()
  config.data.prompt_format = "cell_tokens"
  config.model.vocab_size = sudoku.vocab_size("cell_tokens")
  workdir = str(tmp_path / "run")
  setup = setup_of(config)
  params = transformer.init_params(setup.model_cfg, jax.random.PRNGKey(0))
  checkpointing.save_config(workdir, config)
  with checkpointing.manager(workdir) as mngr:
    checkpointing.save(mngr, 0, training_state.init_state(setup, params))

  run = script.open_sudoku_run(workdir)
  prompts, _, given = script.held_out_set(run, NUM_PUZZLES, seed=1)
  cells = (prompts.prompt_NxP - sudoku.CELL_TOKEN_OFFSET) // sudoku.CELL_CONTENTS
  np.testing.assert_array_equal(cells, np.broadcast_to(np.arange(81), cells.shape))
  contents = (prompts.prompt_NxP - sudoku.CELL_TOKEN_OFFSET) % sudoku.CELL_CONTENTS
  np.testing.assert_array_equal(contents > 0, given)
  results, _ = script.run_diagnostics(workdir, num_puzzles=NUM_PUZZLES, levels=LEVELS)
  check_results(results, [0], config.model, script, sampled=False)
  check_against_brute_force(results, workdir, 0, script)
