"""Multi-process failures end in one line, within a bound, and the rerun resumes bitwise.

Two processes (one simulated CPU device each, gloo) train the tests' tiny Sudoku model, one
checkpoint per step. Each case plants its fault at a known point through tests/host_faults.py
(a wrapper that patches the step function or orbax's save, then runs train.py; each process is
a supervisor and its child, diffgemma/runs/supervisor.py, and the signals go to the process the
test started, the supervisor), then checks, on every process that survives: its exit status,
its one line (naming the lost process and the last complete checkpoint, or the stop's
checkpoint), and the time from the fault to the last exit against the case's bound. The
processes learn who is who from scripts/launch_local.py's environment, or (one case) from
SLURM's, with --distributed.

The cases share one workdir, in the order below: each run resumes from the checkpoint the
previous case's line named (asserted: "resumed from step N"), and the last test runs the same
command to the end and compares the state bitwise with an uninterrupted run. Run alone (-k),
a case starts from the reference's step 2.

Bounds (measured from the fault to the last survivor's exit): the watchdog names a silent
process HEARTBEAT_S after its last beat, and a stopped coordinator HEARTBEAT_S after the round
trip it never answered began; a process that failed on its own (its beat says so) or a killed
coordinator (JAX's client aborts on it, the supervisor says so) is seen at once; MARGIN_S
covers a beat interval and the exit. A stop signal costs the step in flight, a checkpoint and the close
(STOP_BOUND_S). Both hold with the processes on one core shared with other work.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from diffgemma.runs import checkpointing, distributed
from tests.helpers import ROOT
from tests.test_many_hosts import (PROGRESS, RUN_TIMEOUT_S, assert_same_state, env, launcher,
                                   one_process_env, without_steps_after)

# The slow tier (`pytest -m slow`, run by CI after the suite): several processes or
# optimised compiles per test.
pytestmark = pytest.mark.slow

STEPS = 16  # enough for the eight cases, each up to three steps on from the last
HEARTBEAT_S = 5  # the watchdog's timeout in these runs (--heartbeat_timeout_s)
MARGIN_S = 8
# A stop signal's end: the step in flight, its checkpoint, the close (the saves' barriers) and
# JAX's shutdown barrier.
STOP_BOUND_S = 20
# The notice of a run started after the previous case's killed process (its lock is taken over).
TAKEOVER = "note: taking over the lock of"
FLAGS = ("--config=tests/tiny_sudoku_config.py", f"--config.num_train_steps={STEPS}",
         "--config.checkpoint_every=1", f"--config.keep_checkpoints={STEPS}",
         "--config.sharding.fsdp=-1", "--config.model.num_layers=1")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One process, 2 simulated devices, STEPS uninterrupted steps."""
  path = str(tmp_path_factory.mktemp("reference") / "run")
  out = subprocess.run([sys.executable, "train.py", *FLAGS, f"--workdir={path}"], cwd=ROOT,
                       env=one_process_env(2), capture_output=True, text=True,
                       timeout=RUN_TIMEOUT_S)
  assert out.returncode == 0, out.stderr[-3000:]
  return path


@pytest.fixture(scope="module")
def workdir(reference, tmp_path_factory):
  """The run every case continues: the reference's checkpoints up to step 2 at first."""
  return without_steps_after(reference, 2, tmp_path_factory.mktemp("chain") / "run")


