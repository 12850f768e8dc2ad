"""Orbax checkpoints of the training state, plus the run's config stored beside them.

Layout of a workdir: config.json (the full ConfigDict of the run), config_history.json (the
keys changed on resume, with the step they took effect; see resume_config.py), .lock (the
running trainer, workdir_lock.py), checkpoints/<step>/ (orbax, written to a temporary directory
and renamed, so an interrupted save never corrupts the last good checkpoint),
damaged_checkpoints/ (steps a trainer could not read, moved out of orbax's sight, never
deleted), tensorboard/ (event files).

Three guards keep the last good checkpoint good:
  * `save` refuses a state holding NaN or inf (one on-device reduction per save), so a
    diverged run never replaces finite checkpoints with non-finite ones;
  * a failed write (disk full, I/O error), as the save starts or in orbax's background write,
    ends in one line naming the step and the last complete one; a background write that has not
    finished `timeout_s` after it started (a hung file system) is a failed write. Nothing waits
    on a write without that bound: the next save, the close, and `check_write` (the loop calls
    it after every step, so a failure ends the run at the first step that ends after it);
  * `restore_latest` falls back from an unreadable newest step to the newest readable one.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import math
import os
import re
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp

from diffgemma import errors
from diffgemma.model.config import is_clip_bound
from diffgemma.runs import distributed

DAMAGED_DIR = "damaged_checkpoints"
# The default bound on a checkpoint's background write (config key checkpoint_timeout_s): ten
# minutes, 250 times the 2.4 s the default Sudoku recipe's write takes on a 2-core Xeon
# (benchmarks/RESULTS.md), and a 60 GB state at 100 MB/s; past it, a run whose file system hung
# ends in one line instead of waiting without a word.
DEFAULT_TIMEOUT_S = 600.0
CONFIG_FILE = "config.json"
# Characters of a library error message kept in a one-line notice.
ERROR_TEXT_CHARS = 160
DISK_FULL = "disk full (No space left on device)"
# How often a bounded wait looks at the write in flight.
WAIT_POLL_S = 0.05
# Past a write's timeout, before the wait gives up on it itself: orbax's own timeout (the same
# `timeout_s`, from its background thread's start) fails the write first, and its finalizing
# barriers need a moment to unwind.
TIMEOUT_MARGIN_S = 5.0


class CheckpointError(errors.InputError, FileNotFoundError):
  """No usable checkpoint where one was expected. One-line message."""

  def __str__(self):
    return str(self.args[0])


class NonFiniteStateError(CheckpointError):
  """A state holding NaN or inf was about to be saved."""


class CheckpointWriteError(CheckpointError):
  """Writing a checkpoint (or the config beside it) failed: disk full, I/O error."""


def _notice(message: str) -> None:
  print(message, file=sys.stderr)


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


class Manager(ocp.CheckpointManager):
  """orbax's CheckpointManager, knowing its write timeout and when its unwaited save started.

  timeout_s: the longest a save's background write may take (seconds); orbax fails the write
    past it (its commit futures and barriers), and `_wait_for_write` gives up on it soon after.
  write_started: time.monotonic() when the save not yet waited on started, else None.
  hung: a write timed out and may still hold orbax's threads (the process cannot join them).
  """

  def __init__(self, directory: str, options, timeout_s: float):
    super().__init__(directory, options=options)
    self.timeout_s, self.write_started, self.hung = timeout_s, None, False


def manager(workdir: str, keep: int | None = None, read_only: bool = False,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> Manager:
  """An orbax CheckpointManager of the workdir's checkpoints/, its background writes bounded by
  `timeout_s`. A writer (holding the workdir's lock) also clears the temporary directories of
  interrupted saves."""
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=not read_only, read_only=read_only,
      cleanup_tmp_directories=not read_only,
      async_options=ocp.AsyncOptions(timeout_secs=max(1, math.ceil(timeout_s))))
  return Manager(checkpoint_dir(workdir), options, timeout_s)


# ----------------------------------------------------------------------------- config files


def write_text_atomic(path: str, text: str) -> None:
  """Write `path` through a temporary file and a rename: a reader sees the old content or the
  new, never a part. A failed write (disk full) raises CheckpointWriteError and leaves the old
  file as it was."""
  tmp = path + ".tmp"
  try:
    with open(tmp, "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except OSError as e:
    try:
      os.remove(tmp)
    except OSError:
      pass
    raise CheckpointWriteError(f"could not write {path}: {describe_os_error(e)}") from None


def save_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  """Write config.json (process 0 of a multi-process run; the others run the same config)."""
  if not distributed.primary():
    return
  os.makedirs(workdir, exist_ok=True)
  write_text_atomic(os.path.join(workdir, CONFIG_FILE), config.to_json(indent=2))


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The run's config.json, in today's layout (`upgrade_layout`)."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    raise CheckpointError(f"no training run in {workdir!r}: {path} not found "
                          "(train first: python train.py --config=sft_sudoku --workdir=DIR)")
  try:
    with open(path) as f:
      return ml_collections.ConfigDict(upgrade_layout(json.load(f)))
  except ValueError as e:
    raise CheckpointError(f"{path} is not valid JSON ({e}); restore it from a copy, or "
                          "start a new --workdir") from None


# Keys of `sdrl.reward` that shape the reward for the stage; its other keys are the task's.
_SHAPING_KEYS = ("step_penalty", "length_penalty")


def upgrade_layout(config: dict) -> dict:
  """A saved config (plain dict, changed in place and returned) with the keys that moved since
  it was written at their new places, so a run written before still restores and resumes with
  the same values:
    * loss.encoder_loss_on_prompt (bool) -> loss.encoder_scope ("prompt_and_target" / "target");
    * the RL task's section: sdrl.prompts, sdrl.reward_fn and sdrl.reward (its verifier keys,
      or a metric name) -> rl.prompts, rl.reward_fn, rl.reward; the shaping keys of
      sdrl.reward -> sdrl.shaping.
  """
  loss = config.get("loss")
  if isinstance(loss, dict) and "encoder_loss_on_prompt" in loss:
    on_prompt = loss.pop("encoder_loss_on_prompt")
    loss.setdefault("encoder_scope", "prompt_and_target" if on_prompt else "target")
  sdrl = config.get("sdrl")
  if isinstance(sdrl, dict) and not ("rl" in config or "shaping" in sdrl):
    rl = {k: sdrl.pop(k) for k in ("prompts", "reward_fn") if k in sdrl}
    reward = sdrl.pop("reward", None)
    if isinstance(reward, dict):
      sdrl["shaping"] = {k: reward.pop(k) for k in _SHAPING_KEYS if k in reward}
    if reward:
      rl["reward"] = reward
    config["rl"] = rl
  return config


# ----------------------------------------------------------------------------- steps


def steps_on_disk(workdir: str) -> list[int]:
  """The finalized checkpoint steps (orbax renames a step's directory to its number once it is
  complete), newest first. Readability is `restore_latest`'s business."""
  directory = checkpoint_dir(workdir)
  if not os.path.isdir(directory):
    return []
  return sorted((int(name) for name in os.listdir(directory)
                 if name.isdigit() and os.path.isdir(os.path.join(directory, name))),
                reverse=True)


