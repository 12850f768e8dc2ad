"""Many hosts on one machine: 2-4 processes on JAX's multi-controller runtime (gloo collectives,
one simulated CPU device each) train the tests' tiny Sudoku model like one process with as many
simulated devices, share checkpoints with runs of another process count, refuse a config that
differs between processes, and stop (with one line naming it) when one process is killed.

Every multi-process run goes through scripts/launch_local.py or the same environment it sets,
with a timeout on every subprocess. The uninterrupted single-process reference (2 simulated
devices) is trained once per module; the runs share the suite's XLA compilation cache.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from diffgemma.runs import checkpointing
from tests.helpers import ROOT, load_script, restore_run

# The slow tier (`pytest -m slow`, run by CI after the suite): several processes or
# optimised compiles per test.
pytestmark = pytest.mark.slow

STEPS, EVERY = 8, 2
HEARTBEAT_S = 10  # the watchdog's timeout in these runs (the default is 30 s)
# After the heartbeat timeout: the watchdog's next look (a beat interval), the exit, and a
# loaded core's scheduling.
LOST_MARGIN_S = 8
RUN_TIMEOUT_S = 400
FLAGS = ("--config=tests/tiny_sudoku_config.py", f"--config.num_train_steps={STEPS}",
         f"--config.checkpoint_every={EVERY}", f"--config.keep_checkpoints={STEPS}",
         "--config.sharding.fsdp=-1",  # fsdp over every device of the run, however many
         "--config.model.num_layers=1")  # compiles dominate these tests' time
launcher = load_script("launch_local")
PROGRESS = re.compile(r"^sft: +\d+%")  # process 0's progress bar, on its stderr


def env(**extra):
  return dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **extra)


def one_process_env(devices=2):
  """The environment of one process with `devices` simulated CPU devices."""
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
  return env(XLA_FLAGS=flags.strip())


def train_one_process(workdir, devices=2, *extra, base=FLAGS):
  """train.py in one process with `devices` simulated CPU devices."""
  out = subprocess.run([sys.executable, "train.py", *base, f"--workdir={workdir}", *extra],
                       cwd=ROOT, env=one_process_env(devices), capture_output=True,
                       text=True, timeout=RUN_TIMEOUT_S)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


def launch(workdir, processes, *extra, base=FLAGS):
  """`processes` processes of one run (one device each) through scripts/launch_local.py."""
  out = subprocess.run([sys.executable, "scripts/launch_local.py",
                        f"--num_processes={processes}", "--", "train.py", *base,
                        f"--workdir={workdir}", f"--heartbeat_timeout_s={HEARTBEAT_S}", *extra],
                       cwd=ROOT, env=env(), capture_output=True, text=True,
                       timeout=RUN_TIMEOUT_S)
  assert out.returncode == 0, out.stderr[-3000:]
  return out


LATE_TO_THE_LOCK = """
import runpy, sys, time
from diffgemma.runs import workdir_lock
hold = workdir_lock.hold
def late_hold(*args, **kwargs):
  time.sleep({late_s})
  return hold(*args, **kwargs)
workdir_lock.hold = late_hold
sys.argv = {argv!r}
runpy.run_path("train.py", run_name="__main__")
"""


def start_process(index, count, port, workdir, *extra, late_to_the_lock_s=None):
  """One process of a multi-process run, started by hand (as a cluster would).
  `late_to_the_lock_s`: it waits that long before taking part in the workdir lock."""
  argv = ["train.py", *FLAGS, f"--workdir={workdir}", f"--heartbeat_timeout_s={HEARTBEAT_S}",
          *extra]
  if late_to_the_lock_s is not None:
    argv = ["-c", LATE_TO_THE_LOCK.format(late_s=late_to_the_lock_s, argv=argv)]
  return subprocess.Popen(
      [sys.executable, *argv], cwd=ROOT,
      env=launcher.process_env(index, count, 1, "cpu", f"localhost:{port}"),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def states(workdir):
  """(state at the last step, step) of a run, restored onto this process's one device."""
  *_, state, _, step = restore_run(workdir)
  return jax.device_get(state), step


