"""The supervisor of a multi-process run's process (diffgemma/runs/supervisor.py): its filter
of the child's stderr, and its end, on children that print what a real one would (no JAX
started; tests/test_host_failures.py runs the real runs)."""

import io
import signal
import subprocess
import sys
import textwrap
import time

from diffgemma.runs import distributed, supervisor

# What JAX 0.10's client writes when its poll of the lost coordination service fails (measured:
# process 0 killed), before it aborts the process.
JAX_FATAL = (
    b"E1207 11:55:20.657813    5631 coordination_service_agent.cc:289] Polled an error from "
    b"coordination service (this can be an error from this or another task).\n"
    b"F1207 11:55:20.657917    5631 client.h:80] Terminating process because the JAX "
    b"distributed service detected fatal errors. This most likely indicates that another task "
    b"died; see the other task logs for more details. Disable Python buffering, i.e. `python "
    b"-u`, to be sure to see all the previous output. absl::Status: UNAVAILABLE: Failed to send "
    b"RPC to coordination service. Either the leader task was preempted/died/restarted "
    b"unexpectedly or this task is experiencing network issues.\n"
    b"Additional GRPC error information from remote target coordination_service while calling "
    b"/xla.coordination.CoordinationService/PollForError:\n"
    b":UNKNOWN:Error received from peer  {grpc_message:\"Socket closed\", grpc_status:14}\n"
    b"*** Check failure stack trace: ***\n"
    b"    @     0x7fd6da640634  absl::lts_20260107::log_internal::LogMessage::SendToLog()\n"
    b"    @     0x7fd6d67040ee  xla::CoordinationServiceAgent::SetError()\n"
    b"    @     0x7fd6e1aa71f5  (unknown)\n")
WARNING = (b"W1207 11:55:19.000001    5600 cpu_client.cc:12] a C++ warning that no fatal "
           b"follows\n")
TRACEBACK = (b"Traceback (most recent call last):\n"
             b"  File \"train.py\", line 3, in <module>\n"
             b"    raise ValueError(\"a bug of ours\")\n"
             b"ValueError: a bug of ours\n")
PROGRESS = b"sft:  50%|#####     | 1/2\r"
COORDINATOR_LINE = (
    b"error: process 0 of 2 (the coordinator) is gone: its coordination service is unreachable "
    b"(killed, stopped, crashed, or its host is down); stopping process 1; rerun the same "
    b"command\n")


class Clock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def filtered(chunks, step_s=0.0):
  """(what passed, the filter) after `chunks` (bytes), the clock `step_s` on after each."""
  out, clock = [], Clock()
  fatal_filter = supervisor.FatalAbortFilter(out.append, hold_s=1.0, clock=clock)
  for chunk in chunks:
    fatal_filter.feed(chunk)
    clock.now += step_s
    fatal_filter.tick()
  fatal_filter.close()
  return b"".join(out), fatal_filter


def test_a_genuine_traceback_passes_untouched_and_in_order():
  text = PROGRESS + b"\n" + WARNING + TRACEBACK
  for size in (1, 7, len(text)):  # as it comes: a byte, a few, all at once
    chunks = [text[i:i + size] for i in range(0, len(text), size)]
    out, fatal_filter = filtered(chunks)
    assert (out, fatal_filter.fatal) == (text, None)


def test_a_cpp_log_line_is_held_then_passed_and_a_progress_bar_is_not_held():
  out, clock = [], Clock()
  fatal_filter = supervisor.FatalAbortFilter(out.append, hold_s=1.0, clock=clock)
  fatal_filter.feed(PROGRESS)
  assert out == [PROGRESS]  # at once, without its line's end
  fatal_filter.feed(b"\n" + WARNING + b"after\n")
  assert b"".join(out) == PROGRESS + b"\n"  # the warning waits, and the line behind it
  clock.now = 1.0
  fatal_filter.tick()
  assert b"".join(out) == PROGRESS + b"\n" + WARNING + b"after\n"


def test_jax_fatal_block_is_dropped_whole():
  for size in (3, 50, len(JAX_FATAL)):
    chunks = [PROGRESS] + [JAX_FATAL[i:i + size] for i in range(0, len(JAX_FATAL), size)]
    out, fatal_filter = filtered(chunks + [b"Fatal Python error: Aborted\n"])
    assert out == PROGRESS
    assert fatal_filter.fatal.startswith(b"F1207 11:55:20.657917")
    assert not fatal_filter.at_line_start  # the one line starts on a line of its own


