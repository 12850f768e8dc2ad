"""Sweeps: the cross product of config overrides, or one override at a time, run as ordinary
`train.py` processes.

`--grid` keys make the cross product; `--vary` keys make a one-factor-at-a-time design instead:
the recipe itself (the point named `recipe`) and one point per value with only that key
changed, the usual first sweep over many settings (n values cost n + 1 runs, not their product).
Each point of the grid is one workdir under the sweep's root, named by its grid overrides in
command-line order (`ROOT/optimizer.lr=3e-3,model.num_layers=2`); `--set` overrides apply to
every point and do not enter the name. Values are strings parsed exactly as train.py parses
`--config.KEY=VALUE` (`cli.parse_config`), and every point's config is parsed and validated
before any process starts, so a bad key, a value of the wrong type or an inconsistent config is
one line and nothing runs.

A point is finished when its last training invocation ended at num_train_steps or on its
max_train_minutes deadline (`provenance.finished`, from run_info.json), or, for a run whose
loop did not record that, when its latest checkpoint is at num_train_steps. Rerunning a sweep
skips finished points, resumes unfinished ones (train.py resumes a workdir exactly) and leaves
alone a point whose trainer is still alive.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Callable

from diffgemma import cli
from diffgemma.runs import provenance
from diffgemma.tools import compare

TRAIN_PY = os.path.join(provenance.REPO_ROOT, "train.py")
EVAL_PY = os.path.join(provenance.REPO_ROOT, "eval.py")
LOG_NAME = "train.log"  # each point's train.py output, appended per invocation
LOCK_NAME = "sweep.lock"  # the pid of the sweep process running a point's job
MAX_NAME_BYTES = 255  # a file name's limit on common file systems
_POLL_S = 0.5
_INTERRUPT_GRACE_S = 60

FINISHED, RESUME, NEW, RUNNING = "finished", "resume", "new", "running"
RECIPE_POINT = "recipe"  # the unchanged recipe's point in a --vary sweep


def point_name(assignments: list[tuple[str, str]]) -> str:
  """The workdir name of a grid point: "k1=v1,k2=v2" (a '/' in a value becomes '_'); the
  recipe unchanged is `RECIPE_POINT`."""
  if not assignments:
    return RECIPE_POINT
  return ",".join(f"{k}={v.replace(os.sep, '_')}" for k, v in assignments)


def overrides(assignments: list[tuple[str, str]]) -> list[str]:
  return [f"--config.{k}={v}" for k, v in assignments]


@dataclasses.dataclass
class Point:
  name: str
  workdir: str
  grid: list  # [(key, value string)]: this point's grid coordinates
  config: object  # the parsed ConfigDict train.py will see
  status: str = NEW  # FINISHED | RESUME | NEW | RUNNING

  @property
  def num_train_steps(self) -> int:
    return int(self.config.num_train_steps)


def validate_config(config, name: str, init_from: str | None = None) -> None:
  """What train.py checks before it writes anything (`loop.prepare_config`)."""
  from diffgemma import errors
  from diffgemma.training import loop

  try:
    loop.prepare_config(config, None, init_from, planning=True)
  except (errors.ConfigError, errors.InputError) as e:
    raise cli.UserError(f"point {name}: {errors.one_line(e)}") from None


def _value_at(flat: dict, key: str):
  """A flattened config's value at `key` (None when absent)."""
  value = flat.get(key)
  return tuple(value) if isinstance(value, list) else value


def _check_existing(point: Point, keys: list[str], init_from: str | None) -> None:
  """A workdir from an earlier sweep must have been run with the same overrides (the `--set`
  ones are not in its name)."""
  saved_path = os.path.join(point.workdir, "config.json")
  if not os.path.isfile(saved_path):
    return
  with open(saved_path) as f:
    saved = compare.flatten(json.load(f))
  wanted = compare.flatten(point.config.to_dict())
  for key in keys:
    old, new = _value_at(saved, key), _value_at(wanted, key)
    if old != new:
      raise cli.UserError(
          f"{point.workdir} was run with {key}={compare.format_value(old)}, this sweep asks "
          f"for {compare.format_value(new)}; use another --root")
  if init_from and saved.get("init_from") not in (None, os.path.abspath(init_from)):
    raise cli.UserError(f"{point.workdir} was initialised from {saved['init_from']}, not "
                        f"{init_from}; use another --root")


def point_status(point: Point) -> str:
  if provenance.running(point.workdir):
    return RUNNING
  if provenance.finished(point.workdir):
    return FINISHED
  if not os.path.isdir(os.path.join(point.workdir, "checkpoints")):
    return NEW
  from diffgemma.runs import checkpointing

  step = checkpointing.latest_step(point.workdir)
  if step is None:
    return NEW
  target = point.num_train_steps
  if target == 0:  # fitted to the budget: the count the run saved when it started
    with open(os.path.join(point.workdir, "config.json")) as f:
      target = int(json.load(f)["num_train_steps"])
  return FINISHED if target and step >= target else RESUME


