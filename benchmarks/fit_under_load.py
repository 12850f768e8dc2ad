"""A budget-fitted run with a busy process on its core for its first minutes, and one without.

  python benchmarks/fit_under_load.py --out=runs/fit_load [--minutes=10] [--load_minutes=2] \
      [--core=1] [--config=sft_sudoku] [--runs=quiet,loaded] [--config_overrides=KEY=VALUE,...]

Each run is `train.py --config=CONFIG --config.num_train_steps=0
--config.max_train_minutes=MINUTES` pinned to `--core` (`taskset`), in OUT/quiet and OUT/loaded,
one after the other; beside the loaded one a busy Python loop pinned to the same core runs for
its first `--load_minutes`. Then, for each, prints from its run_info.json: the count its
calibration fitted, each re-fit (step, count before -> after, reason, steps/s), the step and
reason it stopped at, and the minutes of its budget it left unused. A run that ends by its
schedule with under 2 minutes unused used its budget; `max_train_minutes` as the stop reason
means the deadline cut its schedule. An existing OUT/NAME is resumed, not restarted: give a new
--out for a new measurement.
"""

import datetime
import os
import subprocess
import sys
import time

from absl import flags

from diffgemma import cli
from diffgemma.runs import provenance

_OUT = flags.DEFINE_string("out", None, "Directory for the runs' workdirs (OUT/quiet, OUT/loaded).")
_MINUTES = flags.DEFINE_float("minutes", 10.0, "Each run's max_train_minutes.")
_LOAD_MINUTES = flags.DEFINE_float("load_minutes", 2.0,
                                   "Minutes the busy process shares the loaded run's core.")
_CORE = flags.DEFINE_integer("core", 1, "The CPU core both runs (and the busy process) use.")
_CONFIG = flags.DEFINE_string("config", "sft_sudoku", "train.py's --config.")
_RUNS = flags.DEFINE_list("runs", ["quiet", "loaded"], "Which runs, in order: quiet, loaded.")
_OVERRIDES = flags.DEFINE_list("config_overrides", [], "KEY=VALUE train.py overrides, for both.")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_NAMES = ("quiet", "loaded")
BUSY = "while True: pass"


def check_args() -> None:
  """UserError (one line) for flags that cannot make a measurement; nothing is started."""
  if not _OUT.value:
    raise cli.UserError("--out is required: the directory for the runs' workdirs")
  if _MINUTES.value <= 0:
    raise cli.UserError(f"--minutes must be > 0, got {_MINUTES.value:g}")
  if not 0 <= _LOAD_MINUTES.value <= _MINUTES.value:
    raise cli.UserError(f"--load_minutes must be in [0, --minutes={_MINUTES.value:g}], got "
                        f"{_LOAD_MINUTES.value:g}")
  unknown = [name for name in _RUNS.value if name not in RUN_NAMES]
  if unknown or not _RUNS.value:
    raise cli.UserError(f"--runs takes names from {','.join(RUN_NAMES)}, got "
                        f"{','.join(_RUNS.value) or 'none'}")
  if _CORE.value not in os.sched_getaffinity(0):
    raise cli.UserError(f"--core={_CORE.value} is not a core this process may use: choose one "
                        f"of {sorted(os.sched_getaffinity(0))}")
  bad = [kv for kv in _OVERRIDES.value if "=" not in kv]
  if bad:
    raise cli.UserError(f"--config_overrides {bad[0]!r}: expected KEY=VALUE")


def train(workdir: str, loaded: bool) -> int:
  """Run train.py pinned to the core (with the busy process beside it for its first
  --load_minutes when `loaded`); its exit status."""
  pin = ["taskset", "-c", str(_CORE.value)]
  command = [*pin, sys.executable, "train.py", f"--config={_CONFIG.value}",
             f"--workdir={workdir}", "--config.num_train_steps=0",
             f"--config.max_train_minutes={_MINUTES.value:g}",
             *(f"--config.{kv}" for kv in _OVERRIDES.value)]
  busy = subprocess.Popen([*pin, sys.executable, "-c", BUSY]) if loaded else None
  proc = subprocess.Popen(command, cwd=REPO)
  try:
    if busy is not None:
      try:
        proc.wait(timeout=60 * _LOAD_MINUTES.value)
      except subprocess.TimeoutExpired:
        pass
      busy.kill()
      busy.wait()
    return proc.wait()
  finally:
    for p in (busy, proc):
      if p is not None and p.poll() is None:
        p.kill()
        p.wait()


def summary(name: str, workdir: str) -> str:
  """What the run fitted, re-fitted and left unused, from its run_info.json."""
  invocations = provenance.load_run_info(workdir)["invocations"]
  if not invocations:
    return f"{name}: no run_info.json in {workdir}"
  last = invocations[-1]
  fit = next((i["budget_fit"] for i in invocations if "budget_fit" in i), None)
  lines = [f"{name}: " + (f"calibration fitted {fit['num_train_steps']} steps at "
                          f"{1 / fit['seconds_per_step']:.2f} steps/s (step "
                          f"{fit['calibration_steps']})" if fit else "no calibration recorded")]
  for invocation in invocations:
    for refit in invocation.get("budget_refits", []):
      if refit["before"] != refit["after"]:
        pace = refit["seconds_per_step"]
        lines.append(f"  re-fit at step {refit['step']}: {refit['before']} -> {refit['after']} "
                     f"({refit['reason']}, {1 / pace:.2f} steps/s)")
  if "ended" in last:
    used = (datetime.datetime.fromisoformat(last["ended"])
            - datetime.datetime.fromisoformat(last["started"])).total_seconds() / 60
    lines.append(f"  stopped at step {last['end_step']} ({last['stop_reason']}) after "
               f"{used:.1f} min: {_MINUTES.value - used:.1f} of {_MINUTES.value:g} min unused")
  else:
    lines.append("  did not end normally (see its output above)")
  return "\n".join(lines)


def main(argv):
  del argv
  check_args()
  reports = []
  for name in _RUNS.value:
    workdir = os.path.abspath(os.path.join(_OUT.value, name))
    print(f"--- {name} run in {workdir}", flush=True)
    began = time.time()
    code = train(workdir, loaded=name == "loaded")
    print(f"--- {name}: exit {code} after {(time.time() - began) / 60:.1f} min", flush=True)
    reports.append(summary(name, workdir))
  print("\n".join(reports))


if __name__ == "__main__":
  cli.run(main)