class Run:
  """Two processes of train.py on `workdir`, each with its faults (tests/host_faults.py)."""

  def __init__(self, workdir, marks, faults=None, slurm=False):
    self.workdir, self.marks = workdir, str(marks)
    os.makedirs(self.marks, exist_ok=True)
    self.start = checkpointing.latest_step(workdir)
    port = launcher.free_port()
    self.procs = []
    for index in range(2):
      command = ["train.py", *FLAGS, f"--workdir={workdir}",
                 f"--heartbeat_timeout_s={HEARTBEAT_S}", *(["--distributed"] if slurm else [])]
      command = ["-m", "tests.host_faults", f"--marks={self.marks}",
                 *(faults or {}).get(index, ()), "--", *command]
      self.procs.append(subprocess.Popen(
          [sys.executable, *command], cwd=ROOT,
          env=slurm_env(index, port) if slurm else launcher.process_env(
              index, 2, 1, "cpu", f"localhost:{port}"),
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))

  def wait_for(self, *names):
    """Until the marks `names` (e.g. "paused-0") and checkpoint directories exist."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not all(os.path.exists(os.path.join(self.marks, n)) or os.path.isdir(
        os.path.join(checkpointing.checkpoint_dir(self.workdir), n)) for n in names):
      for p in self.procs:
        assert p.poll() is None, p.communicate()[1][-3000:]
      assert time.monotonic() < deadline, names
      time.sleep(0.005)
    return time.monotonic()

  def resume(self):
    open(os.path.join(self.marks, "resume"), "w").close()

  def signal(self, sig, *indices):
    for index in indices:
      os.kill(self.procs[index].pid, sig)

  def end(self, survivors, since, bound_s):
    """Wait for the `survivors` to exit; assert that the last did within `bound_s` of `since`.
    Returns [(status, stdout, error lines)] per survivor: stderr without the progress bar."""
    deadline = since + bound_s + 60  # past the bound it fails anyway; 60 s say how late
    ended = {}
    while len(ended) < len(survivors) and time.monotonic() < deadline:
      for index in survivors:
        if index not in ended and self.procs[index].poll() is not None:
          ended[index] = time.monotonic()
      time.sleep(0.005)
    took = max(ended.values(), default=float("inf")) - since
    outs = []
    for index in survivors:
      if self.procs[index].poll() is None:  # hung: its stacks, then the end
        self.procs[index].send_signal(signal.SIGUSR1)
        time.sleep(1)
        self.procs[index].kill()
      stdout, stderr = self.procs[index].communicate()
      lines = [l for l in stderr.splitlines()
               if l.strip() and not PROGRESS.match(l) and not l.startswith(TAKEOVER)]
      outs.append((self.procs[index].returncode, stdout, lines))
    print(f"time to stop: {took:.1f} s (bound {bound_s} s)")
    assert took < bound_s, f"{took:.1f} s, bound {bound_s} s:\n" + "\n\n".join(
        f"process {i}: exit status {status}\n" + "\n".join(lines)
        for i, (status, _, lines) in zip(survivors, outs))
    return outs

  def kill_rest(self):
    for p in self.procs:
      if p.poll() is None:
        p.kill()
        p.communicate()


def slurm_env(index, port):
  """Process `index`'s environment as SLURM sets it for a job of 2 nodes, one task each (JAX's
  cluster detection reads it; the coordinator's port is fixed, as a job may set it)."""
  env = launcher.process_env(index, 2, 1, "cpu", "")
  for name in ("DIFFGEMMA_COORDINATOR", "DIFFGEMMA_NUM_PROCESSES", "DIFFGEMMA_PROCESS_ID"):
    del env[name]
  return dict(env, SLURM_JOB_ID="1", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
              SLURM_PROCID=str(index), SLURM_LOCALID="0", JAX_COORDINATOR_PORT=str(port))


@pytest.fixture
def run_with(workdir, tmp_path):
  runs = []

  def start(faults=None, slurm=False):
    runs.append(Run(workdir, tmp_path / "marks", faults, slurm))
    return runs[-1]

  yield start
  for run in runs:
    run.kill_rest()


def resumed_from(run, stdout):
  assert f"resumed from step {run.start} in" in stdout, stdout[-2000:]


def lost_line(workdir, lost, survivor, why, step):
  return (f"error: process {lost} of 2{' (the coordinator)' if lost == 0 else ''} {why}; "
          f"stopping process {survivor}; the last complete checkpoint is step {step} in "
          f"{checkpointing.checkpoint_dir(workdir)}; rerun the same command to resume from it")


def stop_line(workdir, step):
  return (f"stopped at step {step} on SIGTERM: checkpoint saved in "
          f"{checkpointing.checkpoint_dir(workdir)}; rerun the same command to resume")


