"""Training runs side by side: their configs and TensorBoard scalars as one table and one figure.

A run is a workdir with a config.json (see checkpointing.py); its scalars come from the event
files under workdir/tensorboard, read with tensorboard's EventAccumulator (which also drops the
events a resumed run logged past its last checkpoint and then re-logged). Wall-clock minutes
count the time the run's processes were alive: per event file, from the file's first event (the
writer opens before the first step compiles) to its last, summed over files, so the time between
an interruption and the resume does not count. Held-out results that `scripts/sweep.py
--eval_data` stored under workdir/eval/NAME.json join the table.

  load_run(workdir) -> Run        format_table(runs) -> str        plot(runs, path)

Sampler scans of one checkpoint (eval.py --scan) use the same table and plot style:

  sweep_table(points, metric) -> (header, rows)        plot_sweep(points, metric, path)
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
from typing import NamedTuple

import numpy as np

from diffgemma import errors
from diffgemma.runs import provenance

# Eval scalars shown when a run has them, after the runs' headline metrics (Sudoku: puzzle
# accuracy; text tasks: accuracy).
EVAL_METRICS = ("eval/puzzle_accuracy", "eval/blank_cell_accuracy", "eval/accuracy",
                "eval/tokens_per_forward", "eval/steps_per_canvas")
LOWER_IS_BETTER = ("eval/steps_per_canvas",)
# The quality axis of a run that recorded no headline_metric (written before runs did).
LEGACY_ACCURACY_TAGS = ("eval/puzzle_accuracy", "eval/accuracy")
TPF_TAG = "eval/tokens_per_forward"
LOSS_TAG = "loss"
THROUGHPUT_TAG = "tokens_per_second"
HELDOUT_DIR = "eval"  # workdir/eval/NAME.json: eval.py results (sweep.py --eval_data)
# Held-out columns: each result's headline metric (eval.py names it), then these when present.
HELDOUT_METRICS = ("blank_cell_accuracy", "tokens_per_forward", "steps_per_canvas")
# The headline of a result written before eval.py named it: the first of these it holds.
LEGACY_HEADLINES = ("puzzle_accuracy", "accuracy")
# Figure geometry: every panel is PANEL_W_IN x PANEL_H_IN inches at DPI; two rows (against step,
# against wall-clock minutes), one column per plotted metric, plus one column (both rows) for
# accuracy against TPF when the runs log both.
PANEL_W_IN, PANEL_H_IN, DPI = 4.0, 3.0, 100


class NotARunError(errors.InputError):
  """A directory that is not a training run. One-line message."""


class Series(NamedTuple):
  """One scalar tag of a run: steps, values and wall-clock minutes, [N] each, by step."""

  step_N: np.ndarray
  value_N: np.ndarray
  minute_N: np.ndarray


@dataclasses.dataclass
class Run:
  workdir: str
  config: dict  # flattened config.json: dotted key -> value
  series: dict  # tag -> Series
  minutes: float  # wall-clock minutes the run's processes were alive (see module docstring)
  heldout: dict  # NAME -> eval.py metrics dict (workdir/eval/NAME.json)
  headline: str | None = None  # the task's main metric (run_info.json), None for older runs

  @property
  def name(self) -> str:
    return os.path.basename(os.path.normpath(self.workdir))

  @property
  def last_step(self) -> int:
    return max((int(s.step_N[-1]) for s in self.series.values() if len(s.step_N)), default=0)


def flatten(tree: dict, prefix: str = "") -> dict:
  """{"a": {"b": 1}} -> {"a.b": 1}; lists become tuples (hashable, comparable)."""
  out = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, dict) and value:
      out.update(flatten(value, path + "."))
    else:
      out[path] = tuple(value) if isinstance(value, list) else value
  return out


def _event_files(workdir: str) -> list[str]:
  return sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*")))


def _spans(paths: list[str]) -> np.ndarray:
  """[F, 2] (first, last) event wall times of each event file."""
  from tensorboard.backend.event_processing import event_file_loader

  spans = []
  for path in paths:
    times = [event.wall_time for event in event_file_loader.EventFileLoader(path).Load()]
    if times:
      spans.append((min(times), max(times)))
  return np.asarray(spans, np.float64).reshape(-1, 2)


def _alive_minutes(wall_N, spans_Fx2) -> np.ndarray:
  """Minutes of the files' spans that lie before each wall time [N]."""
  wall_Nx1 = np.asarray(wall_N, np.float64)[:, None]
  first_1xF, last_1xF = spans_Fx2[None, :, 0], spans_Fx2[None, :, 1]
  return np.sum(np.clip(wall_Nx1 - first_1xF, 0.0, last_1xF - first_1xF), axis=1) / 60.0


