"""Orbax checkpoints of the training state, plus the run's config stored beside them.

Layout of a workdir: config.json (the full ConfigDict of the run), checkpoints/<step>/ (orbax,
written to a temporary directory and renamed, so an interrupted save never corrupts the last
good checkpoint), tensorboard/ (event files).
"""

from __future__ import annotations

import json
import os

import jax
import ml_collections
import orbax.checkpoint as ocp


class CheckpointError(FileNotFoundError):
  """No usable checkpoint where one was expected. One-line message."""

  def __str__(self):
    return str(self.args[0])


def checkpoint_dir(workdir: str) -> str:
  return os.path.join(os.path.abspath(workdir), "checkpoints")


def manager(workdir: str, keep: int | None = None, read_only: bool = False):
  options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                         read_only=read_only)
  return ocp.CheckpointManager(checkpoint_dir(workdir), options=options)


def save_config(workdir: str, config: ml_collections.ConfigDict) -> None:
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "config.json")
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.write(config.to_json(indent=2))
  os.replace(tmp, path)


def load_config(workdir: str) -> ml_collections.ConfigDict:
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise CheckpointError(f"no training run in {workdir!r}: {path} not found "
                          "(train first: python train.py --config=sft_sudoku --workdir=DIR)")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def latest_step(workdir: str) -> int | None:
  if not os.path.isdir(checkpoint_dir(workdir)):
    return None
  with manager(workdir, read_only=True) as mngr:
    return mngr.latest_step()


def save(mngr, step: int, state) -> None:
  mngr.save(step, args=ocp.args.StandardSave(state))


def restore(mngr, step: int, abstract_state):
  """Restore `step` into the structure/dtypes/shardings of `abstract_state`."""
  return mngr.restore(step, args=ocp.args.StandardRestore(abstract_state))


def abstract(tree):
  return jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)


def saved_keys(mngr, step: int) -> set[str]:
  """Top-level keys of the state saved at `step` (read from its metadata, no arrays)."""
  from etils import epath  # orbax's path type

  path = epath.Path(os.path.join(str(mngr.directory), str(step), "default"))
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
