"""Reliability: one trainer per workdir, damaged checkpoints fall back, nothing non-finite is
saved, failed writes and data pipelines end in one line, resume changes nothing silently, and a
run killed at random moments (inside checkpoint writes too) resumes bitwise exactly.

Every run here is the tests' tiny Sudoku model; the uninterrupted reference run is trained once
per module. Runs of train.py in a subprocess share the suite's XLA compilation cache.
"""

import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from diffgemma.runs import checkpointing, resume_config, guard, workdir_lock
from diffgemma.tasks import sudoku_puzzles
from diffgemma.training import loop
from tests.helpers import ROOT, one_line_error, run
from tests.helpers import restore_run, tiny_sudoku_config

STEPS, EVERY = 8, 2
TINY_CONFIG = "--config=tests/tiny_sudoku_config.py"
TINY_FLAGS = (TINY_CONFIG, f"--config.num_train_steps={STEPS}", f"--config.checkpoint_every={EVERY}")


def config_of_run():
  config = tiny_sudoku_config(workdir_steps=STEPS)
  config.checkpoint_every = EVERY
  return config


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted run of STEPS steps (checkpoints every EVERY, the last two kept)."""
  path = str(tmp_path_factory.mktemp("reference") / "run")
  loop.train(config_of_run(), path)
  return path


def final_state(workdir):
  *_, state, _, step = restore_run(workdir)
  return state, step


def assert_bitwise_equal(workdir, reference_dir, note=""):
  """`note` is appended to every assertion message (e.g. a seed and the rerun command)."""
  state, step = final_state(workdir)
  expected, expected_step = final_state(reference_dir)
  assert step == expected_step == STEPS, f"steps {step}, {expected_step} != {STEPS}{note}"
  flat = jax.tree_util.tree_flatten_with_path(state)[0]
  leaves = jax.tree_util.tree_leaves(expected)
  assert len(flat) == len(leaves), f"{len(flat)} leaves vs {len(leaves)}{note}"
  for (path, a), b in zip(flat, leaves):
    a, b = np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b))
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), jax.tree_util.keystr(path) + note


def copy_run(reference_dir, dest):
  shutil.copytree(reference_dir, dest)
  return str(dest)


def train_cmd(workdir, *extra):
  return [sys.executable, "train.py", *TINY_FLAGS, f"--workdir={workdir}", *extra]


def start(cmd, log_path, **popen):
  log = open(log_path, "w")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env,
                          **popen), log


# train.py with its imports done ahead, started by a file appearing: it reaches the workdir
# lock within a fraction of a second of the go, while the first trainer is still busy.
PRELOADED = """
import os, runpy, sys, time
import jax, diffgemma.training.stages.sdrl, diffgemma.training.update_step, tests.helpers
go, sys.argv = sys.argv[1], sys.argv[2:]
while not os.path.exists(go):
  time.sleep(0.005)