def latest_step(workdir: str) -> int | None:
  """The newest finalized step, or None. It may be unreadable: `restore_latest` returns the
  step it actually restored (the newest readable), which is the one a run resumes from."""
  steps = steps_on_disk(workdir)
  return steps[0] if steps else None


# ----------------------------------------------------------------------------- saving


@jax.jit
def _finite_flags(tree):
  """bool per floating leaf: all of its values are finite (a vision tower's clip bounds: not
  NaN; +-inf leaves a linear unclipped). One fused reduction pass."""
  leaves = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  if not leaves:
    return jnp.ones((0,), bool)
  return jnp.stack([jnp.all(~jnp.isnan(x)) if is_clip_bound(_keys(p))
                    else jnp.all(jnp.isfinite(x)) for p, x in leaves])


def _keys(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)


def non_finite_leaves(tree) -> list[str]:
  """Paths of the floating leaves of `tree` that hold a NaN or an inf (one host sync; +-inf
  is a clip bound's legitimate value)."""
  flags = jax.device_get(_finite_flags(tree))
  if flags.all():
    return []
  paths = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
           if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return [p for p, ok in zip(paths, flags) if not ok]


def _workdir_of(mngr) -> str:
  return os.path.dirname(os.fspath(mngr.directory))


def save(mngr: Manager, step: int, state) -> None:
  """Start an asynchronous save of `state` as `step`, once the save before it has finished (at
  most its timeout later).

  Refuses (NonFiniteStateError) a state with any NaN or inf: nothing is written, so the finite
  checkpoints stay, and none is deleted to keep `keep_checkpoints`. Write failures (this one's
  start, or the save before it) end in a CheckpointWriteError naming the last complete step.
  """
  workdir = _workdir_of(mngr)
  bad = non_finite_leaves(state)
  if bad:
    _settle(mngr)
    last = latest_step(workdir)
    raise NonFiniteStateError(
        f"refusing to save step {step}: {len(bad)} arrays hold NaN or inf (first "
        f"{bad[0]}); the run diverged. Last finite checkpoint: "
        + (f"step {last} in {checkpoint_dir(workdir)}" if last is not None else "none"))
  _wait_for_write(mngr)
  began = time.monotonic()
  with write_errors(mngr, step):
    mngr.save(step, args=ocp.args.StandardSave(state))
  mngr.write_started = began  # after a failed start there is no background write to wait for


