"""Run the cross product of config grids, or one key at a time, as train.py runs; compare them.

  python scripts/sweep.py --config=sft_sudoku --root=runs/ablate \
      --grid optimizer.lr=1e-3,3e-3 --grid loss.self_conditioning_prob=0.0,0.5 \
      --set max_train_minutes=10 [--parallel=1] [--eval_data=runs/easy.csv]
  python scripts/sweep.py --config=sft_sudoku --root=runs/ofat --cores=0,1 \
      --vary optimizer.lr=1e-3,3e-3 --vary batch_size=8,32 --set max_train_minutes=10

--vary runs the recipe unchanged (point `recipe`) and each listed value alone: 5 points above.

One workdir per point, named by its grid overrides (runs/ablate/optimizer.lr=1e-3,loss.self_
conditioning_prob=0.0), each run's output in its train.log. Values are parsed like train.py's
--config.KEY=VALUE, and every point is parsed and validated before anything starts. Rerunning
skips finished points (ended at num_train_steps or on their max_train_minutes deadline) and
resumes the others; two sweep processes may share a root (say one per core, the second started
later): each skips the points the other has finished or is training. At the end:
scripts/compare_runs.py's table over all points, and its plot in ROOT/compare.png (--out).
--eval_data runs eval.py on each point's latest checkpoint and adds the results to the table
(stored in WORKDIR/eval/NAME.json; not rerun for the same checkpoint).
"""

import os

from absl import flags, logging

from diffgemma import cli, errors

_CONFIG = flags.DEFINE_string("config", None, "configs/NAME.py, or just NAME.")
_ROOT = flags.DEFINE_string("root", None, "Directory holding one workdir per point.")
_GRID = flags.DEFINE_multi_string(
    "grid", [], "KEY=V1,V2,...: a config key and its values, parsed like --config.KEY=V (no "
    "value may contain a comma); repeat for more keys: the sweep runs the cross product.")
_VARY = flags.DEFINE_multi_string(
    "vary", [], "KEY=V1,V2,...: one key at a time instead of the cross product: the recipe "
    "unchanged (point 'recipe') plus one point per value with only that key changed; repeat "
    "for more keys. Not with --grid.")
_SET = flags.DEFINE_multi_string("set", [], "KEY=VALUE applied to every point (repeatable).")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Points trained at the same time.")
_CORES = flags.DEFINE_list(
    "cores", [], "CPU cores to pin the points to, one core per running point (e.g. 0,1: two "
    "points side by side, each on its own core, for comparisons at equal wall time); implies "
    "--parallel=len(cores) unless --parallel is smaller.")
_INIT_FROM = flags.DEFINE_string("init_from", None, "Passed to every train.py (a new run starts "
                                 "from this checkpoint).")
_EVAL_DATA = flags.DEFINE_string(
    "eval_data", None, "The task's held-out file (Sudoku: Kaggle-format CSV; chat: JSONL): "
    "after training, evaluate each point with eval.py (results join the table, headed by the "
    "task's headline metric).")
_EVAL_LIMIT = flags.DEFINE_integer("eval_limit", None, "eval.py --limit for --eval_data.")
_OUT = flags.DEFINE_string("out", None, "Comparison plot (PNG); default ROOT/compare.png; "
                           "'' for none.")


