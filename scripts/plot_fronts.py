"""Accuracy against TPF for several checkpoints on one chart, from their `eval.py --scan` files.

  python eval.py --workdir=runs/sft --data=HELDOUT --scan sampler.entropy_bound=0.05,0.1,0.2,0.4 \\
      --out=runs/sft/front
  (the same for the other checkpoints, same data, seed and values)
  python scripts/plot_fronts.py --out=front.png SFT=runs/sft/front "SD·RL=runs/sdrl/front"

Each LABEL=DIR names a scan directory (or its scan.json); every scan must score the same
headline metric. Prints one markdown table of every point (label, scanned key and value, the
metric, TPF, steps per canvas) and writes the chart: one line per checkpoint, each point
labelled with its scanned value (diffgemma/tools/compare.py, `plot_sweep`).
"""

import json
import os

from absl import flags

from diffgemma import cli, errors

_OUT = flags.DEFINE_string("out", None, "Write the chart to this PNG file.")
_TITLE = flags.DEFINE_string("title", None, "The chart's title (default: metric vs TPF).")


def load_scan(spec: str) -> tuple[str, dict]:
  """(label, scan.json's contents) from LABEL=PATH."""
  label, sep, path = spec.partition("=")
  if not sep or not label or not path:
    raise cli.UserError(f"{spec!r}: give each scan as LABEL=DIR (eval.py --scan's --out)")
  if os.path.isdir(path):
    path = os.path.join(path, "scan.json")
  if not os.path.isfile(path):
    raise cli.UserError(f"{path}: no scan.json there; run eval.py --scan ... --out=DIR first")
  with open(path, encoding="utf-8") as f:
    return label, json.load(f)


def main(argv):
  specs = argv[1:]
  if not specs:
    raise cli.UserError("give one or more scans: plot_fronts.py LABEL=DIR [LABEL=DIR ...]")
  if _OUT.value is not None and not _OUT.value.lower().endswith(".png"):
    raise cli.UserError(f"--out={_OUT.value!r}: the chart is a PNG (name it FILE.png)")
  if _OUT.value:
    errors.check_output_file(_OUT.value, "out")
  from diffgemma.tools import compare

  scans = [load_scan(spec) for spec in specs]
  metrics = {scan["headline_metric"] for _, scan in scans}
  if len(metrics) != 1:
    raise cli.UserError(f"the scans score different metrics {sorted(metrics)}; plot one task")
  metric = metrics.pop()
  points = [compare.SweepPoint(label, p["value"], p["metrics"])
            for label, scan in scans for p in scan["points"]]
  # sweep_table's first column is each point's key, here its checkpoint's label; the scanned
  # sampler key goes beside it.
  header, rows = compare.sweep_table(points, metric)
  scanned = [p["key"] for _, scan in scans for p in scan["points"]]
  print(compare.markdown(["checkpoint", "sampler key"] + header[1:],
                         [row[:1] + [key] + row[1:] for row, key in zip(rows, scanned)]))
  if _OUT.value:
    errors.prepare_output_file(_OUT.value, "out")
    width, height = compare.plot_sweep(points, metric, _OUT.value,
                                       _TITLE.value or f"{metric} vs TPF")
    print(f"plot: {_OUT.value} ({width}x{height})")


if __name__ == "__main__":
  cli.run(main)
