"""Print a run's TensorBoard scalars as a table: minutes since start, step, and the chosen tags.

  python scripts/print_scalars.py --workdir=runs/sudoku [--tags=eval/puzzle_accuracy,loss]

Without --tags: every `eval/` scalar the run logged (a Sudoku run's puzzle and cell accuracy, a
chat run's accuracy and canvases per reply, both runs' TPF and steps per canvas).
"""

import glob
import os

from absl import flags

from diffgemma import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory.")
_TAGS = flags.DEFINE_list("tags", [], "Scalar tags to print (default: every eval/ tag).")
EVAL_PREFIX = "eval/"


def main(argv):
  del argv
  if not _WORKDIR.value:
    raise cli.UserError("--workdir is required")
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  rows, seen = {}, []
  start = None
  wanted = lambda tag: tag in _TAGS.value if _TAGS.value else tag.startswith(EVAL_PREFIX)
  for path in sorted(glob.glob(os.path.join(_WORKDIR.value, "tensorboard", "events.*"))):
    acc = EventAccumulator(path)
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
      for event in acc.Scalars(tag):
        # Minutes count from the first logged scalar of the run (its first training log).
        start = event.wall_time if start is None else min(start, event.wall_time)
        if wanted(tag):
          rows.setdefault(event.step, {"wall": event.wall_time})[tag] = event.value
          if tag not in seen:
            seen.append(tag)
  tags = _TAGS.value or seen
  if not rows:
    raise cli.UserError(f"no scalars {_TAGS.value or EVAL_PREFIX + '*'} under "
                        f"{_WORKDIR.value}/tensorboard")
  print("minutes  step  " + "  ".join(tags))
  for step in sorted(rows):
    row = rows[step]
    values = "  ".join(f"{row[t]:.4f}" if t in row else "-" for t in tags)
    print(f"{(row['wall'] - start) / 60:7.1f}  {step:4d}  {values}")


if __name__ == "__main__":
  cli.run(main)
