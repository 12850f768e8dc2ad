"""Evaluate the latest checkpoint of a run on a Kaggle-format Sudoku CSV.

  python eval.py --workdir=/tmp/sudoku --data=puzzles.csv [--limit=300]
  python eval.py --init_from=CHECKPOINT_DIR --data=puzzles.csv [--config=sft_sudoku]
  python eval.py --workdir=/tmp/sudoku --data=puzzles.csv --quantize=int4   # quantized base

The last line printed is one JSON object of metrics.
"""

import json
import os

from absl import flags
from ml_collections import config_flags
from tqdm import tqdm

from diffgemma import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory (config + checkpoints).")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "Instead of --workdir: a model checkpoint dir (transformers, orbax or a "
    "workdir), evaluated with --config's task and sampler settings.")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Task/sampler config for --init_from (default sft_sudoku).")
_DATA = flags.DEFINE_string("data", None, "CSV with header quizzes,solutions.")
_LIMIT = flags.DEFINE_integer("limit", None, "Evaluate only the first N puzzles.")
_BATCH = flags.DEFINE_integer("batch_size", None, "Sampler batch (default: the run's eval batch).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampler seed.")
_QUANTIZE = flags.DEFINE_enum("quantize", None, ["int8", "int4"], "Quantize the weights "
                              "(weight-only; diffgemma/quantize.py defaults) before sampling.")
_TRAJECTORY = flags.DEFINE_bool(
    "trajectory_stats", False, "Record the sampler's trajectories; add settle_steps_per_canvas "
    "(the mean step from which the argmax canvas stopped changing) and step_profile (per step: "
    "blank cells accepted / correct, entropy spent on blanks and givens), printed as a table.")


def main(argv):
  del argv
  if bool(_WORKDIR.value) == bool(_INIT_FROM.value) or not _DATA.value:
    raise cli.UserError("--data and one of --workdir or --init_from are required")
  if _LIMIT.value is not None and _LIMIT.value <= 0:
    raise cli.UserError(f"--limit must be positive, got {_LIMIT.value}")
  from diffgemma import evaluation, runs, sudoku

  puzzles, solutions = sudoku.load_csv(_DATA.value, _LIMIT.value)
  if _WORKDIR.value:
    run = runs.load_run(_WORKDIR.value)
  else:
    config = _CONFIG.value or cli.load_named_config("sft_sudoku")
    run = runs.load_checkpoint_as_run(_INIT_FROM.value, config)
  if _QUANTIZE.value:
    from diffgemma import quantize

    run.params = quantize.quantize_params(run.params, quantize.QuantizeConfig(_QUANTIZE.value))
  batch = _BATCH.value or run.config.eval.batch_size
  sampler_cfg = run.sampler_cfg
  if _TRAJECTORY.value:
    sampler_cfg = sampler_cfg.replace(record_trajectory=True)
  with tqdm(total=len(puzzles), desc="eval", unit="puzzle") as bar:
    metrics = evaluation.evaluate_sudoku(
        run.params, run.model_cfg, sampler_cfg, puzzles, solutions, batch,
        run.config.data.prompt_format, seed=_SEED.value,
        progress=bar, warmup=True)
  metrics.update(checkpoint_step=run.step, data=os.path.abspath(_DATA.value),
                 quantize=_QUANTIZE.value or "none")
  if "step_profile" in metrics:
    print(evaluation.format_step_profile(metrics["step_profile"]))
  print(json.dumps(metrics))


if __name__ == "__main__":
  cli.run(main)
