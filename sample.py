"""Solve one Sudoku with a trained run, showing the canvas after every denoising step.

  python sample.py --workdir=/tmp/sudoku --puzzle=53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79
"""

from absl import flags

from diffgemma import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory.")
_PUZZLE = flags.DEFINE_string("puzzle", None, "81 characters, row by row; '.' or '0' = blank.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampler seed.")


def main(argv):
  del argv
  if not _WORKDIR.value or _PUZZLE.value is None:
    raise cli.UserError("--workdir and --puzzle are required")
  from diffgemma import sudoku

  puzzle = sudoku.parse_puzzle_string(_PUZZLE.value)  # validate before loading anything heavy
  import jax
  import numpy as np

  from diffgemma import data, runs, sampler

  run = runs.load_run(_WORKDIR.value, record_trajectory=True)
  arrays = data.eval_arrays(puzzle[None], run.config.data.prompt_format)
  generate_fn = sampler.make_generate_fn(run.model_cfg, run.sampler_cfg)
  out = jax.device_get(generate_fn(run.params, arrays["prompt"], arrays["valid"],
                                   jax.random.PRNGKey(_SEED.value)))
  trajectory = out["trajectory"]
  print(f"puzzle ({int(np.sum(puzzle > 0))} givens), checkpoint step {run.step}:")
  print(sudoku.format_grid(puzzle, puzzle))
  num_steps = int(np.sum(trajectory["valid"][0, :, 0]))
  for n in range(num_steps):
    prediction = data.tokens_to_digits(trajectory["argmax"][0, n, 0, :data.CANVAS_LEN])
    accepted = int(np.sum(trajectory["accepted"][0, n, 0, :data.CANVAS_LEN]))
    wrong_givens = int(np.sum((puzzle > 0) & (prediction != puzzle)))
    print(f"\nstep {n + 1}/{run.sampler_cfg.max_denoising_steps}: {accepted} positions accepted, "
          f"{wrong_givens} givens contradicted")
    print(sudoku.format_grid(prediction, puzzle))
  final = data.tokens_to_digits(out["tokens"][0, :data.CANVAS_LEN])
  solved = sudoku.puzzle_solved(puzzle, final)
  print(f"\nfinal grid after {num_steps} steps "
        f"(tokens per forward {float(out['tokens_per_forward'][0]):.2f}):")
  print(sudoku.format_grid(final, puzzle))
  print("valid solution" if solved else
        ("complete and valid but contradicts the givens" if sudoku.is_valid_solution(final) else
         "not a valid solution"))


if __name__ == "__main__":
  cli.run(main)
