"""Evaluate a run's latest checkpoint (or any model checkpoint) on a held-out file of its task.

  python eval.py --workdir=DIR --data=FILE [--limit=N]
  python eval.py --workdir=DIR --data=HELDOUT.jsonl --metric=exact|choice|gsm8k|regex \
      [--answer_regex=RE]                                   # chat runs
  python eval.py --init_from=CHECKPOINT_DIR --data=FILE --config=CONFIG
  python eval.py --workdir=DIR --data=FILE --quantize=int4            # a quantized base
  python eval.py --workdir=DIR --data=FILE --sampler.entropy_bound=0.3  # any sampler key
  python eval.py --workdir=DIR --data=FILE --scan sampler.entropy_bound=0.05,0.1,0.2,0.4 \
      [--scan sampler.t_max=0.6,0.8,1.0] --out=SCAN_DIR      # quality against TPF

The task of the run (config.task.name) reads the file: a Kaggle-format CSV of puzzles for
Sudoku, a JSONL of conversations for chat (the last assistant turn is the reference; infill
records, scripts/make_chat_task.py --task=infill_count, are infilled between their given prefix
and suffix and scored by infill_accuracy). Every
prediction is written as one JSON line to DIR/predictions/<file>-step<N>.jsonl (--workdir; with
--init_from, to --predictions if given). `--sampler.KEY=VALUE` overrides any field of the run's
sampler (diffgemma.sampling.sampler.SamplerConfig). The last line printed is one JSON object of
metrics; its "headline_metric" names the task's main one, and it carries the latency
(cold_seconds: the calls that compiled, one per prompt width; warm_seconds: a later call's mean;
seconds_per_canvas; tokens_per_second_warm; training/evaluation.latency_metrics) and the device
(kind, jax version, CPU and accelerator model).

`--scan sampler.KEY=V1,V2,...` (repeatable) evaluates every value of each scanned key, one key
at a time on top of the run's sampler and any --sampler.KEY=VALUE (not a cross product: that is
scripts/sweep.py's --grid, over training runs), on the same examples and seed, the weights
loaded once; --out=DIR receives scan.md (the table: the task's headline metric, TPF, steps per
canvas, warm latency), scan.png (the headline metric against TPF, one line per scanned key;
diffgemma/tools/compare.py) and scan.json (every point's metrics).
"""

import json
import sys
import os

from absl import flags
from ml_collections import config_flags
from tqdm import tqdm

from diffgemma import cli, errors
from diffgemma.runs import distributed

distributed.define_flags()  # --distributed, --coordinator_address, --num_processes, ...
_WORKDIR = flags.DEFINE_string("workdir", None, "Training run directory (config + checkpoints).")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "Instead of --workdir: a model checkpoint dir (transformers, orbax or a "
    "workdir), evaluated with --config's task and sampler settings.")
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Task/sampler config for --init_from (default sft_sudoku).")
_DATA = flags.DEFINE_string("data", None, "Held-out file of the run's task (Sudoku: CSV with "
                            "header quizzes,solutions; chat: JSONL).")
_LIMIT = flags.DEFINE_integer("limit", None, "Evaluate only the first N examples.")
_BATCH = flags.DEFINE_integer("batch_size", None, "Sampler batch (default: the run's eval batch).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampler seed.")
_METRIC = flags.DEFINE_string("metric", None, "Chat tasks: exact | choice | gsm8k | regex "
                              "(default: the run's eval.metric).")
_ANSWER_REGEX = flags.DEFINE_string("answer_regex", None, "Chat tasks, --metric=regex: the "
                                    "answer is the regex's first group.")
_PREDICTIONS = flags.DEFINE_string("predictions", None, "Where to write the predictions JSONL "
                                   "(default: inside --workdir).")
_SEEN_IN = flags.DEFINE_string(
    "seen_in", None, "Chat tasks: training JSONL (comma-separated for several); adds accuracy "
    "on held-out prompts seen and unseen in it (seen_prompt_accuracy, unseen_prompt_accuracy), "
    "to tell a run that memorises from one that generalises.")
_QUANTIZE = flags.DEFINE_enum("quantize", None, ["int8", "int4"], "Quantize the weights "
                              "(weight-only; diffgemma/model/quantize.py defaults) before sampling.")
_SCAN = flags.DEFINE_multi_string(
    "scan", [], "sampler.KEY=V1,V2,...: evaluate each value (one scanned key at a time; "
    "repeat the flag for more keys) and write a table and a plot to --out.")
_RENAMED_SWEEP = flags.DEFINE_multi_string("sweep", [], "Renamed: use --scan.")
_OUT = flags.DEFINE_string("out", None, "With --scan: directory for scan.md, scan.png and "
                           "scan.json.")
