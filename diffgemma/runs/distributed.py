"""Many hosts: one process per host (or per group of devices) on JAX's multi-controller runtime.

  python train.py --distributed ...          # the cluster says who is who (SLURM, Open MPI,
                                              # Cloud TPU, GKE; or JAX_COORDINATOR_ADDRESS ...)
  python train.py --coordinator_address=HOST:PORT --num_processes=N --process_id=I ...
      (or the environment: DIFFGEMMA_COORDINATOR, DIFFGEMMA_NUM_PROCESSES, DIFFGEMMA_PROCESS_ID)
  python scripts/launch_local.py --num_processes=2 -- train.py ...   # N processes on this machine

`initialize` (from the entry scripts, before anything touches a device) starts the runtime; from
then on `jax.devices()` is the global device set and the mesh, sharding and checkpoint code is
the single-host code. On CPUs the collectives go through gloo. What else this module owns:

  one voice   processes other than 0 print nothing on stdout (their stderr stays: an error
              line is every process's own); the progress bar, TensorBoard and the run's files
              are process 0's (`primary`); checkpoints are orbax's (each process writes its
              shards, process 0 commits);
  same run    `check_same_run`: every process runs the same config, flags and code, else one
              line on every process before any step;
  agree       `agree`: a value decided by process 0 (e.g. the workdir lock's outcome) learned by
              every process; `agree_any`: a reason any process raised (a stop signal), learned
              by every process at the same call (so all of them stop at the same step);
  watchdog    each process beats in the coordinator's key-value store; when one stops beating
              (killed, stopped, crashed, its machine gone) for `heartbeat_timeout_s`, or ends
              with an error, every other process prints one line naming it (and, in train.py,
              the last complete checkpoint: `resume_point`) and exits with LOST_EXIT_CODE: none
              hangs on a collective. When the coordinator's service stops answering (a round
              trip fails, or has not come back within `heartbeat_timeout_s`: the process
              stopped), the line names process 0. A rerun of the same command resumes from the
              last complete checkpoint.
  supervisor  when process 0 itself dies, JAX's client in every other process sees it first
              (its poll of the coordination service fails at once) and aborts the process in
              C++, where no Python runs. So a multi-process run's process re-executes itself
              before JAX starts (`initialize_from_flags`, diffgemma/runs/supervisor.py): the
              parent passes the child's output and signals through, and turns JAX's fatal log
              into the same one line (`COORDINATOR_GONE`) and exit status.

The key-value store is the one `jax.distributed` starts on process 0 (JAX's own client; its
Python handle is `jax._src.distributed.global_state.client`, used here and nowhere else).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import sys
import threading
import time
from typing import Callable

import numpy as np
from absl import flags

from diffgemma import errors
from diffgemma.runs import supervisor

ENV_COORDINATOR = "DIFFGEMMA_COORDINATOR"
ENV_NUM_PROCESSES = "DIFFGEMMA_NUM_PROCESSES"
ENV_PROCESS_ID = "DIFFGEMMA_PROCESS_ID"
# Exit status of a process that stopped because another one was lost (cli: 2 user error,
# 3 a run stopped on purpose, 130 interrupted).
LOST_EXIT_CODE = 4
HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 30
# JAX's own heartbeat (its end is an abort with a C++ stack trace) waits this many times ours, so
# the watchdog's one line comes first.
JAX_HEARTBEAT_FACTOR = 4
# How long a process waits for the others at start-up (all of them must have started).
INIT_TIMEOUT_S = 300
_KEY = "diffgemma"  # the key-value store's namespace
# A heartbeat's last value: ended normally, with an error of its own, or with an error every
# process raises at the same point (errors.on_every_process; the others go on to raise it too).
DONE, FAILED, FAILED_ON_EVERY_PROCESS = "done", "failed", "failed-on-every-process"
# On its own error, process 0 (whose store the others read) waits this long for them to end; on
# an error every process raises, up to the heartbeat timeout (the others may still be on their
# way to the point where they raise it).
SETTLE_S = 5.0
JOIN_S = 10.0  # at exit, the longest wait for the watchdog's beat in flight to return
# Why a process stops when the coordinator's service is gone (after "process 0 of N (the
# coordinator)"): its round trip failed or never came back, or JAX's client aborted on it.
COORDINATOR_GONE = ("is gone: its coordination service is unreachable (killed, stopped, crashed, "
                    "or its host is down)")



def define_flags() -> None:
  """The entry scripts' flags of a multi-process run (train.py, eval.py, sample.py call this
  at import; a second call does nothing)."""
  if "distributed" in flags.FLAGS:
    return
  flags.DEFINE_bool(
      "distributed", False, "Start JAX's multi-controller runtime with the cluster's own "
      "settings (SLURM, Open MPI, Cloud TPU, GKE, or JAX_COORDINATOR_ADDRESS etc.); one "
      "process per host. See docs/scale.md, 'Many hosts'.")
  flags.DEFINE_string(
      "coordinator_address", None, f"HOST:PORT of process 0 (env {ENV_COORDINATOR}); with "
      "--num_processes and --process_id, a multi-process run without cluster auto-detection.")
  flags.DEFINE_integer(
      "num_processes", None, f"Processes of the run, all hosts together (env "
      f"{ENV_NUM_PROCESSES}).")
  flags.DEFINE_integer(
      "process_id", None, f"This process's index, 0..num_processes-1 (env {ENV_PROCESS_ID}).")
  flags.DEFINE_integer(
      "heartbeat_timeout_s", DEFAULT_HEARTBEAT_TIMEOUT_S, "A multi-process run stops (every "
      "process, with one line naming the lost one) when a process has not been heard from, "
      "or the coordinator has not answered, for this many seconds.")


def _jax():
  import jax  # local: importing this module (flag definitions) must not start JAX

  return jax


def settings(distributed: bool = False, coordinator_address: str | None = None,
             num_processes: int | None = None, process_id: int | None = None,
             env=None) -> dict | None:
  """{coordinator_address, num_processes, process_id} from the arguments (the flags), else the
  environment `env` (default os.environ); {} for `distributed` alone (the cluster's
  auto-detection); None for a single-process run. A partial setting is a one-line ConfigError."""
  env = os.environ if env is None else env
  explicit = {
      "coordinator_address": coordinator_address or env.get(ENV_COORDINATOR) or None,
      "num_processes": num_processes if num_processes is not None
                       else _int_env(env, ENV_NUM_PROCESSES),
      "process_id": process_id if process_id is not None else _int_env(env, ENV_PROCESS_ID)}
  given = {k: v for k, v in explicit.items() if v is not None}
  if not given:
    return {} if distributed else None
  if len(given) < len(explicit):
    missing = [f"--{k}" for k in explicit if k not in given]
    raise errors.ConfigError(f"a multi-process run needs --coordinator_address, "
                             f"--num_processes and --process_id; missing {', '.join(missing)}")
  if given["num_processes"] < 1 or not 0 <= given["process_id"] < given["num_processes"]:
    raise errors.ConfigError(f"--process_id={given['process_id']} is not in 0.."
                             f"{given['num_processes'] - 1} (--num_processes="
                             f"{given['num_processes']})")
  host, _, port = given["coordinator_address"].rpartition(":")
  if not host or not port.isdigit():
    raise errors.ConfigError(f"--coordinator_address={given['coordinator_address']!r}: write "
                             "HOST:PORT (process 0's host)")
  return given


def _int_env(env, name: str) -> int | None:
  value = env.get(name)
  if value in (None, ""):
    return None
  try:
    return int(value)
  except ValueError:
    raise errors.ConfigError(f"{name}={value!r} is not an integer") from None


def initialize_from_flags(resume_point: Callable[[], str] | None = None) -> bool:
  """Start the multi-process runtime if the flags or the environment ask for it (before any
  device is touched); True if this is a multi-process run. `resume_point`: see `initialize`.

  A multi-process run's process becomes a supervisor here (it never returns from this call)
  and runs the command again as its child, which goes on (module docstring)."""
  values = flags.FLAGS
  given = settings(values.distributed, values.coordinator_address, values.num_processes,
                   values.process_id)
  if given is None:
    return False
  if resume_point is not None:
    _resume["point"] = resume_point
  if not supervisor.follow_supervisor():
    supervisor.run_supervised(lambda told, fatal: _fatal_line(told, fatal, given),
                              LOST_EXIT_CODE)
  initialize(heartbeat_timeout_s=flags.FLAGS.heartbeat_timeout_s, resume_point=resume_point,
             **given)
  return _jax().process_count() > 1


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None,
               heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
               resume_point: Callable[[], str] | None = None) -> None:
  """jax.distributed.initialize (None everywhere: the cluster's auto-detection), gloo
  collectives on CPUs, no JAX preemption service, one voice, and the watchdog.
  `resume_point()`: the end of the line a process prints when another one is lost, read then
  (train.py: the last complete checkpoint and how to resume from it)."""
  jax = _jax()
  if resume_point is not None:
    _resume["point"] = resume_point
  if heartbeat_timeout_s < 2 * HEARTBEAT_INTERVAL_S:
    raise errors.ConfigError(f"--heartbeat_timeout_s={heartbeat_timeout_s} is too short; use "
                             f">= {int(2 * HEARTBEAT_INTERVAL_S)}")
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  # JAX's preemption service would take SIGTERM from train.py's handler (and swallow it in
  # eval.py and sample.py); a stop signal is diffgemma.runs.preemption's, agreed by `agree_any`.
  jax.config.update("jax_enable_preemption_service", False)
  try:
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               initialization_timeout=INIT_TIMEOUT_S,
                               heartbeat_timeout_seconds=JAX_HEARTBEAT_FACTOR * heartbeat_timeout_s)
  except (RuntimeError, ValueError) as e:
    where = coordinator_address or "the cluster's coordinator"
    raise errors.ConfigError(f"could not start the multi-process runtime ({where}): "
                             f"{errors.one_line(e)}") from None
  supervisor.report(process=jax.process_index(), count=jax.process_count())
  if jax.process_count() == 1:
    return
  if jax.process_index() != 0:
    _silence_stdout()
  _Watchdog(heartbeat_timeout_s).start()


def _silence_stdout() -> None:
  """One voice: this process's prints go nowhere (stderr stays; progress bars ask `primary`)."""
  sys.stdout.flush()
  sys.stdout = open(os.devnull, "w")


def is_multi_process() -> bool:
  jax = sys.modules.get("jax")
  return jax is not None and jax.process_count() > 1


def primary() -> bool:
  """Whether this process writes the run's files (process 0; the only one of a 1-process run)."""
  jax = sys.modules.get("jax")
  return jax is None or jax.process_index() == 0


def _client():
  from jax._src import distributed as jax_distributed  # JAX's key-value store client

  return jax_distributed.global_state.client


def _describe(index: int) -> str:
  return _name(index, _jax().process_count())


def _name(index: int, count: int | None) -> str:
  """"process 1 of 2", "process 0 of 2 (the coordinator)"; without " of N" when unknown."""
  name = f"process {index}" + (f" of {count}" if count else "")
  return name + " (the coordinator)" if index == 0 else name


def _fatal_line(told: dict, fatal: bytes, given: dict) -> str:
  """The supervisor's line when JAX's client aborted the child on an error of the coordination
  service: `told` is what the child reported (its index and the process count), `given` the
  settings (the fallback before the child reported), `fatal` JAX's fatal log line."""
  index = told.get("process", given.get("process_id"))
  count = told.get("count", given.get("num_processes"))
  if index == 0:  # the service is this process's own: it reported another process's failure
    status = fatal.decode(errors="replace").partition("absl::Status: ")[2] or "no status"
    reason = f"the coordination service reported a fatal error ({status[:120]})"
  else:
    reason = f"{_name(0, count)} {COORDINATOR_GONE}"
  me = f"process {index}" if index is not None else "this process"
  return f"{reason}; stopping {me}; {_resume_point()}"


def _resume_point() -> str:
  try:
    return _resume["point"]()
  except Exception as e:  # noqa: BLE001 -- the line must come out whatever the disk says
    return f"rerun the same command ({errors.one_line(e)[:80]})"


# ----------------------------------------------------------------------------- agreement

_sequence = {"n": 0}


def agree(name: str, decide: Callable[[], str]) -> str:
  """`decide()` on process 0; every process returns its result (a string). Every process must
  call `agree` in the same order (the calls are numbered). Single process: `decide()`."""
  if not is_multi_process():
    return decide()
  _sequence["n"] += 1
  key = f"{_KEY}/agree/{_sequence['n']}/{name}"
  client = _client()
  if _jax().process_index() == 0:
    value = decide()
    client.key_value_set(key, value)
    return value
  return client.blocking_key_value_get(key, INIT_TIMEOUT_S * 1000)


_raised: set = set()  # the names this process has posted to agree_any


def agree_any(name: str, mine: str) -> str:
  """A reason any process has raised (a non-empty string: e.g. a stop signal it received), the
  same on every process; "" while none has. Every process calls it at the same points (e.g.
  every step boundary). Process 0 decides: its own reason, else one another process posted
  under `name` (a process that raises posts once, then waits for the decision like the rest),
  so a reason raised on process 1 after process 0 decided counts at the next call. Costs one
  key-value round trip per call, no device sync. Single process: `mine`, no store."""
  if not is_multi_process():
    return mine
  client = _client()
  key = f"{_KEY}/raised/{name}"
  if mine and _jax().process_index() != 0 and name not in _raised:
    client.key_value_set(key, mine, allow_overwrite=True)
    _raised.add(name)

  def decide() -> str:
    if mine:
      return mine
    try:
      return client.key_value_try_get(key)
    except Exception as e:  # noqa: BLE001 -- JAX raises a plain error for a missing key
      if "NOT_FOUND" in str(e):
        return ""
      raise

  return agree(name, decide)


def fetch(tree):
  """numpy values of a tree of arrays, whole on every process: `jax.device_get`, and in a
  multi-process run the rows other processes hold gathered too."""
  jax = _jax()
  if not is_multi_process():
    return jax.device_get(tree)
  from jax.experimental import multihost_utils

  return jax.tree_util.tree_map(
      lambda x: (np.asarray(jax.device_get(x)) if x.is_fully_replicated
                 else np.asarray(multihost_utils.process_allgather(x, tiled=True))), tree)


def code_fingerprint() -> str:
  """sha256 of the package's Python sources and the entry scripts (paths and contents)."""
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  root = os.path.dirname(package)
  digest = hashlib.sha256()
  paths = [os.path.join(root, name) for name in ("train.py", "eval.py", "sample.py")]
  for directory, dirs, files in os.walk(package):
    dirs.sort()
    paths += [os.path.join(directory, f) for f in sorted(files) if f.endswith(".py")]
  for path in paths:
    if os.path.isfile(path):
      digest.update(os.path.relpath(path, root).encode() + b"\0")
      with open(path, "rb") as f:
        digest.update(f.read() + b"\0")
  return digest.hexdigest()


def _flat(tree, prefix=""):
  if isinstance(tree, dict):
    out = {}
    for k, v in tree.items():
      out.update(_flat(v, f"{prefix}{k}."))
    return out
  return {prefix[:-1]: tree}


def shared_argv(argv: list[str] | None = None) -> list[str]:
  """The command line (default sys.argv[1:]) without what differs between the processes of one
  run by design (--process_id)."""
  argv = sys.argv[1:] if argv is None else argv
  return [a for a in argv if not a.startswith(("--process_id=", "-process_id="))]


def check_same_run(config: dict, run_flags: dict) -> None:
  """Every process runs the same `config` (a dict), the same `run_flags` ({name: value}, the
  flags that shape the run) and the same code; else every process raises the same one-line
  ConfigError naming the first process that differs from process 0, before any step."""
  if not is_multi_process():
    return
  jax = _jax()
  mine = json.dumps({"config": config, "flags": run_flags, "code": code_fingerprint()},
                    sort_keys=True, default=str)
  client = _client()
  client.key_value_set(f"{_KEY}/run/{jax.process_index()}", mine)
  theirs = [client.blocking_key_value_get(f"{_KEY}/run/{i}", INIT_TIMEOUT_S * 1000)
            for i in range(jax.process_count())]
  first = json.loads(theirs[0])
  for i, text in enumerate(theirs[1:], start=1):
    if text == theirs[0]:
      continue
    other = json.loads(text)
    if other["code"] != first["code"]:
      what = "different code (diffgemma sources)"
    else:
      a = {**_flat(first["config"]), **{f"--{k}": v for k, v in first["flags"].items()}}
      b = {**_flat(other["config"]), **{f"--{k}": v for k, v in other["flags"].items()}}
      unset = "<unset>"
      keys = sorted((k for k in a.keys() | b.keys() if a.get(k, unset) != b.get(k, unset)),
                    key=lambda k: (k.startswith("--"), k))  # config keys first
      shown = ", ".join(f"{k}={b.get(k, unset)!r} vs {a.get(k, unset)!r}" for k in keys[:3])
      what = f"a different config ({shown}{', ...' if len(keys) > 3 else ''})"
    raise errors.on_every_process(errors.ConfigError(
        f"process {i} runs {what} than process 0; every process must run the same command on "
        "the same code"))


# ----------------------------------------------------------------------------- watchdog


class _Watchdog(threading.Thread):
  """Beats in the key-value store every HEARTBEAT_INTERVAL_S and watches the others' beats; on
  processes other than 0, a second thread (`watch_round_trips`) watches its round trips to the
  coordinator's service."""

  def __init__(self, timeout_s: float):
    super().__init__(daemon=True, name="diffgemma-watchdog")
    jax = _jax()
    self.timeout_s = timeout_s
    self.index, self.count = jax.process_index(), jax.process_count()
    self.client = _client()
    self.stopping = False  # this process is ending on its own error: report nothing else
    self.ended = threading.Event()  # no more beats: this process is ending
    self.in_flight_since: float | None = None  # when the round trip under way began
    atexit.register(self.finish)  # runs before jax's own shutdown (registered earlier)
    _watchdog["current"] = self

  def start(self) -> None:
    super().start()
    if self.index != 0:  # process 0's store is its own
      threading.Thread(target=self.watch_round_trips, daemon=True,
                       name="diffgemma-round-trips").start()

  def finish(self, state: str = DONE) -> None:
    """This process ended (DONE: normally, FAILED: with an error line of its own); the others
    do not report a DONE process as lost.

    The beats stop first, and at exit the thread is joined before the state is written: a beat
    after it would overwrite DONE, and a beat still running when JAX shuts the coordinator down
    (or while the interpreter finalizes, which aborts a daemon thread that is inside a gRPC
    call) would end a run that finished cleanly with an error."""
    self.ended.set()
    if threading.current_thread() is not self and self.is_alive():
      self.join(JOIN_S)
    try:
      self.client.key_value_set(self._key(self.index), state, allow_overwrite=True)
    except Exception:  # noqa: BLE001 -- the coordinator may be gone already
      pass

  def _key(self, index: int) -> str:
    return f"{_KEY}/heartbeat/{index}"

  def _round_trip(self, call: Callable[[], str | None]):
    """`call()`, a call of the store, timed for `watch_round_trips`."""
    self.in_flight_since = time.monotonic()
    try:
      return call()
    finally:
      self.in_flight_since = None

  def watch_round_trips(self) -> None:
    """A round trip that has not come back within the timeout: the coordinator's service is
    frozen (its process stopped, its host hung or cut off), and the call may never return."""
    while not self.ended.wait(HEARTBEAT_INTERVAL_S / 4):
      since = self.in_flight_since
      if since is not None and time.monotonic() - since > self.timeout_s:
        lost(f"{_describe(0)} {COORDINATOR_GONE}", store_reachable=False)

  def run(self) -> None:
    beat, seen, failed_at = 0, {}, {}
    while not self.ended.is_set():
      beat += 1
      now = time.monotonic()
      try:
        self._round_trip(lambda: self.client.key_value_set(self._key(self.index), str(beat),
                                                           allow_overwrite=True))
      except Exception:  # noqa: BLE001 -- the coordinator's store is unreachable
        if self.ended.is_set():
          return
        lost(f"{_describe(0)} {COORDINATOR_GONE}", store_reachable=False)
      for other in range(self.count):
        if other == self.index or self.ended.is_set():
          continue
        try:
          value = self._round_trip(lambda: self.client.key_value_try_get(self._key(other)))
        except Exception as e:  # noqa: BLE001
          if self.ended.is_set():
            return
          if "NOT_FOUND" not in str(e):
            lost(f"{_describe(0)} {COORDINATOR_GONE}", store_reachable=False)
          value = None  # it has not beaten yet
        if value == DONE:
          continue
        if value == FAILED_ON_EVERY_PROCESS and (
            now - failed_at.setdefault(other, now) <= self.timeout_s):
          continue  # this process raises the same error when it gets there
        if value in (FAILED, FAILED_ON_EVERY_PROCESS):  # the latter: this one never got there
          lost(f"{_describe(other)} stopped with an error (its own line says which)")
        last = seen.get(other)
        if last is None or last[0] != value:
          seen[other] = (value, now)
        elif now - last[1] > self.timeout_s:
          lost(f"{_describe(other)} is gone: not heard from for {self.timeout_s} s (killed, "
               "stopped, crashed, or its host is down)")
      self.ended.wait(HEARTBEAT_INTERVAL_S)

  def others_settled(self) -> bool:
    """Whether every other process has ended (done or failed)."""
    for other in range(self.count):
      if other == self.index:
        continue
      try:
        if self.client.key_value_try_get(self._key(other)) not in (DONE, FAILED,
                                                                   FAILED_ON_EVERY_PROCESS):
          return False
      except Exception:  # noqa: BLE001
        return False
    return True


_watchdog: dict = {"current": None}
_lost = threading.Lock()
_resume: dict = {"point": lambda: "rerun the same command"}  # see `initialize`


def lost(reason: str, store_reachable: bool = True) -> None:
  """Print the one line (the lost process, then `resume_point`) and end this process now (no
  shutdown barrier: it would wait for the lost process); nothing while this process is ending
  on its own (its own error, or its normal end). `store_reachable`: False when the coordinator's
  service is the one lost (this process's end is not written there: the call could hang)."""
  watchdog = _watchdog["current"]
  if watchdog is not None and (watchdog.stopping or watchdog.ended.is_set()):
    return
  with _lost:
    if watchdog is not None:
      if store_reachable:
        watchdog.finish(FAILED)  # a process waiting for this one to settle need not wait
      else:
        watchdog.ended.set()
    sys.stdout.flush()
    errors.print_error(f"{reason}; stopping process {_jax().process_index()}; "
                       f"{_resume_point()}")
    os._exit(LOST_EXIT_CODE)


def exit_now(code: int, on_every_process: bool = False) -> None:
  """End a multi-process run's process after its own error line: the others learn it failed
  (and stop with one line), and JAX's shutdown barrier, which would wait for processes that may
  never come, is skipped. `on_every_process`: the error is one every process raises at the same
  point (errors.on_every_process); the others raise it too, each with its own line. Process 0
  keeps the key-value store up until the others have read it (at most SETTLE_S, or the heartbeat
  timeout for an error every process raises)."""
  sys.stdout.flush()
  sys.stderr.flush()
  watchdog = _watchdog["current"]
  if watchdog is not None:
    watchdog.stopping = True
    watchdog.finish(FAILED_ON_EVERY_PROCESS if on_every_process else FAILED)
    deadline = time.monotonic() + (watchdog.timeout_s if on_every_process else SETTLE_S)
    while watchdog.index == 0 and time.monotonic() < deadline and not watchdog.others_settled():
      time.sleep(HEARTBEAT_INTERVAL_S / 4)
  os._exit(code)


def wait_for_lost() -> None:
  """After an unexpected error of a multi-process run (e.g. a collective that failed because a
  peer went away): give the watchdog time to name the lost process (it ends this process then).
  Returns if none is found lost within the heartbeat timeout: the error is this process's own."""
  watchdog = _watchdog["current"]
  if watchdog is not None:
    time.sleep(watchdog.timeout_s + 3 * HEARTBEAT_INTERVAL_S)
