"""Many hosts on one machine: 2-4 processes on JAX's multi-controller runtime (gloo collectives,
one simulated CPU device each) train the tests' tiny Sudoku model like one process with as many
simulated devices, share checkpoints with runs of another process count, refuse a config that
differs between processes, and stop (with one line naming it) when one process is killed.

Every multi-process run goes through scripts/launch_local.py or the same environment it sets,
with a timeout on every subprocess. The uninterrupted single-process reference (2 simulated
devices) is trained once per module; the runs share the suite's XLA compilation cache.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from diffgemma.runs import checkpointing, training_state
from tests.helpers import ROOT, load_script

STEPS, EVERY = 8, 2
HEARTBEAT_S = 10  # the watchdog's timeout in these runs (the default is 30 s)
RUN_TIMEOUT_S = 400
FLAGS = ("--config=tests/tiny_sudoku_config.py", f"--config.num_train_steps={STEPS}",
         f"--config.checkpoint_every={EVERY}", f"--config.keep_checkpoints={STEPS}",
         "--config.sharding.fsdp=-1")  # fsdp over every device of the run, however many
launcher = load_script("launch_local")


def env(**extra):
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)


def train_one_process(workdir, devices=2, *extra):
  """train.py in one process with `devices` simulated CPU devices."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  out = subprocess.run([sys.executable, "train.py", *FLAGS, f"--workdir={workdir}", *extra],
                       cwd=ROOT, env=env(XLA_FLAGS=flags.strip()), capture_output=True,
                       text=True, timeout=RUN_TIMEOUT_S)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def launch(workdir, processes, *extra, script="train.py"):
  """`processes` processes of one run (one device each) through scripts/launch_local.py."""
  out = subprocess.run([sys.executable, "scripts/launch_local.py",
                        f"--num_processes={processes}", "--", script, *FLAGS,
                        f"--workdir={workdir}", f"--heartbeat_timeout_s={HEARTBEAT_S}", *extra],
                       cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=RUN_TIMEOUT_S)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def start_process(index, count, port, workdir, *extra):
  """One process of a multi-process run, started by hand (as a cluster would)."""
  return subprocess.Popen(
      [sys.executable, "train.py", *FLAGS, f"--workdir={workdir}",
       f"--heartbeat_timeout_s={HEARTBEAT_S}", *extra], cwd=ROOT,
      env=launcher.process_env(index, count, 1, "cpu", f"localhost:{port}"),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def states(workdir):
  """(state at the last step, step) of a run, restored onto this process's one device."""
  *_, state, _, step = training_state.restore_run(workdir)
  return jax.device_get(state), step


def assert_same_state(workdir, reference):
  state, step = states(workdir)
  expected, expected_step = states(reference)
  assert step == expected_step == STEPS, (step, expected_step)
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  leaves = jax.tree_util.tree_leaves(expected)
  assert len(flat) == len(leaves)
  for (path, a), b in zip(flat, leaves):
    a, b = np.asarray(a), np.asarray(b)
    # Bitwise: the same global batch, the same program partitioned over the same 2-device
    # mesh; gloo sums two shards in the order XLA's in-process all-reduce does.
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)


def without_steps_after(workdir, step, dest):
  """A copy of a run's workdir holding only its checkpoints up to `step` (as if it had stopped
  there)."""
  shutil.copytree(workdir, dest)
  for s in checkpointing.steps_on_disk(str(dest)):
    if s > step:
      shutil.rmtree(os.path.join(checkpointing.checkpoint_dir(str(dest)), str(s)))
  return str(dest)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """One process, 2 simulated devices, STEPS uninterrupted steps."""
  path = str(tmp_path_factory.mktemp("reference") / "run")
  train_one_process(path)
  return path


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
  """2 processes x 1 device: (workdir, the launcher's output)."""
  path = str(tmp_path_factory.mktemp("two") / "run")
  return path, launch(path, 2)


def test_two_processes_train_like_one_with_two_devices(reference, two_process_run):
  path, out = two_process_run
  assert_same_state(path, reference)
  # One voice: process 1 prints nothing on stdout; one TensorBoard file; one run_info entry.
  assert "[0] model:" in out.stdout
  assert not [l for l in out.stdout.splitlines() if l.startswith("[1] ") and "[Gloo]" not in l]
  assert len(os.listdir(os.path.join(path, "tensorboard"))) == 1
  from diffgemma.runs import provenance

  (invocation,) = provenance.load_run_info(path)["invocations"]
  assert invocation["processes"] == 2 and invocation["stop_reason"] == "num_train_steps"


def test_checkpoints_move_between_process_counts(reference, two_process_run, tmp_path):
  """2 processes -> 1 (with 2 devices), and 1 -> 2, resume from step 2 and end where the
  uninterrupted run ends."""
  path, _ = two_process_run
  to_one = without_steps_after(path, EVERY, tmp_path / "to_one")
  out = train_one_process(to_one)
  assert f"resumed from step {EVERY}" in out.stdout
  assert_same_state(to_one, reference)
  to_two = without_steps_after(reference, EVERY, tmp_path / "to_two")
  out = launch(to_two, 2)
  assert f"[0] resumed from step {EVERY}" in out.stdout
  assert_same_state(to_two, reference)


def test_a_config_that_differs_between_processes_is_refused(tmp_path):
  port = launcher.free_port()
  workdir = str(tmp_path / "run")
  procs = [start_process(0, 2, port, workdir),
           start_process(1, 2, port, workdir, "--config.seed=7")]
  outs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in procs]
  for p, (stdout, stderr) in zip(procs, outs):
    assert p.returncode == 2, stderr
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: process 1 runs a different config (seed=7 vs 0, --config.*="), lines
    assert "model:" not in stdout  # nothing started
  assert not os.path.exists(os.path.join(workdir, "checkpoints"))


def test_a_killed_process_stops_the_other_and_a_rerun_resumes(reference, tmp_path):
  port = launcher.free_port()
  workdir = str(tmp_path / "run")
  procs = [start_process(i, 2, port, workdir) for i in range(2)]
  try:
    first = os.path.join(checkpointing.checkpoint_dir(workdir), str(EVERY))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not os.path.isdir(first) and time.monotonic() < deadline:
      assert procs[1].poll() is None, procs[1].communicate()[1][-2000:]
      time.sleep(0.005)
    os.kill(procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = procs[0].communicate(timeout=60 + 30)
    took = time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  assert took < 60, took
  lines = [l for l in stderr.splitlines() if l.strip()]
  assert len(lines) == 1, stderr
  assert lines[0].startswith("error: process 1 of 2 is gone"), lines
  assert procs[0].returncode == 4, procs[0].returncode
  last = checkpointing.latest_step(workdir)
  assert last is not None and last < STEPS, last  # the kill came mid-run
  out = launch(workdir, 2)
  assert f"[0] resumed from step {last}" in out.stdout
  assert_same_state(workdir, reference)