_LENGTH_BUCKETS = flags.DEFINE_bool(
    "length_buckets", True, "Batch the prompts longest first and cut each batch's left padding "
    "to the smallest of P, P/2, P/4, P/8 that holds it (at most 4 compiled prompt shapes; "
    "training/evaluation.generate_in_batches). --nolength_buckets pads every batch to P.")
_TRAJECTORY = flags.DEFINE_bool(
    "trajectory_stats", False, "Record the sampler's trajectories; add settle_steps_per_canvas "
    "(the mean step from which the argmax canvas stopped changing), sampler_profile (any task, "
    "per step: canvases that ran it, positions accepted, of them already final, mean entropy) "
    "and the task's step_profile (Sudoku, per step: blank cells accepted / correct, entropy on "
    "blanks and givens), each printed as a table.")


def eval_overrides() -> dict:
  """config.eval keys set by flags (checked against the task when the run loads)."""
  overrides = {}
  if _METRIC.value is not None:
    overrides["metric"] = _METRIC.value
  if _ANSWER_REGEX.value is not None:
    overrides["answer_regex"] = _ANSWER_REGEX.value
  return overrides


def main(argv):
  del argv
  if _RENAMED_SWEEP.value:
    raise cli.UserError("--sweep is now --scan (the same sampler.KEY=V1,V2,... values)")
  if _WORKDIR.value and _INIT_FROM.value:
    raise cli.UserError("give one of --workdir or --init_from, not both")
  if not (_WORKDIR.value or _INIT_FROM.value) or not _DATA.value:
    raise cli.UserError("--data and one of --workdir or --init_from are required")
  if _LIMIT.value is not None and _LIMIT.value <= 0:
    raise cli.UserError(f"--limit must be positive, got {_LIMIT.value}")
  if _BATCH.value is not None and _BATCH.value <= 0:
    raise cli.UserError(f"--batch_size must be positive, got {_BATCH.value}")
  if os.path.isdir(_DATA.value):
    raise cli.UserError(f"--data {_DATA.value!r} is a directory; pass a CSV or JSONL file")
  if not os.path.isfile(_DATA.value):
    raise cli.UserError(f"--data file {_DATA.value!r} not found")
  if _PREDICTIONS.value:
    errors.check_output_file(_PREDICTIONS.value, "predictions")
  distributed.initialize_from_flags()  # every process evaluates every example; 0 writes
  distributed.check_same_run({}, {"argv": distributed.shared_argv()})
  from diffgemma.runs import provenance
  from diffgemma.sampling import sampler
  from diffgemma.training import evaluation, loaded

  sampler_overrides = cli.section_overrides("sampler", sampler.SamplerConfig)
  overrides = dict(sampler_overrides)
  if _TRAJECTORY.value:
    overrides["record_trajectory"] = True
  scan = parse_scan(_SCAN.value, sampler)
  if scan and not _OUT.value:
    raise cli.UserError("--scan needs --out=DIR for its table and plot")
  if _OUT.value and not scan:
    raise cli.UserError("--out is for --scan; without a scan the metrics are printed")
  if _OUT.value:
    errors.check_output_file(_OUT.value, "out", directory=True)
  if _WORKDIR.value:
    run = loaded.open_run(_WORKDIR.value, eval_overrides=eval_overrides(), **overrides)
  else:
    config = _CONFIG.value or cli.load_named_config("sft_sudoku")
    run = loaded.open_checkpoint(_INIT_FROM.value, config, eval_overrides=eval_overrides(),
                               **overrides)
  if run.untrained_ar_head():
    print(run.untrained_ar_head(), file=sys.stderr)
  prompts = run.task.load_eval_file(_DATA.value, _LIMIT.value)  # checked before the weights
  if not len(prompts):
    raise cli.UserError(f"no examples in {_DATA.value}")
  try:  # infill data against the sampler (diffusion mode, the run's reply slots)
    evaluation.check_prompts(prompts, run.run_cfg.model, run.sampler_cfg)
  except ValueError as e:
    raise cli.UserError(f"{_DATA.value}: {e}") from None
  points = []
  for key, values in scan:  # every point's sampler is checked before the weights load
    for value in values:
      try:
        points.append((key, value, run.sampler_cfg.replace(**{key: value})))
        evaluation.check_prompts(prompts, run.run_cfg.model, points[-1][2])
      except ValueError as e:
        raise cli.UserError(f"--scan sampler.{key}={value}: {e}") from None
  seen_paths = [p.strip() for p in (_SEEN_IN.value or "").split(",") if p.strip()]
  # Checked (and the training files read) before the weights load and the evaluation runs.
  if seen_paths and run.task.seen_split([], seen_paths) is None:
    raise cli.UserError(f"--seen_in: the {type(run.task).__name__} task has no seen / unseen "
                        "split (chat tasks do)")
  run.load()
  if _QUANTIZE.value:
    from diffgemma.model import quantize

    run.params = quantize.quantize_params(run.params, quantize.QuantizeConfig(_QUANTIZE.value))
  batch = _BATCH.value or run.run_cfg.eval.batch_size
  if points:
    run_scan(run, prompts, batch, points, sampler_overrides, provenance.device_info())
    return
  with tqdm(total=len(prompts), desc="eval", unit="example",
            disable=not distributed.primary()) as bar:
    metrics, predictions = evaluation.evaluate(
        run.task, run.params, run.model_cfg, run.sampler_cfg, prompts, batch, seed=_SEED.value,
        progress=bar, warmup=True, length_buckets=_LENGTH_BUCKETS.value)
  if seen_paths:
    metrics.update(run.task.seen_split(predictions, seen_paths))
  metrics.update(checkpoint_step=run.step, data=os.path.abspath(_DATA.value),
                 quantize=_QUANTIZE.value or "none", length_buckets=_LENGTH_BUCKETS.value,
                 headline_metric=run.task.headline_metric_for(prompts),
                 sampler_overrides=sampler_overrides, device=provenance.device_info())
  path = _PREDICTIONS.value
  if path is None and _WORKDIR.value:
    name = os.path.splitext(os.path.basename(_DATA.value))[0]
    path = os.path.join(_WORKDIR.value, "predictions", f"{name}-step{run.step}.jsonl")
  if path and distributed.primary():
    write_jsonl(path, predictions)
    metrics["predictions"] = os.path.abspath(path)
  if "sampler_profile" in metrics:
    print(evaluation.format_sampler_profile(metrics["sampler_profile"]))
  if "step_profile" in metrics:
    print(run.task.format_profile(metrics["step_profile"]))
  print(json.dumps(metrics))


