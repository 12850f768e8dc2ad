"""Print a run's TensorBoard scalars as a table: minutes since start, step, and the chosen tags.

  python scripts/print_scalars.py --workdir=runs/sudoku --tags=eval/puzzle_accuracy,eval/cell_accuracy
"""

import glob
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from diffgemma import cli  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory.")
_TAGS = flags.DEFINE_list("tags", ["eval/puzzle_accuracy", "eval/cell_accuracy",
                                   "eval/tokens_per_forward"], "Scalar tags to print.")


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise cli.UserError("--workdir is required")
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  rows = {}
  start = None
  for path in sorted(glob.glob(os.path.join(_WORKDIR.value, "tensorboard", "events.*"))):
    acc = EventAccumulator(path)
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
      for event in acc.Scalars(tag):
        # Minutes count from the first logged scalar of the run (its first training log).
        start = event.wall_time if start is None else min(start, event.wall_time)
        if tag in _TAGS.value:
          rows.setdefault(event.step, {"wall": event.wall_time})[tag] = event.value
  if not rows:
    raise cli.UserError(f"no scalars {_TAGS.value} under {_WORKDIR.value}/tensorboard")
  print("minutes  step  " + "  ".join(_TAGS.value))
  for step in sorted(rows):
    row = rows[step]
    values = "  ".join(f"{row[t]:.4f}" if t in row else "-" for t in _TAGS.value)
    print(f"{(row['wall'] - start) / 60:7.1f}  {step:4d}  {values}")


if __name__ == "__main__":
  cli.run(main)
