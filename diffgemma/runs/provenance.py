"""What a run records about itself besides its config: `run_info.json` in the workdir.

config.json holds the resolved config (every key after command-line overrides, and init_from);
run_info.json holds one entry per invocation of the training loop on the workdir (a resumed run
appends one): when and how it started (`provenance()`: command line, working directory, package
version, git commit and whether the checkout had uncommitted changes, Python and JAX versions,
host, devices) and, when the loop ended without an error, the step it ended at and why:

  "num_train_steps"    the run reached its last step;
  "max_train_minutes"  it stopped on its wall-clock deadline (with a checkpoint);
  "stop_at"            the caller asked it to stop early (a simulated preemption);
  "preempted"          a SIGTERM or Ctrl-C stopped it at a step boundary (with a checkpoint).

A run whose schedule is fitted to its budget (`num_train_steps=0`, `training.budget`) adds
`budget_fit` (the calibration) to the invocation that started it, and `budget_refits` (one entry
per re-fit: step, seconds per step, count before and after, reason) to the invocation that took
each decision.

An invocation that ended records what the run had trained on by its end step, over all its
invocations: `examples_seen` and `real_tokens_seen` (the valid tokens of those examples:
prompts and canvases, not padding; a packed row counts each of its examples) and
`train_seconds` (wall-clock seconds of the training loops from their first step, compiles,
evaluations and checkpoints included; `train_seconds_at` keeps them at each checkpoint, where a
resumed run takes them up); the TensorBoard scalars of the same names follow them step by step.
Two runs compare per example and per minute by them.

It also holds `headline_metric`: the task's main metric (its periodic evaluation logs it as
`eval/NAME`), which tools/compare.py plots as the quality axis.

A run is *finished* when its last invocation ended for one of the first two reasons
(`finished`); a sweep skips finished runs and resumes the others (a preempted run among them). Both files are plain JSON,
readable by a person and by code.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys

from diffgemma import errors
from diffgemma.runs import distributed

RUN_INFO = "run_info.json"
NUM_TRAIN_STEPS, MAX_TRAIN_MINUTES, STOP_AT = "num_train_steps", "max_train_minutes", "stop_at"
PREEMPTED = "preempted"
FINISHED_REASONS = (NUM_TRAIN_STEPS, MAX_TRAIN_MINUTES)
# diffgemma/runs/provenance.py -> the repository (or the site-packages of an installed copy).
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_GIT_TIMEOUT_S = 10


def now() -> str:
  """Local time with its UTC offset, to the second (ISO 8601)."""
  return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def package_version() -> str | None:
  """The version in the checkout's pyproject.toml, else the installed distribution's."""
  try:
    import tomllib

    with open(os.path.join(REPO_ROOT, "pyproject.toml"), "rb") as f:
      return tomllib.load(f)["project"]["version"]
  except (OSError, KeyError, ValueError):
    pass
  try:
    return importlib.metadata.version("diffgemma")
  except importlib.metadata.PackageNotFoundError:
    return None


def _git(*args: str) -> str | None:
  try:
    out = subprocess.run(["git", "-C", REPO_ROOT, *args], capture_output=True, text=True,
                         timeout=_GIT_TIMEOUT_S)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> dict | None:
  """{commit, dirty} of the checkout this package runs from; None outside a git checkout (or
  when the package sits inside some other repository, e.g. installed into a venv there).
  `dirty`: tracked files differ from the commit (untracked files do not count)."""
  top = _git("rev-parse", "--show-toplevel")
  if top is None or os.path.realpath(top) != os.path.realpath(REPO_ROOT):
    return None
  commit = _git("rev-parse", "HEAD")
  if commit is None:  # a repository without commits
    return None
  status = _git("status", "--porcelain", "--untracked-files=no")
  return {"commit": commit, "dirty": bool(status) if status is not None else None}


def _jax_info() -> dict:
  """JAX version and devices, only when JAX is already imported (this module never starts it)."""
  jax = sys.modules.get("jax")
  if jax is None:
    return {}
  devices = jax.devices()
  return {"jax": jax.__version__, "devices": f"{len(devices)} x {devices[0].device_kind}",
          "processes": jax.process_count()}


def cpu_model() -> str:
  """The host CPU's model name (/proc/cpuinfo on Linux, else platform.processor())."""
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.lower().startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine() or "unknown"


def device_info() -> dict:
  """What produced a timing, for eval.py's JSON, sample.py's summary and the GPU suite:
  platform (jax's backend), device_kind and num_devices (jax's), jax (version), cpu (the host
  CPU model) and accelerator (the device kind on a GPU or TPU, else None). Imports JAX."""
  import jax

  devices = jax.devices()
  backend = jax.default_backend()
  kind = devices[0].device_kind
  return {"platform": backend, "device_kind": kind, "num_devices": len(devices),
          "jax": jax.__version__, "cpu": cpu_model(),
          "accelerator": None if backend == "cpu" else kind}


def describe_device(info: dict) -> str:
  """`device_info` in one line: "1 x NVIDIA H200 (gpu), jax 0.10.0, CPU AMD EPYC ..."."""
  return (f"{info['num_devices']} x {info['device_kind']} ({info['platform']}), "
          f"jax {info['jax']}, CPU {info['cpu']}")


def provenance(argv: list[str] | None = None) -> dict:
  """Where and how this process runs: start time, command line (default sys.argv), working
  directory, package version, git {commit, dirty} (None outside a checkout), Python and (when
  imported) JAX versions and devices, host name and process id."""
  return {"started": now(),
          "argv": list(sys.argv if argv is None else argv),
          "cwd": os.getcwd(),
          "package_version": package_version(),
          "git": git_state(),
          "python": platform.python_version(),
          **_jax_info(),
          "host": platform.node(),
          "pid": os.getpid()}