def parse_scan(specs: list[str], sampler) -> list[tuple[str, list]]:
  """[(key, typed values)] of --scan sampler.KEY=V1,V2,... flags; UserError (one line)."""
  return [(key, [cli.typed_overrides({key: v}, sampler.SamplerConfig, "sampler")[key]
                 for v in values])
          for key, values in cli.parse_value_lists(specs, "scan", "sampler")]


def run_scan(run, prompts, batch: int, points, sampler_overrides: dict, device: dict) -> None:
  """Evaluate every scan point on the same prompts and seed; write and print the table, the
  plot and the points' metrics."""
  from diffgemma.runs import provenance
  from diffgemma.training import evaluation
  from diffgemma.tools import compare

  results = []
  for key, value, sampler_cfg in points:
    with tqdm(total=len(prompts), desc=f"{key}={value}", unit="example",
              disable=not distributed.primary()) as bar:
      metrics, _ = evaluation.evaluate(run.task, run.params, run.model_cfg, sampler_cfg, prompts,
                                       batch, seed=_SEED.value, progress=bar, warmup=True,
                                       length_buckets=_LENGTH_BUCKETS.value)
    metrics.pop("step_profile", None)
    metrics.pop("sampler_profile", None)
    results.append(compare.SweepPoint(key, value, metrics))
  metric = run.task.headline_metric_for(prompts)
  table = compare.markdown(*compare.sweep_table(results, metric))
  header = (f"Sampler scan of {run.source} (checkpoint step {run.step}) on "
            f"{os.path.abspath(_DATA.value)}: {len(prompts)} examples, seed {_SEED.value}, batch "
            f"{min(batch, len(prompts))}; base overrides {sampler_overrides or 'none'}; "
            f"{provenance.describe_device(device)}")
  if not distributed.primary():  # every process evaluated the same points; process 0 writes
    return
  errors.prepare_output_file(_OUT.value, "out", directory=True)
  with open(os.path.join(_OUT.value, "scan.md"), "w", encoding="utf-8") as f:
    f.write(header + "\n\n" + table + "\n")
  width, height = compare.plot_sweep(results, metric, os.path.join(_OUT.value, "scan.png"))
  with open(os.path.join(_OUT.value, "scan.json"), "w", encoding="utf-8") as f:
    json.dump({"headline_metric": metric, "checkpoint_step": run.step, "device": device,
               "data": os.path.abspath(_DATA.value), "sampler_overrides": sampler_overrides,
               "points": [{"key": p.key, "value": p.value, "metrics": p.metrics}
                          for p in results]}, f, indent=1)
  print(header)
  print(table)
  print(f"plot: {os.path.join(_OUT.value, 'scan.png')} ({width}x{height}); "
        f"points: {os.path.join(_OUT.value, 'scan.json')}")


def write_jsonl(path: str, records) -> None:
  """One JSON object per line, written to a temporary file and renamed (never half-written)."""
  errors.prepare_output_file(path, "predictions")
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")
  os.replace(tmp, path)


if __name__ == "__main__":
  cli.run(main, sections=("sampler",))