def load_run(workdir: str) -> Run:
  """A workdir's config and scalars (NotARunError if it has no config.json)."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  path = os.path.join(workdir, "config.json")
  if not os.path.isdir(workdir):
    raise NotARunError(f"{workdir!r} is not a directory")
  if not os.path.isfile(path):
    raise NotARunError(f"{workdir!r} is not a training run: it has no config.json")
  try:
    with open(path) as f:
      config = flatten(json.load(f))
  except ValueError:
    raise NotARunError(f"{path} is not valid JSON") from None
  files = _event_files(workdir)
  spans = _spans(files)
  series = {}
  if files:
    acc = EventAccumulator(os.path.join(workdir, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    for tag in acc.Tags()["scalars"]:
      events = sorted(acc.Scalars(tag), key=lambda e: e.step)
      series[tag] = Series(np.asarray([e.step for e in events], np.int64),
                           np.asarray([e.value for e in events], np.float64),
                           _alive_minutes([e.wall_time for e in events], spans))
  minutes = float(np.sum(spans[:, 1] - spans[:, 0]) / 60.0)
  heldout = {}
  for result in sorted(glob.glob(os.path.join(workdir, HELDOUT_DIR, "*.json"))):
    with open(result) as f:
      heldout[os.path.splitext(os.path.basename(result))[0]] = json.load(f)
  headline = provenance.load_run_info(workdir).get("headline_metric")
  return Run(workdir, config, series, minutes, heldout, headline)


def load_runs(workdirs: list[str]) -> list[Run]:
  return [load_run(w) for w in workdirs]


def differing_keys(runs: list[Run]) -> list[str]:
  """Config keys whose value is not the same in every run (missing counts as a value), in the
  first run's key order."""
  keys = list(dict.fromkeys(k for run in runs for k in run.config))
  missing = object()
  return [k for k in keys
          if len({repr(run.config.get(k, missing)) for run in runs}) > 1]


def format_value(value) -> str:
  """A config value as the table shows it (floats in %g, tuples in parentheses)."""
  if value is None:
    return "-"
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, float):
    return f"{value:g}"
  if isinstance(value, tuple):
    return "(" + ", ".join(format_value(v) for v in value) + ")"
  return str(value)


def run_labels(runs: list[Run]) -> list[str]:
  """Per run: its differing config values ("k=v, ..."), or its directory name when the
  configs agree."""
  keys = differing_keys(runs)
  if not keys:
    return [run.name for run in runs]
  return [", ".join(f"{k}={format_value(run.config.get(k))}" for k in keys) for run in runs]


def final_and_best(series: Series | None, tag: str) -> tuple[float, float] | None:
  if series is None or not len(series.value_N):
    return None
  values = series.value_N
  return float(values[-1]), float(values.min() if tag in LOWER_IS_BETTER else values.max())


def table(runs: list[Run]) -> tuple[list[str], list[list[str]]]:
  """(header, rows), best run first (`ranked`): the run's directory name, the differing config
  keys, final / best of each eval metric some run logged, held-out results, logged steps, wall minutes, median training
  tokens/s (the median skips the first window, which includes compilation)."""
  keys = differing_keys(runs)
  metrics = [t for t in eval_metrics(runs) if any(t in run.series for run in runs)]
  heldout = [(name, m) for name in sorted({n for run in runs for n in run.heldout})
             for m in heldout_metrics(runs, name)]
  header = (["run"] + keys + [f"{t.removeprefix('eval/')} final / best" for t in metrics]
            + [f"{name}: {m}" for name, m in heldout] + ["steps", "minutes", "tokens/s"])
  runs = ranked(runs, heldout, metrics[0] if metrics else None)
  rows = []
  for run in runs:
    row = [run.name] + [format_value(run.config.get(k)) for k in keys]
    for tag in metrics:
      fb = final_and_best(run.series.get(tag), tag)
      row.append("-" if fb is None else f"{_num(fb[0])} / {_num(fb[1])}")
    for name, m in heldout:
      value = run.heldout.get(name, {}).get(m)
      row.append("-" if value is None else _num(value))
    throughput = run.series.get(THROUGHPUT_TAG)
    row += [str(run.last_step), f"{run.minutes:.1f}",
            "-" if throughput is None else f"{np.median(throughput.value_N):.0f}"]
    rows.append(row)
  return header, rows