def _path(workdir: str) -> str:
  return os.path.join(workdir, RUN_INFO)


class RunInfoError(errors.RunError):
  """A run_info.json that cannot be read as the run's record. One-line message."""


def load_run_info(workdir: str) -> dict:
  """The workdir's run_info.json ({"invocations": []} when there is none); RunInfoError (one
  line) when it is not a JSON object with a list of invocations."""
  try:
    with open(_path(workdir)) as f:
      info = json.load(f)
  except FileNotFoundError:
    return {"invocations": []}
  except ValueError:
    info = None
  if not isinstance(info, dict) or not isinstance(info.setdefault("invocations", []), list):
    raise RunInfoError(f"{_path(workdir)} is not a run record (a JSON object with a list of "
                       "invocations); move it aside to start a fresh one")
  return info


def _save(workdir: str, info: dict) -> None:
  os.makedirs(workdir, exist_ok=True)
  tmp = _path(workdir) + ".tmp"
  with open(tmp, "w") as f:
    json.dump(info, f, indent=2)
    f.write("\n")
  os.replace(tmp, _path(workdir))


def record_start(workdir: str, start_step: int, argv: list[str] | None = None,
                 headline_metric: str | None = None) -> None:
  """Append this invocation (its `provenance()` and the step it starts from) to run_info.json,
  and set the run's `headline_metric` when given. Only process 0 of a multi-host run writes."""
  if not distributed.primary():
    return
  info = load_run_info(workdir)
  info["invocations"].append({**provenance(argv), "start_step": int(start_step)})
  if headline_metric:
    info["headline_metric"] = headline_metric
  _save(workdir, info)


def record_fit(workdir: str, calibration: dict) -> None:
  """Record, on the invocation that started the run, the schedule fitted to its budget
  (`training.budget.Calibration`: steps per second, eval and checkpoint seconds, the count)."""
  if not distributed.primary():
    return
  info = load_run_info(workdir)
  info["invocations"][-1]["budget_fit"] = calibration
  _save(workdir, info)


def record_refit(workdir: str, refit: dict) -> None:
  """Append a re-fit of the budget's schedule (`training.budget.Refit`) to this invocation's
  `budget_refits`; only process 0 writes."""
  if not distributed.primary():
    return
  info = load_run_info(workdir)
  info["invocations"][-1].setdefault("budget_refits", []).append(refit)
  _save(workdir, info)


def budget_fit(workdir: str) -> dict | None:
  """The run's latest calibration record (`record_fit`), or None."""
  for invocation in reversed(load_run_info(workdir)["invocations"]):
    if "budget_fit" in invocation:
      return invocation["budget_fit"]
  return None


def stop_reason(step: int, num_train_steps: int, timed_out: bool,
                preempted: bool = False) -> str:
  """Why a training loop that ended normally at `step` stopped (see the module docstring)."""
  if step >= num_train_steps:
    return NUM_TRAIN_STEPS
  if preempted:
    return PREEMPTED
  return MAX_TRAIN_MINUTES if timed_out else STOP_AT


def record_end(workdir: str, step: int, reason: str, seen: dict | None = None) -> None:
  """Mark the last invocation as ended at `step` for `reason` (after its final checkpoint is
  written), with what the run had trained on by then (`seen`: examples_seen, real_tokens_seen,
  train_seconds); only process 0 writes."""
  if not distributed.primary():
    return
  info = load_run_info(workdir)
  if not info["invocations"]:  # a loop that did not record its start: record it now
    info["invocations"].append(provenance())
  info["invocations"][-1].update(ended=now(), end_step=int(step), stop_reason=reason,
                                 **(seen or {}))
  _save(workdir, info)


def record_train_seconds(workdir: str, step: int, seconds: float) -> None:
  """Record on this invocation the run's train_seconds at its checkpoint `step`, where a
  resumed run takes them up (`train_seconds_at`); only process 0 writes."""
  if not distributed.primary():
    return
  info = load_run_info(workdir)
  info["invocations"][-1].setdefault("train_seconds_at", {})[str(int(step))] = round(seconds, 3)
  _save(workdir, info)


def train_seconds_at(workdir: str, step: int) -> float:
  """The run's train_seconds at its checkpoint `step` (`record_train_seconds`); 0 for a new run,
  or for a checkpoint written before they were recorded."""
  for invocation in reversed(load_run_info(workdir)["invocations"]):
    seconds = invocation.get("train_seconds_at", {}).get(str(int(step)))
    if seconds is not None:
      return float(seconds)
  return 0.0


def running(workdir: str) -> dict | None:
  """The last invocation if it has not ended and its process is alive on this host (so a second
  process must not train the same workdir), else None."""
  invocations = load_run_info(workdir)["invocations"]
  last = invocations[-1] if invocations else {}
  if "ended" in last or last.get("host") != platform.node() or "pid" not in last:
    return None
  return last if process_alive(last["pid"]) else None


def process_alive(pid: int) -> bool:
  """Whether process `pid` exists on this host (another user's counts as alive)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass
  return True


def finished(workdir: str) -> dict | None:
  """The last invocation if it ended finished (num_train_steps or max_train_minutes), else
  None: a run that never started, is running, crashed, or was stopped early (stop_at,
  preempted)."""
  invocations = load_run_info(workdir)["invocations"]
  if invocations and invocations[-1].get("stop_reason") in FINISHED_REASONS:
    return invocations[-1]
  return None
