"""One trainer per workdir: an exclusive lock on `WORKDIR/.lock`.

The lock is `fcntl.flock` on the file, so the kernel releases it when the holding process dies,
however it dies (SIGKILL included): a crashed run never blocks the next one. The file holds
JSON naming the holder (host, PID, start time, command) for the error a second trainer prints.
Content without a lock is what a dead holder left behind; it is taken over, with a notice. On
Linux, a holder is also recognised by its process start time (the file alone cannot say whether
a PID was reused), so a lock file that lost its `flock` (deleted and recreated under a running
trainer) still refuses a second trainer while the first is alive.

The file is never deleted: unlinking a locked path lets two processes hold locks on two
different files of the same name. Release clears its content instead.

  with workdir_lock.hold(workdir):
    ...  # everything that writes to the workdir
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
from typing import Callable, Iterator

from diffgemma import errors
from diffgemma.runs import distributed

LOCK_FILE = ".lock"


class WorkdirLockError(errors.RunError):
  """The workdir's lock cannot be taken. One-line message."""

  def __str__(self):
    return str(self.args[0])


class WorkdirBusyError(WorkdirLockError):
  """Another live trainer holds the workdir."""


def lock_path(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), LOCK_FILE)


def _boot_id() -> str | None:
  try:
    with open("/proc/sys/kernel/random/boot_id") as f:
      return f.read().strip()
  except OSError:
    return None


def _process_start(pid: int) -> int | None:
  """Start time of `pid` in clock ticks since boot (Linux /proc), None where unknown."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      stat = f.read()
  except OSError:
    return None
  # Field 22; the command name (field 2) may hold spaces and parentheses: split after its ')'.
  fields = stat[stat.rindex(")") + 2:].split()
  return int(fields[19])


def holder_info() -> dict:
  """What this process writes into the lock file."""
  return {"host": socket.gethostname(), "pid": os.getpid(),
          "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
          "boot_id": _boot_id(), "process_start": _process_start(os.getpid()),
          "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:])[:300]}


def read_holder(path: str) -> dict | None:
  """The holder recorded in a lock file; None if the file is missing, empty or not ours."""
  try:
    with open(path) as f:
      text = f.read()
  except OSError:
    return None
  try:
    info = json.loads(text) if text.strip() else None
  except ValueError:
    return None
  return info if isinstance(info, dict) and "pid" in info else None


def holder_alive(info: dict) -> bool:
  """Whether the process a lock file names still runs (this host and boot, same start time).

  False whenever that cannot be shown (another host, no /proc): `flock` decides then."""
  if info.get("host") != socket.gethostname() or info.get("boot_id") != _boot_id():
    return False
  if info.get("boot_id") is None or info.get("process_start") is None:
    return False
  try:
    pid = int(info["pid"])
  except (TypeError, ValueError):
    return False
  return pid != os.getpid() and _process_start(pid) == info["process_start"]


def describe(info: dict | None) -> str:
  if not info:
    return "another process (its lock file names no holder)"
  return (f"PID {info.get('pid')} on host {info.get('host')} since {info.get('since')}"
          + (f" ({info['command']})" if info.get("command") else ""))


def _busy(workdir: str, info: dict | None) -> WorkdirBusyError:
  pid = info.get("pid") if info else None
  stop = f"stop it (kill {pid})" if pid else "stop it"
  return WorkdirBusyError(
      f"workdir {workdir} is in use by another trainer: {describe(info)}; wait for it to "
      f"finish, {stop}, or choose another --workdir")


@contextlib.contextmanager
def hold(workdir: str, enabled: bool = True,
         log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> Iterator[None]:
  """Hold the workdir's lock for the body (creating the workdir); WorkdirBusyError if taken.

  In a multi-process run, process 0 holds it and every process learns the outcome: when the
  workdir is busy, each raises the same one-line error. `enabled=False` does nothing."""
  if not enabled:
    yield
    return
  if distributed.is_multi_process():
    with _hold_for_all(workdir, log):
      yield
    return
  with _hold(workdir, log):
    yield


@contextlib.contextmanager
def _hold_for_all(workdir: str, log) -> Iterator[None]:
  """Process 0 takes the lock; its outcome ("" or the error line) is every process's."""
  with contextlib.ExitStack() as stack:
    def take() -> str:
      try:
        stack.enter_context(_hold(workdir, log))
      except WorkdirLockError as e:
        return f"{type(e).__name__}:{e}"
      return ""

    outcome = distributed.agree("workdir_lock", take)
    if outcome:
      kind, _, message = outcome.partition(":")
      kind = WorkdirBusyError if kind == WorkdirBusyError.__name__ else WorkdirLockError
      raise errors.on_every_process(kind(message))
    yield


@contextlib.contextmanager
def _hold(workdir: str, log) -> Iterator[None]:
  path = lock_path(workdir)
  try:
    os.makedirs(workdir, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  except OSError as e:
    raise WorkdirLockError(f"cannot use {workdir} as a workdir: {e.strerror or e} "
                           f"({e.filename or path})") from None
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      raise _busy(workdir, read_holder(path)) from None
    previous = read_holder(path)
    if previous is not None and holder_alive(previous):
      fcntl.flock(fd, fcntl.LOCK_UN)
      raise _busy(workdir, previous)
    if previous is not None:
      log(f"note: taking over the lock of {workdir} left by {describe(previous)}, which is no "
          "longer running")
    try:
      _write(fd, json.dumps(holder_info()) + "\n")
    except OSError as e:
      raise WorkdirLockError(f"cannot write {path}: {e.strerror or e}") from None
    try:
      yield
    finally:
      with contextlib.suppress(OSError):  # never hide the body's own error
        _write(fd, "")
      fcntl.flock(fd, fcntl.LOCK_UN)
  finally:
    os.close(fd)


def _write(fd: int, text: str) -> None:
  os.ftruncate(fd, 0)
  os.pwrite(fd, text.encode(), 0)
  os.fsync(fd)