def check_write(mngr: Manager) -> None:
  """Without waiting: raise the CheckpointWriteError of a background write that failed, or that
  is still going `mngr.timeout_s` (plus TIMEOUT_MARGIN_S) after it started. One lock read while
  a write is in flight, nothing when none is; no device sync."""
  if mngr.write_started is None:
    return
  if not mngr.is_saving_in_progress() or _past_deadline(mngr):
    _wait_for_write(mngr)


def finish(mngr: Manager, failed: BaseException | bool | None = None) -> None:
  """Wait for the pending save (at most its timeout) and close the manager. With `failed` (the
  error already on its way out), a second write error is dropped so the first one is what the
  user sees; if the write hung, that error is marked to end the process without joining
  orbax's stuck threads (errors.leave_threads)."""
  try:
    _wait_for_write(mngr)
    with write_errors(mngr):
      mngr.close()
  except CheckpointWriteError:
    if not failed:
      raise
    if mngr.hung and isinstance(failed, BaseException):
      errors.leave_threads(failed)


def _past_deadline(mngr: Manager) -> bool:
  return time.monotonic() > mngr.write_started + mngr.timeout_s + TIMEOUT_MARGIN_S


def _wait_for_write(mngr: Manager) -> None:
  """Wait for the save in flight, if any, until it ends or its deadline passes; its failure, or
  the deadline, is a CheckpointWriteError."""
  if mngr.write_started is None:
    return
  while mngr.is_saving_in_progress():  # orbax's flag: False once its finalize thread ended
    if _past_deadline(mngr):
      mngr.hung = True
      raise _write_error(mngr, None, _timed_out(mngr))
    time.sleep(WAIT_POLL_S)
  mngr.write_started = None
  with write_errors(mngr):
    mngr.wait_until_finished()  # returns at once: it raises the write's failure, if any


def _timed_out(mngr: Manager) -> str:
  return (f"the write did not finish within checkpoint_timeout_s={mngr.timeout_s:g} s (a hung "
          "or overloaded file system; raise the key if writes are just slow)")


def describe_os_error(e: BaseException) -> str:
  """A short reason for an I/O failure, naming a full disk as such."""
  text = str(e)
  if getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in text or (
      "os_error_code='28'" in text):
    return DISK_FULL
  if isinstance(e, OSError) and e.strerror:
    return e.strerror
  return _short(e)