runpy.run_path("train.py", run_name="__main__")
"""


# ----------------------------------------------------------------------------- the workdir lock


def test_a_second_trainer_on_a_workdir_fails_in_one_line(reference, tmp_path):
  workdir, go = tmp_path / "shared", tmp_path / "go"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  second = subprocess.Popen(
      [sys.executable, "-c", PRELOADED, str(go), *train_cmd(workdir, "--config.optimizer.lr=0.01")[1:]],
      cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
  first, log = start(train_cmd(workdir), tmp_path / "first.log")
  try:
    deadline = time.time() + 240
    while not workdir_lock.read_holder(workdir_lock.lock_path(workdir)):
      assert first.poll() is None and time.time() < deadline, open(tmp_path / "first.log").read()
      time.sleep(0.01)
    go.touch()
    out, err = second.communicate(timeout=120)
    assert first.poll() is None, "the first trainer ended before the second was refused"
    one_line_error(subprocess.CompletedProcess(second.args, second.returncode, out, err),
                   f"workdir {workdir} is in use by another trainer",
                   f"PID {first.pid} on host", "--workdir")
    assert first.wait(timeout=300) == 0, open(tmp_path / "first.log").read()
  finally:
    first.kill()
    second.kill()
    log.close()
  assert_bitwise_equal(str(workdir), reference)
  assert workdir_lock.read_holder(workdir_lock.lock_path(workdir)) is None  # released


def _dead_pid():
  child = subprocess.Popen([sys.executable, "-c", "pass"])
  child.wait()
  return child.pid


def test_a_stale_lock_is_taken_over_and_a_live_holder_is_not(tmp_path):
  workdir = str(tmp_path / "run")
  os.makedirs(workdir)
  path = workdir_lock.lock_path(workdir)
  # What a SIGKILLed trainer leaves: its record, no flock (the kernel dropped it).
  stale = dict(workdir_lock.holder_info(), pid=_dead_pid(), process_start=1)
  with open(path, "w") as f:
    json.dump(stale, f)
  notices = []
  with workdir_lock.hold(workdir, log=notices.append):
    assert workdir_lock.read_holder(path)["pid"] == os.getpid()
    # A second holder, even in this process (flock is per open file), is refused in one line.
    with pytest.raises(workdir_lock.WorkdirBusyError) as busy:
      with workdir_lock.hold(workdir):
        pass
    message = str(busy.value)
    assert "\n" not in message and f"PID {os.getpid()} on host" in message
  assert len(notices) == 1 and f"PID {stale['pid']}" in notices[0]
  assert "no longer running" in notices[0]
  # Garbage in the file is no holder at all.
  with open(path, "w") as f:
    f.write("{not json")
  with workdir_lock.hold(workdir, log=notices.append):
    pass
  # A record naming a live process (same boot, same start time) refuses even without a flock:
  # the lock file was replaced under a running trainer.
  sleeper = subprocess.Popen(["sleep", "30"])
  try:
    live = dict(workdir_lock.holder_info(), pid=sleeper.pid,
                process_start=workdir_lock._process_start(sleeper.pid))
    with open(path, "w") as f:
      json.dump(live, f)
    if live["process_start"] is not None and live["boot_id"] is not None:  # Linux /proc
      with pytest.raises(workdir_lock.WorkdirBusyError, match=f"PID {sleeper.pid}"):
        with workdir_lock.hold(workdir):
          pass
  finally:
    sleeper.kill()
    sleeper.wait()
  with workdir_lock.hold(workdir, log=notices.append):  # its process is gone now
    pass


# ----------------------------------------------------------------------------- damaged checkpoints


def _data_files(step_dir):
  return [os.path.join(d, f) for d, _, names in os.walk(step_dir) for f in names
          if os.sep + "d" + os.sep in os.path.join(d, f)]


def test_a_damaged_newest_checkpoint_falls_back_and_training_ends_equal(reference, tmp_path,
                                                                        capfd):
  workdir = copy_run(reference, tmp_path / "run")
  newest = os.path.join(checkpointing.checkpoint_dir(workdir), str(STEPS))
  # Every data file: which one holds the parameters (what a reader restores) and which the
  # optimizer state is up to the checkpoint writer's threads.
  targets = _data_files(newest)
  for target in targets:
    os.truncate(target, os.path.getsize(target) // 2)
  capfd.readouterr()

  # A reader (eval.py, sample.py) uses the older step and leaves the workdir as it is.
  _, step = final_state(workdir)
  assert step == STEPS - EVERY and os.path.isdir(newest)
  notices = [l for l in capfd.readouterr().err.splitlines()
             if l.startswith(("warning: checkpoint", "using checkpoint", "moved damaged"))]
  assert len(notices) == 2, notices
  assert notices[0].startswith(f"warning: checkpoint step {STEPS} in ") and "cannot be read" in notices[0]
  assert notices[1] == f"using checkpoint step {STEPS - EVERY}, the newest readable one"

  # The trainer moves the damaged step aside (never deleting it), resumes from the older one
  # and ends where the uninterrupted run ended.
  loop.train(config_of_run(), workdir)
  err = capfd.readouterr().err
  assert f"moved damaged checkpoint step {STEPS} to " in err and "Traceback" not in err
  moved = os.listdir(os.path.join(workdir, checkpointing.DAMAGED_DIR))
  assert len(moved) == 1 and moved[0].startswith(f"{STEPS}-")
  assert all(os.path.getsize(os.path.join(workdir, checkpointing.DAMAGED_DIR, moved[0],
                                          os.path.relpath(target, newest))) > 0
             for target in targets)
  assert_bitwise_equal(workdir, reference)


def test_no_readable_checkpoint_is_one_line_and_moves_nothing(reference, tmp_path):
  workdir = copy_run(reference, tmp_path / "run")
  for step in checkpointing.steps_on_disk(workdir):
    os.remove(os.path.join(checkpointing.checkpoint_dir(workdir), str(step), "default",
                           "manifest.ocdbt"))
  r = run("train.py", *TINY_FLAGS, f"--workdir={workdir}")
  one_line_error(r, "no checkpoint in", f"step {STEPS}: ", "nothing was moved")
  assert checkpointing.steps_on_disk(workdir) == [STEPS, STEPS - EVERY]
  assert not os.path.exists(os.path.join(workdir, checkpointing.DAMAGED_DIR))


# ----------------------------------------------------------------------------- saving


def test_save_refuses_non_finite_state_and_keeps_the_finite_checkpoints(tmp_path):
  workdir = str(tmp_path / "run")
  state = {"step": jnp.int32(1), "params": {"w": jnp.ones((3, 4)), "b": jnp.zeros(4)},
           "rng": jax.random.PRNGKey(0)}
  mngr = checkpointing.manager(workdir, keep=1)
  checkpointing.save(mngr, 1, state)
  checkpointing.finish(mngr)
  for bad in (jnp.nan, jnp.inf, -jnp.inf):
    broken = {**state, "params": {**state["params"], "b": state["params"]["b"].at[2].set(bad)}}
    mngr = checkpointing.manager(workdir, keep=1)
    with pytest.raises(checkpointing.NonFiniteStateError) as e:
      checkpointing.save(mngr, 2, broken)
    checkpointing.finish(mngr)
    message = str(e.value)
    assert "\n" not in message and "refusing to save step 2" in message
    assert "['params']['b']" in message and "Last finite checkpoint: step 1" in message
    assert checkpointing.steps_on_disk(workdir) == [1]  # keep=1 deleted nothing
  assert checkpointing.non_finite_leaves(state) == []


def test_a_full_disk_during_a_save_is_one_line_and_the_rerun_ends_equal(reference, tmp_path,
                                                                       monkeypatch):
  workdir = str(tmp_path / "run")
  real_save = ocp.CheckpointManager.save

  def full_disk_at_step_4(self, step, *args, **kwargs):
    if step == 4:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_save(self, step, *args, **kwargs)

  monkeypatch.setattr(ocp.CheckpointManager, "save", full_disk_at_step_4)
  with pytest.raises(checkpointing.CheckpointWriteError) as e:
    loop.train(config_of_run(), workdir)
  message = str(e.value)
  assert "\n" not in message and "disk full" in message
  assert "the last complete checkpoint is step 2" in message
  monkeypatch.setattr(ocp.CheckpointManager, "save", real_save)
  assert checkpointing.steps_on_disk(workdir) == [2]
  loop.train(config_of_run(), workdir)
  assert_bitwise_equal(workdir, reference)


# Faults of orbax's background write, planted by tests/host_faults.py in a train.py run whose
# write of step 4 fails; the rerun resumes from step 2. Bounds, from the fault to the exit: a
# failure is seen after the step in flight ends (check_write), a hang once orbax's own timeout
# (checkpoint_timeout_s from its thread's start) or the wait's margin passes; EXIT_SLACK_S covers
# that step, the error path and the interpreter's exit on a loaded 2-core machine.
WRITE_TIMEOUT_S = 2
EXIT_SLACK_S = 10
PROGRESS = re.compile(r"^sft: +\d+%")


def _run_with_write_fault(workdir, marks, fault):
  """train.py with `fault` (a tests/host_faults.py flag) in the write of step 4: (exit status,
  stderr lines without the progress bar, seconds from the fault to the exit)."""
  os.makedirs(marks, exist_ok=True)
  proc, log = start([sys.executable, "-m", "tests.host_faults", f"--marks={marks}",
                     f"{fault}=4", "--", *train_cmd(workdir)[1:],
                     f"--config.checkpoint_timeout_s={WRITE_TIMEOUT_S}"],
                    os.path.join(marks, "log"))
  try:
    status = proc.wait(timeout=300)
  finally:
    proc.kill()
    log.close()
  ended = time.monotonic()
  text = open(os.path.join(marks, "log")).read()
  fault_at = os.path.join(marks, "write-fault-at")
  assert os.path.exists(fault_at), text
  lines = [l for l in text.splitlines() if l.startswith("error:") or "Traceback" in l]
  return status, lines, ended - float(open(fault_at).read())


def _assert_write_failure_ends_in_one_line(workdir, marks, fault, reason, bound_s, capsys):
  status, lines, took = _run_with_write_fault(workdir, marks, fault)
  with capsys.disabled():
    print(f"{fault}: time to stop {took:.1f} s (bound {bound_s} s)")
  directory = checkpointing.checkpoint_dir(workdir)
  assert (status, lines) == (2, [
      f"error: could not write checkpoint step 4 in {directory}: {reason}; the last complete "
      "checkpoint is step 2; fix the cause and rerun the same command to resume"])
  assert took < bound_s, f"{took:.1f} s, bound {bound_s} s"
  assert checkpointing.steps_on_disk(workdir) == [2]  # the failed step's tmp dir is not a step


def _assert_rerun_resumes_bitwise(workdir, reference, capsys):
  capsys.readouterr()
  loop.train(config_of_run(), workdir)
  assert f"resumed from step 2 in {workdir}" in capsys.readouterr().out
  assert_bitwise_equal(workdir, reference)
  assert not _tmp_checkpoints(workdir)


@pytest.mark.slow
def test_a_failed_background_write_ends_in_one_line_and_the_rerun_ends_equal(
    reference, tmp_path, capsys):
  workdir = str(tmp_path / "run")
  _assert_write_failure_ends_in_one_line(workdir, str(tmp_path / "marks"), "--fail_write",
                                         "injected I/O error", EXIT_SLACK_S, capsys)
  _assert_rerun_resumes_bitwise(workdir, reference, capsys)


@pytest.mark.slow
def test_a_hung_background_write_ends_within_its_timeout(reference, tmp_path, capsys):
  workdir = str(tmp_path / "run")
  _assert_write_failure_ends_in_one_line(
      workdir, str(tmp_path / "marks"), "--hang_write",
      f"the write did not finish within checkpoint_timeout_s={WRITE_TIMEOUT_S} s (a hung or "
      "overloaded file system; raise the key if writes are just slow)",
      WRITE_TIMEOUT_S + checkpointing.TIMEOUT_MARGIN_S + EXIT_SLACK_S, capsys)
  _assert_rerun_resumes_bitwise(workdir, reference, capsys)


@pytest.fixture
def small_filesystem(tmp_path):
  """A 16 MiB tmpfs (the run's checkpoints take under 1 MiB) mounted at tmp_path/small."""
  path = tmp_path / "small"
  path.mkdir()
  # CI and the developers' machines run as root (docs/operations.md): a failed mount fails.
  mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(path)],
                           capture_output=True, text=True)
  assert mounted.returncode == 0, f"cannot mount a tmpfs (root needed): {mounted.stderr.strip()}"
  yield path
  subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.mark.slow