def ranked(runs: list[Run], heldout: list[tuple[str, str]], tag: str | None) -> list[Run]:
  """Best first: by the first held-out set's results (name, metric) where runs have them, its
  headline first and each further column breaking ties (quality, then speed: a short proxy
  budget can leave every run at the same headline, 0 puzzles solved, while blank cells differ),
  else by the final value of the first eval metric (the runs' headline); runs without it last,
  in order."""
  first_set = [(n, m) for n, m in heldout if n == heldout[0][0]] if heldout else []

  def signed(metric, x):
    return x if metric in LOWER_IS_BETTER or f"eval/{metric}" in LOWER_IS_BETTER else -x

  def key(run):
    if first_set:
      values = [run.heldout.get(n, {}).get(m) for n, m in first_set]
      if values[0] is None:
        return None
      # A missing tie-breaker ranks after every measured value, whichever way the metric goes.
      return tuple(math.inf if v is None else signed(m, v) for (_, m), v in zip(first_set, values))
    fb = final_and_best(run.series.get(tag), tag) if tag else None
    return None if fb is None else (signed(tag, fb[0]),)

  scored = [(key(run), i, run) for i, run in enumerate(runs)]
  known = sorted((s for s in scored if s[0] is not None), key=lambda s: (s[0], s[1]))
  return [run for _, _, run in known] + [run for k, _, run in scored if k is None]


def headline_metric(result: dict) -> str | None:
  """The main metric of one eval.py result: the one it names, else the first legacy one."""
  if result.get("headline_metric"):
    return result["headline_metric"]
  return next((m for m in LEGACY_HEADLINES if m in result), None)


def heldout_metrics(runs: list[Run], name: str) -> list[str]:
  """The columns of held-out set `name`: the runs' headline metrics, then HELDOUT_METRICS."""
  results = [run.heldout[name] for run in runs if name in run.heldout]
  headlines = [m for m in dict.fromkeys(headline_metric(r) for r in results) if m]
  return headlines + [m for m in HELDOUT_METRICS
                      if m not in headlines and any(m in r for r in results)]


def _num(x: float) -> str:
  return f"{x:.3f}" if abs(x) < 100 else f"{x:.0f}"


def format_table(runs: list[Run]) -> str:
  """`table` as an aligned markdown table."""
  return markdown(*table(runs))


def markdown(header: list[str], rows: list[list[str]]) -> str:
  """(header, rows) of strings as an aligned markdown table."""
  widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
  line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
  return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                   + [line(r) for r in rows])


def eval_metrics(runs: list[Run]) -> list[str]:
  """The eval scalars to show: the runs' headline metrics first, then EVAL_METRICS."""
  headlines = [f"eval/{r.headline}" for r in runs if r.headline]
  return list(dict.fromkeys(headlines + list(EVAL_METRICS)))


def accuracy_tag(runs: list[Run]) -> str | None:
  """The quality axis: the runs' headline metric (the first logged), else a legacy tag."""
  candidates = [f"eval/{r.headline}" for r in runs if r.headline] + list(LEGACY_ACCURACY_TAGS)
  return next((t for t in candidates if any(t in run.series for run in runs)), None)


def plotted_metrics(runs: list[Run]) -> tuple[list[str], str | None]:
  """(tags drawn against step and minutes, the accuracy tag of the accuracy-TPF panel or None)."""
  tags = [t for t in [LOSS_TAG] + eval_metrics(runs) if any(t in run.series for run in runs)]
  accuracy = accuracy_tag(runs)
  has_tpf = any(TPF_TAG in run.series for run in runs)
  return tags, (accuracy if has_tpf else None)


def figure_size_px(runs: list[Run]) -> tuple[int, int]:
  tags, plane = plotted_metrics(runs)
  columns = max(len(tags) + (plane is not None), 1)
  return round(columns * PANEL_W_IN * DPI), round(2 * PANEL_H_IN * DPI)


def _style(ax, title: str, xlabel: str, ylabel: str | None = None) -> None:
  ax.set_title(title, fontsize=9)
  ax.set_xlabel(xlabel, fontsize=8)
  if ylabel:
    ax.set_ylabel(ylabel, fontsize=8)
  ax.tick_params(labelsize=7)
  ax.grid(alpha=0.3)
  for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
    if scale == "linear":  # plain tick labels, never "+4.799e1"-style offsets
      axis.get_major_formatter().set_useOffset(False)