def designs(grids: list[tuple[str, list[str]]], varied: list[tuple[str, list[str]]]
            ) -> list[list[tuple[str, str]]]:
  """The points' override lists: the cross product of `grids`, or, for `varied`, the recipe
  (no override) then each value of each key alone, in command-line order."""
  if grids:
    return [list(combo) for combo in
            itertools.product(*[[(k, v) for v in values] for k, values in grids])]
  return [[]] + [[(k, v)] for k, values in varied for v in values]


def plan(config_path: str, root: str, grid_specs: list[str], set_specs: list[str],
         init_from: str | None = None, vary_specs: list[str] = ()) -> list[Point]:
  """Parse, validate and classify every point; raises UserError before anything runs."""
  grids = cli.parse_value_lists(grid_specs, "grid")
  varied = cli.parse_value_lists(list(vary_specs), "vary")
  if not grids and not varied:
    raise cli.UserError("give at least one --grid KEY=V1,V2,... (cross product) or --vary "
                        "KEY=V1,V2,... (one key at a time)")
  if grids and varied:
    raise cli.UserError("--grid (cross product) and --vary (one key at a time) do not mix; "
                        "run them as two sweeps with their own --root")
  sets = [cli.parse_assignment(s, "set") for s in set_specs]
  for key, _ in sets:
    if key in dict(grids) or key in dict(varied):
      flag = "--grid" if key in dict(grids) else "--vary"
      raise cli.UserError(f"key {key!r} is in both {flag} and --set")
  if init_from is not None and not os.path.exists(init_from):
    raise cli.UserError(f"--init_from {init_from!r} does not exist")
  points = []
  for grid in designs(grids, varied):
    name = point_name(grid)
    if len(name.encode()) > MAX_NAME_BYTES:
      raise cli.UserError(f"point name {name[:60]!r}... is longer than {MAX_NAME_BYTES} bytes")
    config = cli.parse_config(config_path, overrides(sets + grid))
    validate_config(config, name, init_from)
    points.append(Point(name, os.path.join(os.path.abspath(root), name), grid, config))
  keys = [k for k, _ in sets] + [k for k, _ in grids + varied]
  for point in points:
    _check_existing(point, keys, init_from)
    point.status = point_status(point)
  return points


def train_command(config_path: str, point: Point, set_specs: list[tuple[str, str]],
                  init_from: str | None) -> list[str]:
  command = [sys.executable, TRAIN_PY, f"--config={config_path}", f"--workdir={point.workdir}",
             *overrides(set_specs + point.grid)]
  return command + ([f"--init_from={init_from}"] if init_from else [])


@dataclasses.dataclass
class Job:
  """One subprocess: its command, where its output goes, what to say when it ends."""
  name: str
  command: list[str]
  log_path: str
  stdout_path: str | None = None  # else stdout goes to the log too
  on_exit: Callable[[int], str] | None = None  # rc -> a line for the user
  # Checked when the job's turn comes: a reason not to start it (e.g. another sweep process
  # on the same root has trained the point meanwhile), else None.
  skip: Callable[[], str | None] | None = None
  # Held (holding this sweep process's pid) while the job runs, so that another sweep process
  # on the same root does not start the same job (`held_by_other`); None: no lock.
  lock_path: str | None = None


def held_by_other(lock_path: str) -> bool:
  """Whether `lock_path` names a live process other than this one."""
  try:
    with open(lock_path) as f:
      pid = int(f.read().strip())
  except (OSError, ValueError):
    return False
  return pid != os.getpid() and provenance.process_alive(pid)


def train_job_skip(point: Point) -> Callable[[], str | None]:
  """A train job's `skip`: the point finished or is being trained since the sweep planned it,
  which happens when two sweep processes share one root (say one per core, started apart)."""

  def reason() -> str | None:
    status = point_status(point)
    if status == FINISHED:
      return "finished by another process"
    if status == RUNNING:
      return "being trained by another process"
    return None

  return reason


