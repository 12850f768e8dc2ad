"""A process of a multi-process run as two: a supervisor and the child that runs JAX.

When process 0's coordination service goes away (the process killed, stopped, crashed, its host
down), JAX's client in every other process polls the error and aborts the process itself, with
a multi-line C++ fatal log; no Python code runs (JAX 0.10 cannot hand the event to Python). So
the entry scripts of a multi-process run re-execute themselves (`run_supervised`, from
diffgemma/runs/distributed.py before JAX starts): the supervisor, which never starts JAX,
streams the child's stdout and stderr through as they come (progress bars, gloo's prints) and
recognises JAX's fatal abort (`FatalAbortFilter`): that block is dropped and the supervisor
prints one `error:` line instead (naming the last complete checkpoint) and exits with the lost
exit status. Anything else is the child's, unchanged: a traceback, an error line, its exit
status (a child killed by signal S ends the supervisor by S).

  signals    SIGINT, SIGTERM, SIGHUP, SIGUSR1/2 and SIGCONT to the supervisor are passed on to the
             child, once: the child runs in its own process group, so a Ctrl-C in the terminal
             reaches it through the supervisor only;
  follows    the child ends when its supervisor is killed (Linux: the parent-death signal;
             elsewhere a poll of its parent) and stops when it is stopped (Linux: its state in
             /proc), so `kill -9 PID` or `kill -STOP PID` of the process a user started does to
             the run what it did before there were two.
  report     the child tells the supervisor its process index and the run's process count
             (`report`) through a pipe, for the line.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

# In the child: "FD:PID", the pipe's end to report through and the supervisor's process id.
ENV_SUPERVISOR = "DIFFGEMMA_SUPERVISOR"
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)
# A C++ log line (absl's format, e.g. "E1207 11:55:20.657813    5631 file.cc:289] ...") waits
# this long on its way through: JAX's client logs the error it polled just before its fatal line.
HOLD_S = 1.0
FOLLOW_S = 0.1  # the child's look at its supervisor
# After the child's end, how long its output may still take (a process it started may hold the
# pipes open).
DRAIN_S = 2.0

_CPP_LOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]\s]+:\d+\] ")
# The start of a line that may still become one (a line can come in two reads).
_CPP_LOG_START = re.compile(rb"^[IWEF](\d{1,4}( [\d:.]*( +\d*( [^\]\s]*\]?)?)?)?)?$")
# JAX's client ends the process on an error of the coordination service with this (client.h).
_FATAL = re.compile(rb"^F\d{4} [^\]]*\] Terminating process because the JAX distributed service "
                    rb"detected fatal errors")
_LINE = re.compile(rb"[^\r\n]*(\r\n|\n|\r)")


class FatalAbortFilter:
  """The child's stderr on its way to `write` (bytes), less JAX's fatal abort.

  A line in absl's C++ log format waits up to `hold_s` (and what comes after it waits behind
  it, so the order stays): when the fatal line follows, the lines held are part of its block
  and are dropped with it, and so is everything after it (the rest of its message, the stack
  trace, Python's own report of the abort). Anything else passes at once, a progress bar's
  carriage-return updates included."""

  def __init__(self, write: Callable[[bytes], None], hold_s: float = HOLD_S,
               clock: Callable[[], float] = time.monotonic):
    self.write, self.hold_s, self.clock = write, hold_s, clock
    self.fatal: bytes | None = None  # the fatal line, once seen
    self.held: list[tuple[float, bytes, bool]] = []  # (since, text, a C++ log line), in order
    self.partial = b""  # the current line's start, while it may be a C++ log line
    self.partial_since = 0.0
    self.passing = False  # the current line's start has been passed on: its rest goes too
    self.at_line_start = True  # the last byte written was a newline (or none was written)
    self.after_return = False  # the last byte written was a carriage return (a progress bar)
    self.errors_written = False  # a line that began with "error: " was written

  def feed(self, data: bytes) -> None:
    if self.fatal is not None:
      return
    if not self.partial:
      self.partial_since = self.clock()
    data, self.partial = self.partial + data, b""
    end = 0
    for match in _LINE.finditer(data):
      self._line(match.group(0))
      end = match.end()
      if self.fatal is not None:
        return
    rest = data[end:]
    if self.passing or not (_CPP_LOG_START.match(rest) or _CPP_LOG.match(rest)):
      self._pass(rest)
      self.passing = bool(rest) or self.passing
    else:
      self.partial = rest
    self.tick()

  def _line(self, line: bytes) -> None:
    if self.passing:  # the end of a line begun earlier
      self.passing = False
      self._pass(line)
    elif _FATAL.match(line):
      self.fatal, self.held = line.rstrip(), []
    elif _CPP_LOG.match(line):
      self.held.append((self.clock(), line, True))
    else:
      self._pass(line)

  def _pass(self, text: bytes) -> None:
    if not text:
      return
    if self.held:
      self.held.append((self.clock(), text, False))
    else:
      self._write(text)

  def _write(self, text: bytes) -> None:
    if (self.at_line_start or self.after_return) and text.startswith(b"error: "):
      self.errors_written = True
    self.write(text)
    self.at_line_start, self.after_return = text.endswith(b"\n"), text.endswith(b"\r")

  def tick(self, force: bool = False) -> None:
    """Write what is held: the C++ log lines held for `hold_s`, what waits behind them
    (everything when `force`)."""
    now = self.clock()
    if self.partial and (force or now - self.partial_since >= self.hold_s):
      self.held.append((now, self.partial, False))  # no line's end came: not a log line
      self.partial, self.passing = b"", True
    while self.held and (force or not self.held[0][2] or now - self.held[0][0] >= self.hold_s):
      self._write(self.held.pop(0)[1])

  def close(self) -> None:
    """The end of the stream: whatever is held goes out, unless the fatal line came."""
    if self.fatal is None:
      self.tick(force=True)


_child: dict = {}  # in a supervisor's child: {"report_fd": FD, "supervisor": PID}


def follow_supervisor() -> bool:
  """In a supervisor's child (its environment says so): from now on end when the supervisor
  ends and stop while it is stopped (module docstring), and return True; elsewhere False."""
  given = os.environ.pop(ENV_SUPERVISOR, "")  # not for the processes this one starts
  if not given:
    return bool(_child)
  fd, _, parent = given.partition(":")
  _child.update(report_fd=int(fd), supervisor=int(parent))
  if sys.platform.startswith("linux"):
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
  if os.getppid() != _child["supervisor"]:  # it ended before the line above
    os.kill(os.getpid(), signal.SIGKILL)
  threading.Thread(target=_follow, args=(_child["supervisor"],), daemon=True,
                   name="diffgemma-follow-supervisor").start()
  return True


def _follow(parent: int) -> None:
  stat = f"/proc/{parent}/stat"
  while True:
    if os.getppid() != parent:  # without a parent-death signal (not Linux)
      os.kill(os.getpid(), signal.SIGKILL)
    try:
      with open(stat, "rb") as f:
        state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
      state = b""
    if state == b"T":  # stopped: this process stops too, until the supervisor's SIGCONT
      os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(FOLLOW_S)


def report(**values) -> None:
  """In a supervisor's child: tell the supervisor `values` (JSON), e.g. this process's index;
  the first call only. Elsewhere nothing."""
  fd = _child.pop("report_fd", None)
  if fd is None:
    return
  try:
    with os.fdopen(fd, "w") as pipe:
      pipe.write(json.dumps(values))
  except OSError:  # the supervisor is gone: its end ends this process
    pass


def supervise(command: list[str], fatal_line: Callable[[dict, bytes], str], fatal_status: int,
              env: dict | None = None, stdout=None, stderr=None) -> int:
  """Run `command` as the child (its own process group; `env` plus ENV_SUPERVISOR), pass its
  output on to `stdout` and `stderr` (binary streams; default this process's) and the
  signals this process receives on to it, and wait for it. Returns the exit status: the
  child's (-S: killed by signal S), or, when JAX's fatal abort ended it, `fatal_status` after
  `fatal_line(what the child reported, the fatal line)` (a message) is printed as one
  `error:` line (unless the child printed an `error:` line of its own before)."""
  stdout = sys.stdout.buffer if stdout is None else stdout
  stderr = sys.stderr.buffer if stderr is None else stderr
  sys.stdout.flush()
  sys.stderr.flush()
  report_read, report_write = os.pipe()
  child_env = dict(os.environ if env is None else env)
  child_env[ENV_SUPERVISOR] = f"{report_write}:{os.getpid()}"
  interactive = os.isatty(0)  # the child, in its own group, must not read the terminal
  started, pending = [], []  # the child once started; the signals that came before

  def forward(signum, frame):
    del frame
    if not started:
      pending.append(signum)
      return
    child = started[0]
    if child.poll() is None:
      child.send_signal(signum)
    if signum == signal.SIGCONT:  # again, once the child has surely seen this process stopped
      threading.Timer(2 * FOLLOW_S, lambda: child.poll() is None and child.send_signal(
          signal.SIGCONT)).start()

  in_main_thread = threading.current_thread() is threading.main_thread()  # handlers go there
  previous = {s: signal.signal(s, forward) for s in FORWARDED} if in_main_thread else {}
  try:
    child = subprocess.Popen(command, env=child_env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, pass_fds=(report_write,),
                             stdin=subprocess.DEVNULL if interactive else None,
                             process_group=0)
    os.close(report_write)
    started.append(child)
    for signum in pending:
      forward(signum, None)
    told, filtered = _pump(child, report_read, stdout, stderr)
    status = child.wait()
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler if handler is not None else signal.SIG_DFL)
  if filtered.fatal is None:
    return status
  if not filtered.errors_written:
    message = f"error: {fatal_line(told, filtered.fatal)}\n"
    stderr.write(("" if filtered.at_line_start else "\n").encode() + message.encode())
    stderr.flush()
  return fatal_status


def _pump(child, report_read: int, stdout, stderr) -> tuple[dict, FatalAbortFilter]:
  """Pass the child's output on until its end (and its pipes' end, or DRAIN_S after it):
  (the child's report, the filter its stderr went through)."""

  def write_err(data):
    stderr.write(data)
    stderr.flush()

  def write_out(data):
    stdout.write(data)
    stdout.flush()

  filtered = FatalAbortFilter(write_err)
  sinks = {child.stdout.fileno(): write_out, child.stderr.fileno(): filtered.feed}
  told = b""
  open_fds = set(sinks) | {report_read}
  ended_at = None
  while open_fds:
    if ended_at is None and child.poll() is not None:
      ended_at = time.monotonic()
    if ended_at is not None and time.monotonic() - ended_at > DRAIN_S:
      break
    ready, _, _ = select.select(list(open_fds), [], [], HOLD_S / 4)
    for fd in ready:
      data = os.read(fd, 65536)
      if not data:
        open_fds.discard(fd)
      elif fd == report_read:
        told += data
      else:
        sinks[fd](data)
    filtered.tick()
  filtered.close()
  os.close(report_read)
  try:
    values = json.loads(told) if told else {}
  except ValueError:  # cut short by the child's end
    values = {}
  return values, filtered


def run_supervised(fatal_line: Callable[[dict, bytes], str], fatal_status: int) -> None:
  """Re-execute this process's command line (`sys.orig_argv`, so a wrapper such as
  `python -m tests.host_faults ... -- train.py ...` runs again too) as the supervised child and
  end this process as `supervise` says: its exit status, or the child's signal. Never
  returns."""
  status = supervise([sys.executable, *sys.orig_argv[1:]], fatal_line, fatal_status)
  sys.stdout.flush()
  sys.stderr.flush()
  if status < 0:  # killed by a signal: end the same way, without a core file of this process
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
    time.sleep(1)
    status = 128 - status
  os._exit(status)