def assert_same_state(workdir, reference, steps=STEPS, tolerance=None):
  """The two runs' states at their last step: bitwise, or with `tolerance` (rtol, atol) within
  float rounding, for runs whose mesh changed on resume (a 4-way FSDP sum adds the batch's
  gradient shards in another order than a 2-way one)."""
  state, step = states(workdir)
  expected, expected_step = states(reference)
  assert step == expected_step == steps, (step, expected_step)
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  leaves = jax.tree_util.tree_leaves(expected)
  assert len(flat) == len(leaves)
  for (path, a), b in zip(flat, leaves):
    a, b = np.asarray(a), np.asarray(b)
    if tolerance is not None:
      np.testing.assert_allclose(a, b, *tolerance, err_msg=jax.tree_util.keystr(path))
      continue
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


def test_a_two_process_checkpoint_resumes_in_one_process(reference, two_process_run, tmp_path):
  """2 processes -> 1 (with 2 devices): resumed from step EVERY, it ends where the uninterrupted
  run ends (1 -> 2 is the killed run's story below)."""
  path, _ = two_process_run
  to_one = without_steps_after(path, EVERY, tmp_path / "to_one")
  out = train_one_process(to_one)
  assert f"resumed from step {EVERY}" in out.stdout
  assert_same_state(to_one, reference)


# Float32 rounding of the reductions, carried through 6 AdamW steps: measured at most 6e-8 in
# the parameters and 7.5e-9 in the optimizer state (2 -> 4); the bounds leave a 15x margin.
REMESHED_TOLERANCE = (1e-5, 1e-6)  # (rtol, atol)


def test_a_two_process_checkpoint_continues_in_four_processes_and_back_in_two(
    reference, two_process_run, tmp_path):
  """2 processes -> 4 (one device each, fsdp=4) -> 2: every process restores its share of the
  other mesh's checkpoint and the run ends where the uninterrupted 2-device run ends, within
  float32 rounding of the 4-way reductions."""
  path, _ = two_process_run
  to_four = without_steps_after(path, EVERY, tmp_path / "to_four")
  out = launch(to_four, 4)
  assert f"[0] resumed from step {EVERY}" in out.stdout
  assert_same_state(to_four, reference, tolerance=REMESHED_TOLERANCE)
  # 4 -> 2: the 4-process run's checkpoint at step 2 * EVERY continues in 2 processes.
  to_two = without_steps_after(to_four, 2 * EVERY, tmp_path / "to_two")
  out = launch(to_two, 2)
  assert f"[0] resumed from step {2 * EVERY}" in out.stdout
  assert_same_state(to_two, reference, tolerance=REMESHED_TOLERANCE)


LORA_STEPS = 3
LORA_FLAGS = ("--config.lora.enabled=True", "--config.lora.rank=2", "--config.lora.alpha=4.0",
              "--config.lora.base_dtype=float32", "--config.lora.dropout=0.1",
              f"--config.num_train_steps={LORA_STEPS}")


def test_a_lora_run_in_two_processes_trains_like_one(reference, tmp_path):
  """LoRA adapters on the reference run as the frozen base (read from --init_from by every
  process, sharded over the run's devices)."""
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  train_one_process(one, 2, f"--init_from={reference}", *LORA_FLAGS)
  launch(two, 2, f"--init_from={reference}", *LORA_FLAGS)
  assert_same_state(two, one, steps=LORA_STEPS)
  # Its adapters checkpoint (2 processes) resumes in one process, the base re-read from
  # --init_from, and ends where the uninterrupted run ends.
  to_one = without_steps_after(two, EVERY, tmp_path / "to_one")
  out = train_one_process(to_one, 2, f"--init_from={reference}", *LORA_FLAGS)
  assert f"resumed from step {EVERY}" in out.stdout
  assert_same_state(to_one, one, steps=LORA_STEPS)