def test_a_full_disk_during_a_save_on_one_process_stops_both(workdir, run_with):
  """Process 1's save of a checkpoint fails with ENOSPC as it starts (its disk is full), while
  process 0 waits for it in the save: process 1 ends with the checkpoint's line (exit 2),
  process 0 names it (exit 4); the failed step is not complete."""
  start = checkpointing.latest_step(workdir)
  run = run_with({1: [f"--full_disk_save={start + 1}"]})
  since = run.wait_for("failed-1")
  (status0, stdout0, lines0), (status1, _, lines1) = run.end([0, 1], since, MARGIN_S)
  resumed_from(run, stdout0)
  assert (status1, lines1) == (2, [
      f"error: could not write checkpoint step {start + 1} in "
      f"{checkpointing.checkpoint_dir(workdir)}: {checkpointing.DISK_FULL}; the last complete "
      f"checkpoint is step {start}; fix the cause and rerun the same command to resume"])
  assert (status0, lines0) == (distributed.LOST_EXIT_CODE, [lost_line(
      workdir, 1, 0, "stopped with an error (its own line says which)", start)])
  assert checkpointing.latest_step(workdir) == start


def coordinator_lost(run, sig, bound_s, since_mark=None):
  """`sig` to process 0 (the coordinator, whose key-value store every process uses) while it
  waits in a step, once the step before is checkpointed: process 1 ends with the one line
  naming process 0 and that checkpoint, exit 4, within `bound_s`."""
  start = run.start
  run.wait_for("paused-0", str(start + 1))
  run.signal(sig, 0)
  since = time.monotonic()
  ((status, _, lines),) = run.end([1], since, bound_s)
  assert (status, lines) == (distributed.LOST_EXIT_CODE, [lost_line(
      run.workdir, 0, 1, distributed.COORDINATOR_GONE, start + 1)])
  assert checkpointing.latest_step(run.workdir) == start + 1
  return start


def test_the_coordinator_killed_ends_the_other_at_once(workdir, run_with):
  """kill -9 to process 0: JAX's client in process 1 sees its coordination service gone and
  aborts the child (a multi-line C++ fatal log); its supervisor prints the one line instead."""
  run = run_with({0: ["--pause_step=2"]})
  coordinator_lost(run, signal.SIGKILL, MARGIN_S)
  resumed_from(run, run.procs[0].communicate()[0])


def test_the_coordinator_stopped_ends_the_other_after_the_heartbeat(workdir, run_with):
  """SIGSTOP to process 0 (it never resumes; its child stops with it): its service answers
  nothing, and process 1's watchdog names it HEARTBEAT_S after the round trip began."""
  run = run_with({0: ["--pause_step=2"]})
  coordinator_lost(run, signal.SIGSTOP, HEARTBEAT_S + MARGIN_S)
  assert run.procs[0].poll() is None  # still stopped
  run.procs[0].kill()  # its child ends with it
  resumed_from(run, run.procs[0].communicate()[0])


def test_the_coordinator_killed_in_a_slurm_launch_ends_the_other_at_once(workdir, run_with):
  """The same kill in a run that learns who is who from SLURM's environment (--distributed):
  the supervisor learns the index and process count from its child."""
  run = run_with({0: ["--pause_step=2"]}, slurm=True)
  coordinator_lost(run, signal.SIGKILL, MARGIN_S)
  resumed_from(run, run.procs[0].communicate()[0])


def test_a_stopped_peer_stops_the_other_in_one_line(workdir, run_with):
  """SIGSTOP to process 1 while it waits in a step (it never resumes): process 0 names it
  HEARTBEAT_S after its last beat (exit 4); the stopped process is left as it is."""
  start = checkpointing.latest_step(workdir)
  run = run_with({1: ["--pause_step=2"]})
  run.wait_for("paused-1", str(start + 1))
  run.signal(signal.SIGSTOP, 1)
  since = time.monotonic()
  ((status, stdout, lines),) = run.end([0], since, HEARTBEAT_S + MARGIN_S)
  resumed_from(run, stdout)
  assert (status, lines) == (distributed.LOST_EXIT_CODE, [lost_line(
      workdir, 1, 0, f"is gone: not heard from for {HEARTBEAT_S} s (killed, stopped, crashed, "
      "or its host is down)", start + 1)])
  assert run.procs[1].poll() is None  # still stopped
  assert checkpointing.latest_step(workdir) == start + 1