def _short(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  text = lines[0].split(" See full TensorStore details")[0] if lines else ""
  text = text if len(text) <= ERROR_TEXT_CHARS else text[:ERROR_TEXT_CHARS] + "..."
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _settle(mngr: Manager) -> None:
  """Let the save still in flight finish (or fail, or time out) before naming the last complete
  step."""
  try:
    _wait_for_write(mngr)
  except CheckpointWriteError:  # reported by whoever waits next (the close)
    pass


class write_errors:
  """Turn any failure of an orbax write, or of a file written beside it, into one
  CheckpointWriteError line."""

  def __init__(self, mngr: Manager, step: int | None = None):
    self.mngr, self.step = mngr, step

  def __enter__(self):
    return self

  def __exit__(self, kind, e, tb):
    if e is None or not isinstance(e, Exception) or isinstance(e, CheckpointError):
      return False
    if isinstance(e, TimeoutError):  # orbax's own timeout (its commit futures, its barriers)
      self.mngr.hung = True
      raise _write_error(self.mngr, self.step, _timed_out(self.mngr), str(e)) from None
    raise _write_error(self.mngr, self.step, describe_os_error(e), str(e)) from None


def _write_error(mngr: Manager, step: int | None, reason: str,
                 text: str = "") -> CheckpointWriteError:
  """The one line of a failed write of `step` (else the step whose temporary directory is
  there, named in `text` or on disk): the reason, the last complete step, what to do. A write
  that hung leaves orbax's threads stuck: the error says the process must not wait for them."""
  workdir = _workdir_of(mngr)
  directory = checkpoint_dir(workdir)
  pending = sorted({int(m) for m in re.findall(r"/(\d+)\.orbax-checkpoint-tmp", text)}
                   or {int(n.split(".")[0]) for n in _listdir(directory)
                       if ".orbax-checkpoint-tmp" in n and n.split(".")[0].isdigit()})
  step = pending[-1] if pending else step
  what = f"checkpoint step {step}" if step is not None else "a checkpoint"
  if not mngr.hung:
    _settle(mngr)
  if reason != DISK_FULL:
    # A multi-process save is collective: a peer killed mid-save fails it here ("Connection
    # reset by peer"); the watchdog names the lost peer then, which is the line to print. A
    # full disk is this process's own failure: no peer to wait for.
    distributed.wait_for_lost()
  last = latest_step(workdir)
  error = CheckpointWriteError(
      f"could not write {what} in {directory}: {reason}; the last complete "
      "checkpoint is " + (f"step {last}" if last is not None else "none")
      + "; fix the cause and rerun the same command to resume")
  return errors.leave_threads(error) if mngr.hung else error


def _listdir(path: str) -> list[str]:
  try:
    return os.listdir(path)
  except OSError:
    return []


# ----------------------------------------------------------------------------- restoring


def restore(mngr, step: int, abstract_state):
  """Restore `step` into the structure/dtypes/shardings of `abstract_state`."""
  return mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))


def abstract(tree):
  return jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)


def saved_keys(workdir: str, step: int) -> set[str]:
  """Top-level keys of the state saved at `step` (read from its metadata, no arrays)."""
  from etils import epath  # orbax's path type

  path = epath.Path(os.path.join(checkpoint_dir(workdir), str(step), "default"))
  return set(ocp.PyTreeCheckpointHandler().metadata(path).keys())


def restore_subtree(workdir: str, step: int, target):
  """Only the leaves of `target` (a dict of some of the saved state's top-level keys, as
  ShapeDtypeStructs with shardings) from checkpoint `step`: nothing else is read, e.g. an
  evaluation never touches the optimizer state."""
  path = os.path.join(checkpoint_dir(workdir), str(step), "default")
  restore_args = ocp.checkpoint_utils.construct_restore_args(target)
  return ocp.PyTreeCheckpointer().restore(
      path, args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                        partial_restore=True))


def _key_name(k):
  return getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))