def main(argv):
  if len(argv) > 1:
    raise cli.UserError(f"unexpected argument {argv[1]!r}; flags are --KEY=VALUE")
  if not _CONFIG.value or not _ROOT.value:
    raise cli.UserError("--config and --root are required, e.g. --config=sft_sudoku "
                        "--root=runs/ablate --grid optimizer.lr=1e-3,3e-3")
  if _PARALLEL.value < 1:
    raise cli.UserError(f"--parallel must be >= 1, got {_PARALLEL.value}")
  try:
    cores = [int(c) for c in _CORES.value]
  except ValueError:
    raise cli.UserError(f"--cores={','.join(_CORES.value)}: expected core numbers, e.g. 0,1")
  available = os.sched_getaffinity(0)
  if any(c not in available for c in cores) or len(set(cores)) != len(cores):
    raise cli.UserError(f"--cores={','.join(_CORES.value)}: give distinct cores among "
                        f"{sorted(available)}")
  parallel = len(cores) if cores and not flags.FLAGS["parallel"].present else _PARALLEL.value
  if _EVAL_LIMIT.value is not None and _EVAL_LIMIT.value <= 0:
    raise cli.UserError(f"--eval_limit must be positive, got {_EVAL_LIMIT.value}")
  out = os.path.join(_ROOT.value, "compare.png") if _OUT.value is None else _OUT.value
  if out and not out.lower().endswith(".png"):
    raise cli.UserError(f"--out={out!r}: the plot is a PNG (name it FILE.png)")
  if _OUT.value:
    errors.check_output_file(out, "out")
  logging.set_verbosity(logging.ERROR)  # orbax's notes on reading checkpoint directories
  from diffgemma.tasks import make_task
  from diffgemma.tools import compare, sweep

  points = sweep.plan(_CONFIG.value, _ROOT.value, _GRID.value, _SET.value, _INIT_FROM.value,
                      _VARY.value)
  if _EVAL_DATA.value:  # a bad file fails now, before anything trains
    make_task(points[0].config, training=False).load_eval_file(_EVAL_DATA.value,
                                                               _EVAL_LIMIT.value)
  sets = [cli.parse_assignment(s, "set") for s in _SET.value]
  counts = {s: sum(p.status == s for p in points) for s in
            (sweep.FINISHED, sweep.RESUME, sweep.NEW, sweep.RUNNING)}
  print(f"sweep: {len(points)} points under {_ROOT.value}: {counts[sweep.FINISHED]} finished, "
        f"{counts[sweep.RESUME]} to resume, {counts[sweep.NEW]} new"
        + (f", {counts[sweep.RUNNING]} being trained by another process (left alone)"
           if counts[sweep.RUNNING] else "") + f"; {parallel} at a time"
        + (f", one core each ({','.join(map(str, cores))})" if cores else ""), flush=True)

  jobs = [sweep.Job(p.name, sweep.train_command(_CONFIG.value, p, sets, _INIT_FROM.value),
                    os.path.join(p.workdir, sweep.LOG_NAME),
                    on_exit=lambda rc, w=p.workdir: sweep.describe_end(w),
                    skip=sweep.train_job_skip(p),
                    lock_path=os.path.join(p.workdir, sweep.LOCK_NAME))
          for p in points if p.status in (sweep.RESUME, sweep.NEW)]
  codes = sweep.run_jobs(jobs, parallel, out=lambda line: print(line, flush=True), cores=cores)
  if _EVAL_DATA.value:
    # Every finished point (a point another sweep process still trains is left to it).
    eval_jobs = [j for j in (sweep.eval_job(p, _EVAL_DATA.value, _EVAL_LIMIT.value)
                             for p in points if codes.get(p.name, 0) == 0
                             and sweep.point_status(p) == sweep.FINISHED) if j is not None]
    codes.update(sweep.run_jobs(eval_jobs, parallel, out=lambda line: print(line, flush=True),
                                cores=cores))

  runs = compare.load_runs([p.workdir for p in points
                            if os.path.isfile(os.path.join(p.workdir, "config.json"))])
  if runs:
    print()
    print(compare.format_table(runs))
    if out and any(run.series for run in runs):
      width, height = compare.plot(runs, errors.prepare_output_file(out, "out"))
      print(f"\nplot: {out} ({width}x{height})")
  failed = sorted(name for name, rc in codes.items() if rc != 0)
  if failed:
    raise cli.UserError(f"{len(failed)} job(s) failed: {', '.join(failed)} (see their logs)")


if __name__ == "__main__":
  cli.run(main)
