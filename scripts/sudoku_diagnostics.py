"""Where a Sudoku SFT run stands, checkpoint by checkpoint: is it still on the copy plateau?

  python scripts/sudoku_diagnostics.py --workdir=runs/sudoku [--steps=250,500] [--json=out.json]

For every kept checkpoint (or --steps), on --num_puzzles held-out puzzles (seed --seed, givens
in the run's eval range, prompts in the run's data.prompt_format), one decoder pass per noise
level t (the training corruption at a fixed t, no self-conditioning) reports:
  * CE over the canvas (the SFT loss at that t), and argmax accuracy on the canvas cells whose
    token the noise replaced, separately for given and blank cells. A decoder on the copy
    plateau reproduces the tokens it is shown but is at chance on replaced ones; reading the
    prompt fixes replaced givens first, the row / column / box constraints then the blanks.
  * per layer and head, the mean attention probability from canvas cell i to its own prompt
    cell i, and the attention mass on the prompt cells of its 20 peers (same row, column or
    box); uniform attention over the 81 + 81 keys gives 1/162 and 20/162.
--sampler_puzzles=N also runs the run's sampler on the first N puzzles (puzzle accuracy,
blank-cell and given-cell accuracy of the final grid, tokens per forward pass).
LoRA runs are read with their adapters merged, as eval.py reads them.
"""

import json
import os

from absl import flags
import numpy as np

from diffgemma import cli, errors

FLAGS = flags.FLAGS

DEFAULT_NOISE_LEVELS = (0.1, 0.3, 0.5, 0.7, 0.9, 1.0)
DEFAULT_ATTENTION_T = 0.5
SAMPLER_KEYS = ("puzzle_accuracy", "blank_cell_accuracy", "given_cell_accuracy",
                "tokens_per_forward")


def define_flags():
  flags.DEFINE_string("workdir", None, "Training run directory.")
  flags.DEFINE_list("steps", [], "Checkpoint steps (default: every kept checkpoint).")
  flags.DEFINE_integer("num_puzzles", 64, "Held-out puzzles of the decoder passes (one batch).")
  flags.DEFINE_integer("seed", 9090, "Puzzle and noise seed (not the training data's).")
  flags.DEFINE_list("noise_levels", [str(t) for t in DEFAULT_NOISE_LEVELS],
                    "Noise levels t of the decoder passes.")
  flags.DEFINE_float("attention_t", DEFAULT_ATTENTION_T,
                     "Noise level whose attention the report shows (added to the levels).")
  flags.DEFINE_integer("sampler_puzzles", 0, "Also run the sampler on this many puzzles.")
  flags.DEFINE_string("json", None, "Also write every number to this JSON file.")


# ----------------------------------------------------------------------------- inputs


def peer_mask():
  """[81, 81] bool: cell j shares a row, column or box with cell i (j != i)."""
  from diffgemma.tasks import sudoku_puzzles

  cell = np.arange(sudoku_puzzles.NUM_CELLS)
  row, col = cell // sudoku_puzzles.SIZE, cell % sudoku_puzzles.SIZE
  box = row // sudoku_puzzles.BOX * sudoku_puzzles.BOX + col // sudoku_puzzles.BOX
  same = (row[:, None] == row) | (col[:, None] == col) | (box[:, None] == box)
  return same & (cell[:, None] != cell)


def checkpoint_steps(workdir: str, requested) -> list[int]:
  """The requested steps (default: every kept one), each checked to be on disk."""
  from diffgemma.runs import checkpointing

  kept = sorted(checkpointing.steps_on_disk(workdir))
  if not kept:
    raise cli.UserError(f"no checkpoints in {workdir!r}")
  for step in requested:
    if step not in kept:
      raise cli.UserError(f"no checkpoint at step {step} in {workdir!r}; kept steps: {kept}")
  return sorted(requested) or kept


def open_sudoku_run(workdir: str):
  """The run's config, task and sampler settings (`runs.Run`, no weights read yet); a one-line
  error unless it is a Sudoku run whose one canvas holds the grid (the probe pairs canvas
  cell i with prompt cell i)."""
  from diffgemma.training import loaded
  from diffgemma.tasks import sudoku

  run = loaded.open_run(workdir)
  if run.task.name != sudoku.SudokuTask.name:
    raise cli.UserError(f"{workdir!r} is a {run.task.name!r} run; sudoku_diagnostics reads "
                        "Sudoku runs")
  layout = run.task.layout
  if layout.prompt_len != sudoku.PROMPT_LEN or layout.response_len != sudoku.CANVAS_LEN:
    raise cli.UserError(f"sudoku_diagnostics needs one canvas of {sudoku.CANVAS_LEN} cells; the "
                        f"run has {layout.num_canvases} of {layout.canvas_length}")
  return run