def run_jobs(jobs: list[Job], parallel: int, out=print, cores: list[int] | None = None
             ) -> dict[str, int]:
  """Run the jobs, at most `parallel` at a time, each writing its output to its log (appended);
  returns {name: exit code}. With `cores`, each running job is pinned to one of them (a free
  one; at most len(cores) at a time), so points timed side by side get one core each. Ctrl-C
  interrupts the running ones (each saves nothing past its last checkpoint; a rerun resumes
  there) and re-raises."""
  pending, active, codes = list(jobs), {}, {}
  total = len(jobs)
  if cores:
    parallel = min(parallel, len(cores))
  try:
    while pending or active:
      while pending and len(active) < parallel:
        job = pending.pop(0)
        reason = job.skip() if job.skip else None
        if reason is None and job.lock_path and held_by_other(job.lock_path):
          reason = "being run by another sweep process"
        if reason:
          total -= 1
          out(f"skipped {job.name}: {reason}")
          continue
        if job.lock_path:
          os.makedirs(os.path.dirname(job.lock_path), exist_ok=True)
          with open(job.lock_path, "w") as f:
            f.write(str(os.getpid()))
        busy = {entry[5] for entry in active.values()}
        core = next((c for c in cores if c not in busy), None) if cores else None
        os.makedirs(os.path.dirname(job.log_path), exist_ok=True)
        log = open(job.log_path, "a")
        log.write(f"\n=== {provenance.now()} {shlex.join(job.command)}\n")
        log.flush()
        stdout = open(job.stdout_path, "w") if job.stdout_path else log
        pin = None if core is None else (lambda c=core: os.sched_setaffinity(0, {c}))
        proc = subprocess.Popen(job.command, stdout=stdout, stderr=log,
                                stdin=subprocess.DEVNULL, preexec_fn=pin)
        active[job.name] = (job, proc, log, stdout, time.time(), core)
        out(f"[{len(codes) + len(active)}/{total}] started {job.name}"
            + ("" if core is None else f" on core {core}") + f" (log: {job.log_path})")
      for name, (job, proc, log, stdout, start, _) in list(active.items()):
        rc = proc.poll()
        if rc is None:
          continue
        log.close()
        if stdout is not log:
          stdout.close()
        del active[name]
        codes[name] = rc
        if job.lock_path and not held_by_other(job.lock_path):
          try:
            os.remove(job.lock_path)
          except FileNotFoundError:
            pass
        minutes = (time.time() - start) / 60
        line = job.on_exit(rc) if job.on_exit else ""
        if rc == 0:
          out(f"done {name} in {minutes:.1f} min{': ' + line if line else ''}")
        else:
          out(f"FAILED {name} (exit code {rc}) after {minutes:.1f} min: {_last_line(job.log_path)}")
      if active:
        time.sleep(_POLL_S)
  except KeyboardInterrupt:
    for job, proc, *_ in active.values():
      proc.send_signal(signal.SIGINT)
    deadline = time.time() + _INTERRUPT_GRACE_S
    for job, proc, *_ in active.values():
      try:
        proc.wait(timeout=max(deadline - time.time(), 0.1))
      except subprocess.TimeoutExpired:
        proc.kill()
    raise
  return codes


def _last_line(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      lines = [l.strip() for l in f.read().replace("\r", "\n").splitlines() if l.strip()]
  except OSError:
    return "(no log)"
  return lines[-1] if lines else "(empty log)"


def describe_end(workdir: str) -> str:
  """How a point's training ended, from its run_info.json."""
  done = provenance.finished(workdir)
  if done is None:
    return "not finished"
  return f"stopped at step {done['end_step']} ({done['stop_reason']})"


# ----------------------------------------------------------------------------- held-out eval


def heldout_path(workdir: str, data_path: str) -> str:
  name = os.path.splitext(os.path.basename(data_path))[0]
  return os.path.join(workdir, compare.HELDOUT_DIR, name + ".json")


def eval_job(point: Point, data_path: str, limit: int | None) -> Job | None:
  """eval.py on the point's latest checkpoint, unless its result for this checkpoint and data
  exists; None when there is nothing to evaluate."""
  from diffgemma.runs import checkpointing

  step = checkpointing.latest_step(point.workdir)
  if step is None:
    return None
  result = heldout_path(point.workdir, data_path)

  def done() -> bool:
    if not os.path.isfile(result):
      return False
    with open(result) as f:
      saved = json.load(f)
    return (saved.get("checkpoint_step") == step
            and saved.get("data") == os.path.abspath(data_path) and saved.get("limit") == limit)

  if done():
    return None
  stem = os.path.splitext(result)[0]
  command = [sys.executable, EVAL_PY, f"--workdir={point.workdir}", f"--data={data_path}"]
  command += [f"--limit={limit}"] if limit else []

  def on_exit(rc: int) -> str:
    if rc != 0:
      return ""
    try:  # eval.py's last line is its metrics
      with open(stem + ".out") as f:
        metrics = json.loads(f.read().strip().splitlines()[-1])
    except (OSError, IndexError, ValueError):
      return f"no metrics in {stem}.out"
    metrics.pop("step_profile", None)
    metrics["limit"] = limit
    with open(result, "w") as f:
      json.dump(metrics, f, indent=2)
    headline = compare.headline_metric(metrics)
    shown = f"{headline} {metrics[headline]:.3f}, " if headline in metrics else ""
    return f"{os.path.basename(data_path)}: {shown}TPF {metrics['tokens_per_forward']:.2f}"

  return Job(f"eval {point.name}", command, stem + ".log", stem + ".out", on_exit,
             skip=lambda: "evaluated by another process" if done() else None,
             lock_path=stem + ".lock")