SDRL_FLAGS = ("--config=tests/tiny_sdrl_config.py", "--config.sharding.fsdp=-1")


def test_an_sdrl_run_in_two_processes_trains_like_one(tmp_path):
  """SD·RL: every process samples the rollout of all prompts on the run's mesh (its rows
  gathered to every host for the rewards); the update's states stay global arrays."""
  from tests.helpers import save_sft_run, tiny_configs

  sft = str(tmp_path / "sft")
  sft_config = tiny_configs()[0]
  sft_config.model.num_layers = 1  # the SD·RL run adopts the architecture of its init
  save_sft_run(sft_config, sft)
  one, two = str(tmp_path / "one"), str(tmp_path / "two")
  train_one_process(one, 2, f"--init_from={sft}", base=SDRL_FLAGS)
  launch(two, 2, f"--init_from={sft}", base=SDRL_FLAGS)
  assert_same_state(two, one, steps=tiny_configs()[1].num_train_steps)


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
    expected = "error: process 1 runs a different config (seed=7 vs 0, --config.*="
    assert lines[0].startswith(expected), lines
    assert "model:" not in stdout  # nothing started
  assert not os.path.exists(os.path.join(workdir, "checkpoints"))


def test_a_killed_process_stops_the_other_and_a_rerun_resumes(reference, tmp_path):
  """A one-process run's checkpoint continues in 2 processes; one of them is killed (kill -9)
  mid-run; the other stops within the heartbeat timeout and LOST_MARGIN_S with one line naming
  it and the last complete checkpoint; a rerun resumes and ends where the uninterrupted run
  ends. (tests/test_host_failures.py: the coordinator killed or stopped, a peer stopped,
  SIGTERM mid-step and mid-save, a full disk.)"""
  workdir = without_steps_after(reference, EVERY, tmp_path / "run")
  port = launcher.free_port()
  procs = [start_process(i, 2, port, workdir) for i in range(2)]
  try:
    after = os.path.join(checkpointing.checkpoint_dir(workdir), str(2 * EVERY))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not os.path.isdir(after) and time.monotonic() < deadline:
      assert procs[1].poll() is None, procs[1].communicate()[1][-2000:]
      time.sleep(0.005)
    os.kill(procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    stdout, stderr = procs[0].communicate(timeout=HEARTBEAT_S + LOST_MARGIN_S + 30)
    took = time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  assert f"resumed from step {EVERY}" in stdout
  assert took < HEARTBEAT_S + LOST_MARGIN_S, took
  lines = [l for l in stderr.splitlines() if l.strip() and not PROGRESS.match(l)]
  assert len(lines) == 1, stderr
  last = checkpointing.latest_step(workdir)
  assert 2 * EVERY <= last < STEPS, last  # the kill came mid-run
  assert lines[0].startswith("error: process 1 of 2 is gone"), lines
  assert lines[0].endswith(f"; stopping process 0; the last complete checkpoint is step {last} "
                           f"in {checkpointing.checkpoint_dir(workdir)}; rerun the same command "
                           "to resume from it"), lines
  assert procs[0].returncode == 4, procs[0].returncode
  out = launch(workdir, 2)
  assert f"[0] resumed from step {last}" in out.stdout
  assert_same_state(workdir, reference)


def test_launch_settings_come_from_flags_or_the_environment():
  from diffgemma import errors
  from diffgemma.runs import distributed

  env = {"DIFFGEMMA_COORDINATOR": "h0:1234", "DIFFGEMMA_NUM_PROCESSES": "4",
         "DIFFGEMMA_PROCESS_ID": "3"}
  assert distributed.settings(env={}) is None  # a single-process run
  assert distributed.settings(distributed=True, env={}) == {}  # the cluster's auto-detection
  assert distributed.settings(env=env) == {"coordinator_address": "h0:1234",
                                           "num_processes": 4, "process_id": 3}
  assert distributed.settings(process_id=1, env=env)["process_id"] == 1  # a flag wins
  for bad, needle in (({"DIFFGEMMA_NUM_PROCESSES": "2"}, "missing --coordinator_address"),
                      ({**env, "DIFFGEMMA_PROCESS_ID": "4"}, "--process_id=4 is not in 0..3"),
                      ({**env, "DIFFGEMMA_COORDINATOR": "h0"}, "write HOST:PORT"),
                      ({**env, "DIFFGEMMA_NUM_PROCESSES": "two"}, "is not an integer")):
    with pytest.raises(errors.ConfigError, match=re.escape(needle)):
      distributed.settings(env=bad)
  assert distributed.shared_argv(["--process_id=1", "--config=x"]) == ["--config=x"]


def test_launcher_environment_and_exit_status():
  env = launcher.process_env(1, 2, 3, "cpu", "localhost:5")
  assert (env["DIFFGEMMA_COORDINATOR"], env["DIFFGEMMA_NUM_PROCESSES"],
          env["DIFFGEMMA_PROCESS_ID"]) == ("localhost:5", "2", "1")
  assert env["XLA_FLAGS"].endswith("--xla_force_host_platform_device_count=3")
  assert launcher.process_env(1, 2, 3, "gpu", "h:5")["JAX_LOCAL_DEVICE_IDS"] == "3,4,5"
  assert launcher.exit_status(-9) == 137 and launcher.exit_status(2) == 2


def test_the_launcher_exits_with_the_first_failure_and_prefixes_output(tmp_path):
  """Process 1 fails at once; process 0 would run for minutes: it is killed after the grace."""
  script = tmp_path / "child.py"
  script.write_text("import os, sys, time\n"
                    "i = int(os.environ['DIFFGEMMA_PROCESS_ID'])\n"
                    "print('hello from', i, flush=True)\n"
                    "sys.exit(5) if i == 1 else time.sleep(600)\n")
  start = time.monotonic()
  out = subprocess.run([sys.executable, "scripts/launch_local.py", "--num_processes=2",
                        "--grace_s=1", "--", str(script)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 5, out.stderr
  assert time.monotonic() - start < 30
  assert sorted(out.stdout.splitlines()) == ["[0] hello from 0", "[1] hello from 1"]
  assert "[launch] killing process 0" in out.stderr


def test_a_busy_workdir_is_refused_on_every_process(tmp_path):
  """Process 1 reaches the lock seconds after process 0 has refused the workdir and ended:
  it still raises the same error itself, and is not stopped as the peer of a failed process."""
  from diffgemma.runs import distributed, workdir_lock

  workdir = str(tmp_path / "run")
  port = launcher.free_port()
  with workdir_lock.hold(workdir):  # another trainer (this test) holds the workdir
    procs = [start_process(0, 2, port, workdir),
             start_process(1, 2, port, workdir,
                           late_to_the_lock_s=4 * distributed.HEARTBEAT_INTERVAL_S)]
    outs = [p.communicate(timeout=RUN_TIMEOUT_S) for p in procs]
  for p, (_, stderr) in zip(procs, outs):
    assert p.returncode == 2, stderr
    lines = [l for l in stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: workdir {workdir} is in use"), stderr


def wait_for_invocations(workdir, count, proc):
  """Until the workdir's run_info.json records `count` invocations: the last one has set up its
  stop handler (train.py does that first) and is on its way to its first step (compiling)."""
  from diffgemma.runs import provenance

  deadline = time.monotonic() + RUN_TIMEOUT_S
  while len(provenance.load_run_info(workdir)["invocations"]) < count:
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    assert time.monotonic() < deadline
    time.sleep(0.005)


def assert_preempted_at(workdir, step, stdout, prefix=""):
  """The checkpoint at `step` is the newest, run_info says why, and the one line says how to
  resume."""
  from diffgemma.runs import provenance

  assert checkpointing.steps_on_disk(workdir) == [step, EVERY]  # one new checkpoint
  invocation = provenance.load_run_info(workdir)["invocations"][-1]
  assert (invocation["end_step"], invocation["stop_reason"]) == (step, provenance.PREEMPTED)
  lines = [l for l in stdout.splitlines() if "stopped at" in l]
  assert lines == [f"{prefix}stopped at step {step} on SIGTERM: checkpoint saved in "
                   f"{checkpointing.checkpoint_dir(workdir)}; rerun the same command to "
                   "resume"], stdout[-2000:]


def sigterm_during_setup(command, workdir, env_):
  """Start `command` on a run resumed from step EVERY, send it SIGTERM once this invocation is
  recorded (it is on its way to its first step) and wait: (exit status, stdout, stderr)."""
  proc = subprocess.Popen(command, cwd=ROOT, env=env_, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  try:
    wait_for_invocations(workdir, 2, proc)  # a launch: process 0 writes it after both hold the lock
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.communicate()
  return proc.returncode, stdout, stderr


def test_sigterm_stops_a_run_at_the_step_in_flight_and_a_rerun_resumes(reference, tmp_path):
  """SIGTERM to a run resumed from step EVERY, while it sets up: it trains the step in flight,
  saves it (not a periodic step), exits 0 with one line; the rerun ends where the uninterrupted
  run ends, bitwise."""
  workdir = without_steps_after(reference, EVERY, tmp_path / "run")
  status, stdout, stderr = sigterm_during_setup(
      [sys.executable, "train.py", *FLAGS, f"--workdir={workdir}"], workdir, one_process_env())
  assert status == 0, stderr[-3000:]
  assert_preempted_at(workdir, EVERY + 1, stdout)
  out = train_one_process(workdir)
  assert f"resumed from step {EVERY + 1}" in out.stdout
  assert_same_state(workdir, reference)


def test_sigterm_to_the_launcher_stops_both_processes_at_one_step(reference, tmp_path):
  """The launcher passes SIGTERM on to both processes; they agree on the stop step, save one
  checkpoint together and exit 0; a rerun of the same launch resumes and matches."""
  workdir = without_steps_after(reference, EVERY, tmp_path / "run")
  status, stdout, stderr = sigterm_during_setup(
      [sys.executable, "scripts/launch_local.py", "--num_processes=2", "--", "train.py", *FLAGS,
       f"--workdir={workdir}", f"--heartbeat_timeout_s={HEARTBEAT_S}"], workdir, env())
  assert status == 0, stderr[-3000:]  # both processes exited 0
  assert_preempted_at(workdir, EVERY + 1, stdout, prefix="[0] ")
  out = launch(workdir, 2)
  assert f"[0] resumed from step {EVERY + 1}" in out.stdout
  assert_same_state(workdir, reference)


def test_a_stop_that_outlives_the_grace_period_ends_with_one_line(reference, tmp_path):
  """SIGTERM while the resumed run compiles, with a grace period shorter than the compile: the
  watcher ends the process (exit status 5) with one line naming the last complete checkpoint,
  before a scheduler's SIGKILL would; nothing new is written."""
  from diffgemma.runs import preemption

  workdir = without_steps_after(reference, EVERY, tmp_path / "run")
  status, _, stderr = sigterm_during_setup(
      [sys.executable, "train.py", *FLAGS, f"--workdir={workdir}", "--preemption_grace_s=0.01"],
      workdir, one_process_env())
  assert status == preemption.GRACE_EXPIRED_EXIT_CODE, stderr[-3000:]
  # (after process 0's progress bar, which has no newline of its own)
  assert ["error:" + l.split("error:", 1)[1] for l in stderr.splitlines() if "error:" in l] == [
      "error: the stop did not finish within --preemption_grace_s=0.01; the last complete "
      f"checkpoint is step {EVERY} in {checkpointing.checkpoint_dir(workdir)}; rerun the same "
      "command to resume from it (or raise --preemption_grace_s)"], stderr[-2000:]
  assert checkpointing.steps_on_disk(workdir) == [EVERY]