def held_out_set(run, num_puzzles: int, seed: int):
  """(Prompts of the run's task, clean canvas tokens [N, 81], given cells [N, 81] bool):
  puzzles with givens in the run's eval range, prompts in its prompt format."""
  from diffgemma.tasks import sudoku, sudoku_puzzles

  if num_puzzles < 1:
    raise cli.UserError(f"--num_puzzles must be >= 1, got {num_puzzles}")
  puzzles, solutions = sudoku_puzzles.generate_puzzles(
      seed, num_puzzles, run.config.eval.min_givens, run.config.eval.max_givens)
  prompts = sudoku.puzzle_prompts(puzzles, solutions, run.task.prompt_format)
  return prompts, sudoku.solution_tokens(solutions), puzzles != sudoku_puzzles.BLANK


# ----------------------------------------------------------------------------- the decoder probe


def make_probe(model_cfg, noise_schedule: str, prompt_len: int):
  """A jitted (params, prompt_NxP, valid_NxP, clean_NxC, given_NxC, t, rng) -> numbers of one
  decoder pass at noise level t: scalars, and attention arrays [layers, heads]."""
  import jax
  import jax.numpy as jnp

  from diffgemma.model import attention_probe, transformer
  from diffgemma.training import diffusion, losses

  cfg = attention_probe.recordable(model_cfg)
  peers_CxP = jnp.asarray(peer_mask())

  @jax.jit
  def probe(params, prompt_NxP, valid_NxP, clean_NxC, given_NxC, t, rng):
    n = clean_NxC.shape[0]
    _, cache = transformer.encode(params, cfg, prompt_NxP,
                                  transformer.init_cache(cfg, n, prompt_len), valid_NxP)
    noisy_NxC = diffusion.corrupt(rng, clean_NxC, jnp.full((n,), t), cfg.vocab_size,
                                  noise_schedule)
    with attention_probe.record_attention() as probs:
      logits = transformer.decode(params, cfg, noisy_NxC, cache)
    correct_NxC = jnp.argmax(logits, -1) == clean_NxC
    # A replacement may draw the clean token again: that cell shows its answer, not noise.
    replaced_NxC = noisy_NxC != clean_NxC

    def accuracy_and_count(cells_NxC):
      count = jnp.sum(cells_NxC)
      return jnp.sum(correct_NxC & cells_NxC) / jnp.maximum(count, 1), count

    numbers = {"ce": jnp.mean(losses.cross_entropy(logits, clean_NxC))}
    for name, cells in (("given_replaced", given_NxC & replaced_NxC),
                        ("blank_replaced", ~given_NxC & replaced_NxC),
                        ("given", given_NxC), ("blank", ~given_NxC)):
      numbers[f"acc_{name}"], numbers[f"num_{name}"] = accuracy_and_count(cells)
    # Each layer's probs [N, H, C, P + C]: key s < P is prompt cell s, key P + j canvas cell j.
    # Reduced layer by layer, so no [layers, N, H, C, P + C] array is ever held.
    own, peers = [], []
    for probs_NxHxCxS in probs:
      to_prompt = probs_NxHxCxS[..., :prompt_len]
      own.append(jnp.mean(jnp.diagonal(to_prompt, axis1=-2, axis2=-1), axis=(0, 2)))
      peers.append(jnp.mean(jnp.sum(jnp.where(peers_CxP, to_prompt, 0.0), -1), axis=(0, 2)))
    numbers["attn_own_prompt"] = jnp.stack(own)  # [layers, heads]
    numbers["attn_peer_prompts"] = jnp.stack(peers)
    return numbers

  return probe


def diagnose(run, steps, num_puzzles: int, seed: int, levels, sampler_puzzles: int = 0) -> dict:
  """{step: {"levels": {t: numbers}, "sampler": metrics (with sampler_puzzles)}} of a Sudoku
  run (`open_sudoku_run`); numbers are floats and [layers][heads] lists."""
  import jax

  from diffgemma.io import model_dirs
  from diffgemma.sampling import sampler
  from diffgemma.training import evaluation

  prompts, clean_NxC, given_NxC = held_out_set(run, num_puzzles, seed)
  noise_schedule = run.run_cfg.loss.noise_schedule
  rng = jax.random.PRNGKey(seed)
  out, probe, generate_fn = {}, None, None
  for step in steps:
    model_cfg, params, _ = model_dirs.load_workdir(run.source, step=step)
    probe = probe or make_probe(model_cfg, noise_schedule, run.task.layout.prompt_len)
    levels_out = {}
    for index, t in enumerate(levels):
      # The same noise draw per level at every step: the checkpoints see the same inputs.
      numbers = probe(params, prompts.prompt_NxP, prompts.valid_NxP, clean_NxC, given_NxC,
                      float(t), jax.random.fold_in(rng, index))
      levels_out[t] = jax.tree_util.tree_map(lambda x: np.asarray(x).tolist(), numbers)
    entry = {"levels": levels_out}
    if sampler_puzzles:
      generate_fn = generate_fn or sampler.make_generate_fn(model_cfg, run.sampler_cfg)
      metrics, _ = evaluation.evaluate(
          run.task, params, model_cfg, run.sampler_cfg, prompts.take(slice(0, sampler_puzzles)),
          run.run_cfg.eval.batch_size, seed=seed, generate_fn=generate_fn)
      entry["sampler"] = {key: metrics[key] for key in SAMPLER_KEYS}
    out[step] = entry
  return out


