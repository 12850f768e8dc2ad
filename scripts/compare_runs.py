"""Compare training runs: one table of their differing config keys and eval results, one plot.

  python scripts/compare_runs.py runs/a runs/b [runs/c ...] [--out=compare.png]
  python scripts/compare_runs.py runs/ablate/*/           # every point of a sweep

The table has a column per config key whose value differs between the runs (only those), the
final and best value of each eval metric the runs log (puzzle / cell accuracy or accuracy,
tokens per forward, steps per canvas), held-out results stored by sweep.py --eval_data, the last
logged step, wall-clock minutes and the median training tokens/s. --out draws the eval metrics
and the loss against step and against wall-clock minutes (one line per run) and accuracy
against TPF (the quality-speed plane). Runs are read from WORKDIR/config.json and the
TensorBoard events in WORKDIR/tensorboard (diffgemma/tools/compare.py).
"""

from absl import flags

from diffgemma import cli, errors

_OUT = flags.DEFINE_string("out", None, "Write the plots to this PNG file.")


def main(argv):
  workdirs = argv[1:]
  if not workdirs:
    raise cli.UserError("give one or more run directories: compare_runs.py DIR [DIR ...]")
  if _OUT.value is not None and not _OUT.value.lower().endswith(".png"):
    raise cli.UserError(f"--out={_OUT.value!r}: the plot is a PNG (name it FILE.png)")
  if _OUT.value:
    errors.check_output_file(_OUT.value, "out")
  from diffgemma.tools import compare

  runs = compare.load_runs(workdirs)  # a directory that is not a run: one line (cli.run)
  print(compare.format_table(runs))
  if _OUT.value:
    errors.prepare_output_file(_OUT.value, "out")
    width, height = compare.plot(runs, _OUT.value)
    print(f"plot: {_OUT.value} ({width}x{height})")


if __name__ == "__main__":
  cli.run(main)
