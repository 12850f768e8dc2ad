"""scripts/sudoku_diagnostics.py on tiny Sudoku runs made in this process (one trained, one saved
at initialisation): a report row per checkpoint, numbers in range, both prompt formats, one-line
errors for a missing step and bad flags."""

import jax
import numpy as np
import pytest

from diffgemma import cli
from diffgemma.model import network
from diffgemma.runs import checkpointing, training_state
from diffgemma.tasks import sudoku
from diffgemma.training import loop
from tests.helpers import load_script
from tests.helpers import setup_of, tiny_sudoku_config

TRAIN_STEPS = 4
CHECKPOINT_EVERY = 2  # checkpoints at steps 2 and 4
NUM_PUZZLES = 4
SAMPLER_PUZZLES = 2
LEVELS = (0.5, 1.0)




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
  params = network.init_params(setup.model_cfg, jax.random.PRNGKey(0))
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