def run_child(code):
  """supervisor.supervise on `python -c code` (the child reports process 1 of 2): (status,
  stdout, stderr)."""
  stdout, stderr = io.BytesIO(), io.BytesIO()
  child = textwrap.dedent("""
      import os, sys
      from diffgemma.runs import supervisor
      assert supervisor.follow_supervisor()
      supervisor.report(process=1, count=2)
      print("model: tiny", flush=True)
      sys.stderr.buffer.write(PROGRESS); sys.stderr.flush()
  """) + textwrap.dedent(code)
  status = supervisor.supervise(
      [sys.executable, "-c", child.replace("PROGRESS", repr(PROGRESS))],
      lambda told, fatal: distributed._fatal_line(told, fatal, {}), distributed.LOST_EXIT_CODE,
      stdout=stdout, stderr=stderr)
  return status, stdout.getvalue(), stderr.getvalue()


def test_supervised_jax_fatal_abort_becomes_the_one_line():
  status, stdout, stderr = run_child(f"""
      sys.stderr.buffer.write({JAX_FATAL!r}); sys.stderr.flush()
      os.abort()
  """)
  assert (status, stdout, stderr) == (distributed.LOST_EXIT_CODE, b"model: tiny\n",
                                      PROGRESS + b"\n" + COORDINATOR_LINE)


def test_supervised_crash_keeps_its_traceback_and_status():
  status, stdout, stderr = run_child("""
      raise ValueError("a bug of ours")
  """)
  assert status == 1 and stdout == b"model: tiny\n"
  assert stderr.startswith(PROGRESS + b"Traceback (most recent call last):\n")
  assert stderr.endswith(b"ValueError: a bug of ours\n")


def test_supervised_child_killed_by_a_signal_is_reported_as_such():
  status, _, stderr = run_child("""
      import signal
      os.kill(os.getpid(), signal.SIGKILL)
  """)
  assert (status, stderr) == (-9, PROGRESS)


def test_supervisor_passes_a_signal_on_to_the_child():
  """SIGTERM to the supervisor reaches the child once (its handler prints and exits 0)."""
  script = textwrap.dedent("""
      import os, signal, sys, time
      from diffgemma.runs import supervisor
      if not supervisor.follow_supervisor():
        sys.exit(supervisor.supervise([sys.executable, *sys.orig_argv[1:]], None, 4))
      got = []
      signal.signal(signal.SIGTERM, lambda *_: got.append(1))
      print("ready", flush=True)
      while not got:
        time.sleep(0.01)
      time.sleep(0.2)
      print("SIGTERM", len(got), flush=True)
  """)
  proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
  assert proc.stdout.readline() == "ready\n"
  proc.send_signal(signal.SIGTERM)
  assert (proc.communicate(timeout=30)[0], proc.returncode) == ("SIGTERM 1\n", 0)


def state(pid):
  """A process's state letter from /proc ("T": stopped), or None once it is gone."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return f.read().rpartition(b")")[2].split()[0].decode()
  except (OSError, IndexError):
    return None


def wait_until(predicate, timeout_s=10):
  deadline = time.monotonic() + timeout_s
  while not predicate():
    assert time.monotonic() < deadline
    time.sleep(0.01)


def test_the_child_stops_continues_and_ends_with_its_supervisor():
  """(Linux: /proc and the parent-death signal, as on CI.)"""
  script = textwrap.dedent("""
      import os, sys, time
      from diffgemma.runs import supervisor
      if not supervisor.follow_supervisor():
        sys.exit(supervisor.supervise([sys.executable, *sys.orig_argv[1:]], None, 4))
      print(os.getpid(), flush=True)
      time.sleep(60)
  """)
  proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
  try:
    child = int(proc.stdout.readline())
    proc.send_signal(signal.SIGSTOP)
    wait_until(lambda: state(child) == "T")
    proc.send_signal(signal.SIGCONT)
    wait_until(lambda: state(child) not in ("T", None))
    proc.kill()
    wait_until(lambda: state(child) in ("Z", None))
  finally:
    proc.kill()
    proc.communicate()