def assert_stopped_on_sigterm(run, workdir, outs, steps):
  """Every process exited 0, silent but for process 0's one line naming the step (one of
  `steps`) whose checkpoint is now the newest."""
  (status0, stdout0, lines0), (status1, stdout1, lines1) = outs
  resumed_from(run, stdout0)
  step = checkpointing.latest_step(workdir)
  assert step in steps, (step, steps)
  silent = [l for l in stdout1.splitlines() if not l.startswith("[Gloo]")]  # gloo's own print
  assert (status0, status1, lines0, lines1, silent) == (0, 0, [], [], [])
  assert [l for l in stdout0.splitlines() if "stopped at" in l] == [stop_line(workdir, step)]


def test_sigterm_to_every_process_mid_step_stops_both_at_that_step(workdir, run_with):
  """SIGTERM to both processes while each is inside the same step: they finish it, save it,
  and exit 0."""
  start = checkpointing.latest_step(workdir)
  run = run_with({0: ["--pause_step=2"], 1: ["--pause_step=2"]})
  run.wait_for("paused-0", "paused-1")
  run.signal(signal.SIGTERM, 0, 1)
  since = time.monotonic()
  run.resume()
  assert_stopped_on_sigterm(run, workdir, run.end([0, 1], since, STOP_BOUND_S), [start + 2])


def test_sigterm_while_a_checkpoint_is_written_completes_it_and_stops(workdir, run_with):
  """SIGTERM to both processes while both write checkpoint step start+1 (orbax's background
  write): that checkpoint completes, and they stop at the next boundary that agrees on the
  signal (start+2, or start+3 when the signal came after that boundary's agreement)."""
  start = checkpointing.latest_step(workdir)
  run = run_with({0: [f"--pause_save={start + 1}"], 1: [f"--pause_save={start + 1}"]})
  run.wait_for("paused-0", "paused-1")
  run.signal(signal.SIGTERM, 0, 1)
  since = time.monotonic()
  run.resume()
  assert_stopped_on_sigterm(run, workdir, run.end([0, 1], since, STOP_BOUND_S),
                            [start + 2, start + 3])
  assert start + 1 in checkpointing.steps_on_disk(workdir)


def test_sigterm_to_one_process_stops_both_at_one_step(workdir, run_with):
  """SIGTERM to process 1 alone, inside a step: it posts the signal, process 0 decides, both
  stop at the same boundary (start+2, or start+3 when process 0 decided that boundary before
  the post) with one checkpoint, exit 0."""
  start = checkpointing.latest_step(workdir)
  run = run_with({1: ["--pause_step=2"]})
  run.wait_for("paused-1")
  run.signal(signal.SIGTERM, 1)
  since = time.monotonic()
  run.resume()
  assert_stopped_on_sigterm(run, workdir, run.end([0, 1], since, STOP_BOUND_S),
                            [start + 2, start + 3])


def test_after_every_failure_the_rerun_ends_bitwise_like_the_uninterrupted_run(
    workdir, reference):
  start = checkpointing.latest_step(workdir)
  out = subprocess.run([sys.executable, "scripts/launch_local.py", "--num_processes=2", "--",
                        "train.py", *FLAGS, f"--workdir={workdir}",
                        f"--heartbeat_timeout_s={HEARTBEAT_S}"],
                       cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=RUN_TIMEOUT_S)
  assert out.returncode == 0, out.stderr[-3000:]
  assert f"[0] resumed from step {start} in" in out.stdout
  assert_same_state(workdir, reference, steps=STEPS)