def plot(runs: list[Run], path: str) -> tuple[int, int]:
  """Draw every plotted metric against step (top row) and wall-clock minutes (bottom row), one
  line per run, plus accuracy against TPF (each eval a point, the last one ringed); write a PNG
  of `figure_size_px(runs)` to `path` and return that size."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tags, plane = plotted_metrics(runs)
  width, height = figure_size_px(runs)
  columns = width // round(PANEL_W_IN * DPI)
  fig = plt.figure(figsize=(width / DPI, height / DPI), dpi=DPI)
  grid = fig.add_gridspec(2, columns)
  labels = run_labels(runs)
  colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]
  for j, tag in enumerate(tags):
    for row, (field, xlabel) in enumerate((("step_N", "step"),
                                           ("minute_N", "wall-clock minutes"))):
      ax = fig.add_subplot(grid[row, j])
      for run, label, color in zip(runs, labels, colors):
        s = run.series.get(tag)
        if s is not None and len(s.step_N):
          ax.plot(getattr(s, field), s.value_N, color=color, label=label,
                  marker="o" if tag != LOSS_TAG else None, markersize=3, linewidth=1.2)
      if tag == LOSS_TAG and all(np.all(r.series[tag].value_N > 0)
                                 for r in runs if tag in r.series):
        ax.set_yscale("log")
      _style(ax, tag, xlabel)
      if j == 0 and row == 0:
        ax.legend(fontsize=6, loc="best")
  if plane is not None:
    ax = fig.add_subplot(grid[:, columns - 1])
    for run, label, color in zip(runs, labels, colors):
      acc, tpf = run.series.get(plane), run.series.get(TPF_TAG)
      if acc is None or tpf is None:
        continue
      steps = np.intersect1d(acc.step_N, tpf.step_N)
      if not len(steps):
        continue
      x = tpf.value_N[np.searchsorted(tpf.step_N, steps)]
      y = acc.value_N[np.searchsorted(acc.step_N, steps)]
      ax.plot(x, y, color=color, marker="o", markersize=3, linewidth=0.8, label=label)
      ax.plot(x[-1:], y[-1:], color=color, marker="o", markersize=9, fillstyle="none")
    _style(ax, f"{plane.removeprefix('eval/')} vs TPF (ring: last eval)",
           "tokens per forward (TPF)", plane)
  fig.tight_layout()
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
  return width, height



# ----------------------------------------------------------------------------- sampler sweeps


@dataclasses.dataclass(frozen=True)
class SweepPoint:
  """One evaluated sampler setting: the swept key (a SamplerConfig field), its value, and
  eval.py's metrics dict for it."""

  key: str
  value: object
  metrics: dict


SWEEP_METRICS = ("tokens_per_forward", "steps_per_canvas", "ar_fallback_rate", "warm_seconds",
                 "tokens_per_second_warm")


def sweep_table(points: list[SweepPoint], metric: str) -> tuple[list[str], list[list[str]]]:
  """(header, rows): one row per point in order: sampler key, value, `metric` (the task's
  headline), then SWEEP_METRICS where the points have them."""
  extra = [m for m in SWEEP_METRICS if any(p.metrics.get(m) is not None for p in points)]
  header = ["sampler key", "value", metric] + extra
  rows = []
  for p in points:
    cells = [p.metrics.get(m) for m in [metric] + extra]
    rows.append([p.key, format_value(p.value)]
                + ["-" if v is None else _num(float(v)) for v in cells])
  return header, rows


def plot_sweep(points: list[SweepPoint], metric: str, path: str,
               title: str | None = None) -> tuple[int, int]:
  """`metric` against tokens per forward, one line per swept key (its points in sweep order,
  each labelled with its value); a PNG of one PANEL_W_IN x PANEL_H_IN panel (doubled) at DPI
  written to `path`; returns its size in pixels. Fronts of several checkpoints
  (scripts/plot_fronts.py) pass each checkpoint's label as the points' key."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  width, height = round(2 * PANEL_W_IN * DPI), round(2 * PANEL_H_IN * DPI)
  fig = plt.figure(figsize=(width / DPI, height / DPI), dpi=DPI)
  ax = fig.add_subplot(1, 1, 1)
  keys = list(dict.fromkeys(p.key for p in points))
  for i, key in enumerate(keys):
    line = [p for p in points if p.key == key]
    x = [float(p.metrics["tokens_per_forward"]) for p in line]
    y = [float(p.metrics[metric]) for p in line]
    color = plt.get_cmap("tab10")(i % 10)
    ax.plot(x, y, color=color, marker="o", markersize=4, linewidth=1.2, label=key)
    for p, xi, yi in zip(line, x, y):
      ax.annotate(format_value(p.value), (xi, yi), textcoords="offset points", xytext=(4, 4),
                  fontsize=7, color=color)
  _style(ax, title or f"{metric} vs TPF (sampler sweep)", "tokens per forward (TPF)", metric)
  ax.legend(fontsize=7, loc="best")
  fig.tight_layout()
  fig.savefig(path, dpi=DPI)
  plt.close(fig)
  return width, height