def test_a_disk_filled_during_a_background_write_ends_in_one_line(reference, small_filesystem,
                                                                  capsys):
  """The file system fills up (another writer) as step 4's arrays are written: the write fails
  with ENOSPC in orbax's background write, which the save's start did not see."""
  workdir, marks = str(small_filesystem / "run"), str(small_filesystem / "marks")
  _assert_write_failure_ends_in_one_line(workdir, marks, "--fill_disk_write",
                                         checkpointing.DISK_FULL, EXIT_SLACK_S, capsys)
  os.remove(os.path.join(marks, "filler"))
  _assert_rerun_resumes_bitwise(workdir, reference, capsys)


def test_config_json_writes_are_atomic_and_fail_in_one_line(tmp_path, monkeypatch):
  config = config_of_run()
  checkpointing.save_config(str(tmp_path), config)
  before = open(tmp_path / "config.json").read()

  def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(os, "fsync", no_space)
  config.batch_size = 8
  with pytest.raises(checkpointing.CheckpointWriteError, match="disk full"):
    checkpointing.save_config(str(tmp_path), config)
  assert open(tmp_path / "config.json").read() == before
  assert sorted(os.listdir(tmp_path)) == ["config.json"]  # no temporary file left


def test_a_failing_data_pipeline_is_one_line_naming_the_last_checkpoint(tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  real = sudoku_puzzles.generated_record
  batch = config_of_run().batch_size

  def fails_at_step_4(seed, index, *args):
    if index >= 3 * batch:  # the records of step 4
      raise sudoku_puzzles.SudokuGenerationError("could not make a puzzle (injected)")
    return real(seed, index, *args)

  monkeypatch.setattr(sudoku_puzzles, "generated_record", fails_at_step_4)
  with pytest.raises(guard.RunFailure) as e:
    loop.train(config_of_run(), workdir)
  message = str(e.value)
  assert "\n" not in message
  assert message.startswith("the data pipeline failed preparing step 4: SudokuGenerationError")
  assert "the last complete checkpoint is step 2" in message
  assert checkpointing.steps_on_disk(workdir) == [2]


# ----------------------------------------------------------------------------- resume config


def test_resume_refuses_architecture_changes_in_one_line(reference, tmp_path):
  workdir = copy_run(reference, tmp_path / "run")
  before = open(os.path.join(workdir, "config.json")).read()
  r = run("train.py", *TINY_FLAGS, f"--workdir={workdir}", "--config.model.num_layers=3",
          "--config.optimizer.lr=0.01")
  one_line_error(r, "cannot resume", "model.num_layers (run: 1, requested: 3)",
                 "optimizer.lr (run: 0.003, requested: 0.01)", "new --workdir")
  assert open(os.path.join(workdir, "config.json")).read() == before


def test_reconcile_applies_safe_changes_and_refuses_the_rest():
  saved = config_of_run()
  same, changes = resume_config.reconcile(saved, config_of_run())
  assert changes == {} and same.to_dict() == saved.to_dict()

  longer = config_of_run()
  longer.num_train_steps = 20
  longer.eval.every_steps = 5
  longer.data.num_threads = 2
  merged, changes = resume_config.reconcile(saved, longer)
  assert changes == {"num_train_steps": [STEPS, 20], "eval.every_steps": [0, 5],
                     "data.num_threads": [0, 2]}
  assert merged.num_train_steps == 20 and merged.eval.every_steps == 5

  for key, value in (("model.num_layers", 3), ("data.seed", 5), ("loss.t_eps", 0.01),
                     ("optimizer.b2", 0.9), ("seed", 1), ("batch_size", 8)):
    changed = config_of_run()
    parent, _, leaf = key.rpartition(".")
    (changed[parent] if parent else changed)[leaf] = value
    with pytest.raises(resume_config.ResumeConfigError, match=key.replace(".", r"\.")) as e:
      resume_config.reconcile(saved, changed)
    assert "\n" not in str(e.value)

  # A run started from a checkpoint took that checkpoint's architecture: the config file's
  # (different) architecture is no change, unless the user set it on the command line.
  from_checkpoint = config_of_run()
  with from_checkpoint.unlocked():
    from_checkpoint.init_from = "/some/checkpoint"
  file_default = config_of_run()
  file_default.model.hidden_size = 32
  merged, changes = resume_config.reconcile(from_checkpoint, file_default)
  assert changes == {} and merged.model.hidden_size == 16 and merged.init_from
  with pytest.raises(resume_config.ResumeConfigError, match="model.hidden_size"):
    resume_config.reconcile(from_checkpoint, file_default, overridden={"model.hidden_size"})


def test_resume_records_safe_changes_with_their_step(reference, tmp_path, capsys):
  workdir = copy_run(reference, tmp_path / "run")
  changed = config_of_run()  # the run is complete: resuming trains no step (nothing compiles)
  changed.log_every = 3
  changed.keep_checkpoints = 5
  loop.train(changed, workdir)
  history = resume_config.history(workdir)
  assert len(history) == 1 and history[0]["step"] == STEPS
  assert history[0]["changes"] == {"keep_checkpoints": {"old": 2, "new": 5},
                                   "log_every": {"old": 1, "new": 3}}
  assert f"changed on resume at step {STEPS}: keep_checkpoints: 2 -> 5; log_every: 1 -> 3 (" in (
      capsys.readouterr().out)
  saved = checkpointing.load_config(workdir)
  assert saved.log_every == 3 and saved.keep_checkpoints == 5
  loop.train(changed, workdir)  # the same request again changes nothing more
  assert len(resume_config.history(workdir)) == 1


def test_a_damaged_config_history_is_kept_beside_the_new_one(tmp_path, capsys):
  """A config_history.json that is not a JSON list is renamed, not overwritten (it once read
  as no history, and the next resume's entry replaced it)."""
  for damaged in ("{not json", '{"step": 3}'):
    workdir = tmp_path / str(len(damaged))
    workdir.mkdir()
    (workdir / resume_config.HISTORY_FILE).write_text(damaged)
    with pytest.raises(ValueError, match="not a JSON list"):
      resume_config.history(str(workdir))
    resume_config.record(str(workdir), 7, {"log_every": [1, 3]})
    history = resume_config.history(str(workdir))
    assert [(h["step"], h["changes"]) for h in history] == [
        (7, {"log_every": {"old": 1, "new": 3}})]
    kept = [p for p in workdir.iterdir() if p.name != resume_config.HISTORY_FILE]
    assert len(kept) == 1 and kept[0].read_text() == damaged
    assert f"kept as {kept[0].name}" in capsys.readouterr().err


def test_a_damaged_run_info_is_one_line_and_kept(tmp_path):
  """run_info.json that is not a run record: one line saying to move it aside (it was a
  traceback, and its message said to delete the record)."""
  from diffgemma import errors
  from diffgemma.runs import provenance

  for damaged in ("{not json", "[]", '{"invocations": 3}'):
    (tmp_path / provenance.RUN_INFO).write_text(damaged)
    with pytest.raises(errors.UserError, match="move it aside") as e:
      provenance.record_start(str(tmp_path), 0)
    assert "\n" not in str(e.value)
    assert (tmp_path / provenance.RUN_INFO).read_text() == damaged


def test_a_run_saved_in_the_old_loss_layout_resumes_with_the_same_objective():
  """tests/fixtures/pre_flax_run saved `loss.encoder_loss_on_prompt=False`; it loads as
  encoder_scope="target", so today's recipe (every LossConfig field, that scope) resumes it,
  and a request for the other scope is refused as a change of objective."""
  import dataclasses
  from diffgemma.training import losses, run_config
  fixture = os.path.join(ROOT, "tests", "fixtures", "pre_flax_run")
  raw = json.load(open(os.path.join(fixture, "config.json")))
  assert raw["loss"]["encoder_loss_on_prompt"] is False and "encoder_scope" not in raw["loss"]
  saved = checkpointing.load_config(fixture)
  assert saved.loss.encoder_scope == "target" and "encoder_loss_on_prompt" not in saved.loss
  assert run_config.build(saved).loss == losses.LossConfig(**saved.loss.to_dict())
  kept = {k: v for k, v in raw["loss"].items() if k != "encoder_loss_on_prompt"}
  for scope, refused in (("target", False), ("prompt_and_target", True)):
    requested = ml_collections.ConfigDict(dict(raw, loss=dataclasses.asdict(
        losses.LossConfig(**kept, encoder_scope=scope))))
    if refused:
      with pytest.raises(resume_config.ResumeConfigError, match="loss.encoder_scope"):
        resume_config.reconcile(saved, requested)
    else:
      _, changes = resume_config.reconcile(saved, requested)
      assert set(changes) == {"loss.canvas_selection"}  # a key added since: adopted, logged


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("key, value, words", [
    ("batch_size", 0, "batch_size must be >= 1"),
    ("optimizer.lr", -1e-3, "optimizer.lr must be > 0"),
    ("optimizer.warmup_steps", 100, "exceeds num_train_steps"),
    ("keep_checkpoints", 0, "keep_checkpoints must be >= 1"),
    ("checkpoint_every", 0, "checkpoint_every must be >= 1"),
    ("optimizer.schedule", "linear", "unknown optimizer.schedule"),
    ("loss.noise_schedule", "cubic", "unknown loss.noise_schedule"),
    ("model.num_kv_heads", 0, "model.num_kv_heads must be >= 1"),
    ("model.head_dim", 7, "must be even"),
    ("sampler.max_new_tokens", 40, "cannot hold a Sudoku answer"),
    ("data.seed", -1, "data.seed must be >= 0"),
    ("batch_size", 2.5, "batch_size must be an integer"),
    ("optimizer.lr", float("nan"), "optimizer.lr must be a finite number"),
])
def test_bad_config_values_are_one_line_value_errors(key, value, words):
  config = config_of_run().to_dict()  # a plain dict: ConfigDict would refuse a wrong type
  parent, _, leaf = key.rpartition(".")
  (config[parent] if parent else config)[leaf] = value
  with pytest.raises(ValueError, match=words) as e:
    loop.prepare_config(ml_collections.ConfigDict(config), None, None)
  assert "\n" not in str(e.value)


def test_zero_batch_writes_nothing(tmp_path):
  workdir = tmp_path / "run"
  one_line_error(run("train.py", TINY_CONFIG, f"--workdir={workdir}", "--config.batch_size=0"),
                 "batch_size must be >= 1")
  assert not workdir.exists()


def test_conflicting_givens_are_reported_before_sampling(tmp_path):
  # The run's task parses the puzzle: its config is all a check before the weights load needs.
  checkpointing.save_config(str(tmp_path), config_of_run())
  puzzle = "55" + "." * 79
  one_line_error(run("sample.py", f"--workdir={tmp_path}", f"--puzzle={puzzle}"),
                 "digit 5 is given twice in row 1")
  assert sudoku_puzzles.conflicting_givens(np.array([5] + [0] * 8 + [5] + [0] * 71)) == (
      "digit 5 is given twice in column 1 (row 1 column 1, and row 2 column 1)")
  grid = np.zeros(81, np.int8)
  grid[[0, 10]] = 3  # row 1 col 1, row 2 col 2: same box
  assert "in box 1" in sudoku_puzzles.conflicting_givens(grid)
  puzzles, _ = sudoku_puzzles.generate_puzzles(0, 3, 30, 40)
  assert all(sudoku_puzzles.conflicting_givens(p) is None for p in puzzles)


# ----------------------------------------------------------------------------- SIGKILL


def _tmp_checkpoints(workdir):
  """{(name, inode, ctime)} of the temporary directories of checkpoint writes in progress (or
  cut by a kill)."""
  directory = checkpointing.checkpoint_dir(workdir)
  found = set()
  names = os.listdir(directory) if os.path.isdir(directory) else []
  for name in names:
    if ".orbax-checkpoint-tmp" in name:
      try:
        st = os.stat(os.path.join(directory, name))
      except OSError:  # renamed into place meanwhile: that write is complete
        continue
      found.add((name, st.st_ino, st.st_ctime_ns))
  return found


def _run_until_killed(workdir, log_path, rng, write_of_step=None):
  """Start train.py and SIGKILL it: with `write_of_step`, inside the checkpoint write of the
  first step >= it (0-50 ms after its temporary directory appears); else at a random moment
  0-3 s after the run announced its steps (compiling, training or saving). Returns whether the
  kill landed inside a write (checked on disk after the kill), or None if the run finished
  first. A write cut by an earlier kill leaves a directory of the same name until the next
  trainer clears it: only a new directory (another inode or change time) counts."""
  cut_before = _tmp_checkpoints(workdir)
  proc, log = start(train_cmd(workdir), log_path)
  try:
    deadline = time.time() + 300
    announced_at = None
    wait = rng.uniform(0.0, 3.0)
    while proc.poll() is None and time.time() < deadline:
      if write_of_step is not None:
        if any(int(name.split(".")[0]) >= write_of_step
               for name, *_ in _tmp_checkpoints(workdir) - cut_before):
          time.sleep(rng.uniform(0.0, 0.05))
          break
      else:
        if announced_at is None and "training steps" in open(log_path).read():
          announced_at = time.time()
        if announced_at is not None and time.time() - announced_at > wait:
          break
      time.sleep(0.002)
    if proc.poll() is not None:
      return None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return bool(_tmp_checkpoints(workdir) - cut_before)
  finally:
    proc.kill()
    log.close()


SEED_ENV = "DIFFGEMMA_TEST_SEED"
KILL_TEST = "tests/test_reliability.py::test_sigkill_at_random_moments_then_rerun_is_bitwise_equal"


def draw_seed(environ=os.environ) -> int:
  """The kill test's seed: $DIFFGEMMA_TEST_SEED if set (to rerun a failure), else a fresh one
  from the OS."""
  value = environ.get(SEED_ENV, "").strip()
  if value:
    return int(value)
  return random.SystemRandom().randrange(2**32)


def seed_note(seed: int) -> str:
  """What every assertion of the kill test appends: its seed and the command rerunning it."""
  return (f" [seed {seed}; rerun: {SEED_ENV}={seed} python -m pytest -q -n 0 "
          f"{KILL_TEST}]")


def test_draw_seed_takes_the_environment_else_the_os():
  assert draw_seed({SEED_ENV: "12345"}) == 12345
  assert draw_seed({SEED_ENV: " 7 "}) == 7
  drawn = {draw_seed({}) for _ in range(8)}  # 8 draws of 2**32 values: a repeat ~7e-9
  assert len(drawn) == 8 and all(0 <= s < 2**32 for s in drawn), drawn
  assert "DIFFGEMMA_TEST_SEED=99 python -m pytest" in seed_note(99) and KILL_TEST in seed_note(99)


def test_sigkill_at_random_moments_then_rerun_is_bitwise_equal(reference, tmp_path):
  """Kills inside the write of a random step (not the first, so a rerun resumes from a
  checkpoint), at a random moment of the next run, and inside the next run's next write. The
  seed is drawn once (draw_seed); every assertion names it and the command that reruns it."""
  seed = draw_seed()
  note = seed_note(seed)
  rng = random.Random(seed)
  workdir = str(tmp_path / "run")
  kills, killed_last = [], False
  for i in range(3):
    latest = checkpointing.latest_step(workdir) or 0
    target = {0: rng.choice(range(2 * EVERY, STEPS, EVERY)), 1: None, 2: latest + EVERY}[i]
    if target is not None and target > STEPS:
      break
    outcome = _run_until_killed(workdir, tmp_path / f"kill{i}.log", rng, target)
    killed_last = outcome is not None
    if outcome is None:
      break
    kills.append((target, outcome, checkpointing.latest_step(workdir)))
  print(f"kills (write of step or None, landed inside a write, latest step after): {kills}"
        f"{note}")
  assert kills, f"the first run finished before it could be killed{note}"
  assert any(landed for _, landed, _ in kills), f"no kill inside a write: {kills}{note}"
  assert kills[0][2] is not None, f"the first kill left no checkpoint: {kills}{note}"
  proc, log = start(train_cmd(workdir), tmp_path / "final.log")
  returncode = proc.wait(timeout=300)
  log.close()
  text = open(tmp_path / "final.log").read()
  assert returncode == 0, f"the final run exited {returncode}{note}\n{text}"
  assert "Traceback" not in text, f"a traceback in the final run{note}\n{text}"
  if killed_last:  # a SIGKILLed trainer's lock file is stale
    assert "taking over the lock" in text, f"the stale lock was not taken over{note}\n{text}"
  leftover = _tmp_checkpoints(workdir)
  assert not leftover, f"interrupted writes not cleared: {sorted(leftover)}{note}"
  assert_bitwise_equal(workdir, reference, note)