def _shapes(tree) -> dict[tuple, tuple]:
  return {tuple(_key_name(k) for k in path): tuple(getattr(x, "shape", ()))
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _mismatch(workdir: str, step: int, abstract_state) -> str | None:
  """How the saved arrays of `step` differ from `abstract_state`, or None if they match or the
  metadata is unreadable. Damaged metadata also reads as a difference, so this only explains a
  failure; it never decides that a step is intact."""
  path = os.path.join(checkpoint_dir(workdir), str(step), "default")
  try:
    with ocp.StandardCheckpointer() as ckptr:
      meta = ckptr.metadata(path)
    saved = _shapes(getattr(meta, "item_metadata", meta))
  except Exception:  # noqa: BLE001
    return None
  wanted = _shapes(abstract_state)
  name = lambda key: ".".join(map(str, key))
  for key, shape in wanted.items():
    if key in saved and saved[key] != shape:
      return f"array {name(key)} has shape {saved[key]} where the config expects {shape}"
  missing = [key for key in wanted if key not in saved]
  if missing:
    return f"{len(missing)} of the state's {len(wanted)} arrays are missing (first {name(missing[0])})"
  extra = [key for key in saved if key not in wanted]
  if extra:
    return f"it holds {len(extra)} arrays the run's state has not (first {name(extra[0])})"
  return None


def _is_out_of_memory(e: BaseException) -> bool:
  text = str(e).lower()
  return "out of memory" in text or "resource_exhausted: out of" in text


def move_aside(workdir: str, step: int) -> str:
  """Rename a damaged step out of checkpoints/ (orbax no longer sees it); returns its path."""
  target_dir = os.path.join(os.path.abspath(workdir), DAMAGED_DIR)
  stamp = time.strftime("%Y%m%dT%H%M%S")
  target = os.path.join(target_dir, f"{step}-{stamp}")
  n = 1
  while os.path.exists(target):
    n += 1
    target = os.path.join(target_dir, f"{step}-{stamp}-{n}")
  try:
    os.makedirs(target_dir, exist_ok=True)
    os.rename(os.path.join(checkpoint_dir(workdir), str(step)), target)
  except OSError as e:
    raise CheckpointError(f"checkpoint step {step} cannot be read, and moving it to {target} "
                          f"failed ({e.strerror or e}); move it out of {checkpoint_dir(workdir)} "
                          "by hand") from None
  return target


@contextlib.contextmanager
def _quiet_read_failures():
  """While restores are attempted: a failed tensorstore read leaves callbacks that raise into
  closed event loops, each printed as a traceback through sys.unraisablehook (150 of them for
  one missing manifest). They say nothing the one-line warning does not."""
  if os.environ.get("DIFFGEMMA_LIBRARY_LOGS"):
    yield
    return
  hook = sys.unraisablehook
  sys.unraisablehook = lambda unraisable: None
  try:
    yield
  finally:
    gc.collect()  # finalise the failed read's coroutines while the hook is still quiet
    sys.unraisablehook = hook


def restore_latest(workdir: str, abstract_state=None, move_damaged: bool = False,
                   log: Callable[[str], None] = _notice, read=None):
  """(state, step) of the newest readable checkpoint of `workdir`.

  `abstract_state`: the target (ShapeDtypeStructs with shardings), or a function of the step
  giving it; `read(step) -> state` replaces the whole-state restore (e.g. parameters alone).

  A step that cannot be read (truncated or missing files, any orbax/tensorstore read error) is
  skipped for the next older one. Once one restores, each skipped step is reported in one line
  (`log`) and the run continues from the restored one; with `move_damaged` (a trainer, holding
  the workdir's lock) the skipped steps are moved to damaged_checkpoints/ (never deleted), so
  they are neither resumed from nor counted by keep_checkpoints; readers (eval, sampling) leave
  the workdir as it is. Raises CheckpointError (one line, naming every step's problem) if there
  is no checkpoint, or if none can be restored (a damaged run, or a state that does not fit the
  config): nothing is moved then.
  """
  steps = steps_on_disk(workdir)
  directory = checkpoint_dir(workdir)
  if not steps:
    raise CheckpointError(f"no checkpoint in {directory!r} (train first, or check --workdir)")
  failed = []
  for step in steps:
    try:
      with _quiet_read_failures():
        if read is not None:
          state = read(step)
        else:
          with manager(workdir, read_only=True) as mngr:
            target = abstract_state(step) if callable(abstract_state) else abstract_state
            state = restore(mngr, step, target)
    except Exception as e:  # noqa: BLE001 -- orbax and tensorstore raise many kinds
      if _is_out_of_memory(e):
        raise CheckpointError(f"restoring checkpoint step {step} ran out of memory: "
                              f"{_short(e)}") from None
      failed.append((step, _short(e)))  # not `e`: its frames hold the failed read's tasks
      continue
    for bad, reason in failed:
      log(f"warning: checkpoint step {bad} in {directory} cannot be read ({reason})")
      if move_damaged and distributed.primary():  # one process moves, the others skip too
        log(f"moved damaged checkpoint step {bad} to {move_aside(workdir, bad)}")
    if failed:
      log(f"using checkpoint step {step}, the newest readable one")
    return state, step
  with _quiet_read_failures():
    explain = lambda step: (None if abstract_state is None or callable(abstract_state)
                            else _mismatch(workdir, step, abstract_state))
    reasons = "; ".join(f"step {step}: {explain(step) or reason}" for step, reason in failed)
  raise CheckpointError(
      f"no checkpoint in {directory} can be restored ({reasons}); nothing was moved. If the "
      "config differs from the run's, use the run's; if the files are damaged, move them aside "
      "or use another --workdir")