# ----------------------------------------------------------------------------- the report


def format_report(results: dict, levels, attention_t: float) -> str:
  """Tables: CE by noise level; accuracy on replaced given / blank cells; attention per layer
  and head at `attention_t`; the sampler's metrics when they were run."""
  from diffgemma.tasks import sudoku, sudoku_puzzles

  steps = sorted(results)
  keys = sudoku.PROMPT_LEN + sudoku.CANVAS_LEN
  num_peers = int(peer_mask()[0].sum())
  header = "step   " + " ".join(f"t={t:<8g}" for t in levels)
  lines = ["CE over the canvas by noise level t (one decoder pass, no self-conditioning)", header]
  for s in steps:
    lines.append(f"{s:5d}  " + " ".join(f"{results[s]['levels'][t]['ce']:10.3f}"
                                        for t in levels))

  def accuracy(numbers, cells):
    return f"{numbers[f'acc_{cells}']:4.2f}" if numbers[f"num_{cells}"] else "   -"

  chance = 1 / sudoku_puzzles.SIZE
  lines += ["", f"accuracy on noise-replaced cells, given/blank (chance {chance:.2f}; - no such "
            "cell)", header]
  for s in steps:
    lines.append(f"{s:5d}  " + " ".join(
        f"{accuracy(results[s]['levels'][t], 'given_replaced')}/"
        f"{accuracy(results[s]['levels'][t], 'blank_replaced')} " for t in levels))
  lines += ["", f"attention at t={attention_t:g}, per head: canvas cell i to prompt cell i "
            f"(uniform {1 / keys:.4f}) | mass on its {num_peers} peers' prompt cells (uniform "
            f"{num_peers / keys:.3f})", "step  layer"]
  for s in steps:
    numbers = results[s]["levels"][attention_t]
    for layer, (own, peers) in enumerate(zip(numbers["attn_own_prompt"],
                                             numbers["attn_peer_prompts"])):
      lines.append(f"{s:5d}  {layer:4d}  " + " ".join(f"{h:5.3f}" for h in own) + " | "
                   + " ".join(f"{h:5.3f}" for h in peers))
  sampled = [s for s in steps if "sampler" in results[s]]
  if sampled:
    lines += ["", "sampler: puzzle acc / blank-cell acc / given-cell acc / tokens per forward"]
    for s in sampled:
      m = results[s]["sampler"]
      lines.append(f"{s:5d}  {m['puzzle_accuracy']:.3f} / {m['blank_cell_accuracy']:.3f} / "
                   f"{m['given_cell_accuracy']:.3f} / {m['tokens_per_forward']:.2f}")
  return "\n".join(lines)


def noise_levels(values, attention_t: float) -> list[float]:
  """The levels as sorted floats, `attention_t` among them; each must lie in [0, 1]."""
  try:
    levels = [float(t) for t in values]
  except ValueError:
    raise cli.UserError(f"--noise_levels must be numbers, got {','.join(values)}") from None
  levels = sorted(set(levels) | {attention_t})
  if not all(0.0 <= t <= 1.0 for t in levels):
    raise cli.UserError(f"noise levels must lie in [0, 1], got {levels}")
  return levels


def run_diagnostics(workdir: str, steps=(), num_puzzles: int = 64, seed: int = 9090,
                    levels=DEFAULT_NOISE_LEVELS, attention_t: float = DEFAULT_ATTENTION_T,
                    sampler_puzzles: int = 0) -> tuple[dict, str]:
  """(results of `diagnose`, the report's text) for a run's checkpoints `steps` (default:
  every kept one); bad input is a cli.UserError before any weights are read."""
  levels = noise_levels(levels, attention_t)
  run = open_sudoku_run(workdir)
  steps = checkpoint_steps(workdir, list(steps))
  if not 0 <= sampler_puzzles <= num_puzzles:
    raise cli.UserError(f"--sampler_puzzles must be in [0, --num_puzzles={num_puzzles}], got "
                        f"{sampler_puzzles}")
  results = diagnose(run, steps, num_puzzles, seed, levels, sampler_puzzles)
  return results, format_report(results, levels, attention_t)


def main(argv):
  del argv
  if not FLAGS.workdir:
    raise cli.UserError("--workdir is required")
  if FLAGS.json:
    errors.check_output_file(FLAGS.json, "json")
  try:
    steps = [int(s) for s in FLAGS.steps]
  except ValueError:
    raise cli.UserError(f"--steps must be integers, got {','.join(FLAGS.steps)}") from None
  results, report = run_diagnostics(FLAGS.workdir, steps, FLAGS.num_puzzles, FLAGS.seed,
                                    FLAGS.noise_levels, FLAGS.attention_t, FLAGS.sampler_puzzles)
  print(report)
  if FLAGS.json:
    with open(errors.prepare_output_file(FLAGS.json, "json"), "w") as f:
      json.dump({"workdir": os.path.abspath(FLAGS.workdir), "results": results}, f)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
