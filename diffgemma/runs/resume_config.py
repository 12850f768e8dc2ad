"""Resuming changes nothing silently: the requested config against the run's saved one.

Rerunning `train.py` on an existing workdir compares the config it was given (config file plus
command-line overrides) with the run's `config.json`:
  * keys that only say how long to run, how often to log, evaluate or checkpoint, how to
    evaluate, or how to lay the same computation onto the hardware (SAFE_KEYS) take the new
    value; each change is printed and appended to `config_history.json` with the step it took
    effect;
  * any other difference (architecture, data, task, loss, optimizer, seed, batch...) is an
    error naming every differing key, and nothing is changed;
  * the architecture of a run started from `--init_from` is the checkpoint's, not the config
    file's: those keys count only when the user set them on the command line;
  * keys missing from the request (e.g. `init_from`, written by the trainer) keep the saved
    value; keys the saved config lacks (added to the code after the run started) are adopted
    and logged.

`num_train_steps` is safe in this sense (the data stream does not depend on it: batch s is
always the same puzzles), but a cosine schedule spans the run's length, so a new length changes
the learning rate of every step after the resume; `reconcile` says so in the change's note.
A resumed run is then no longer bitwise equal to an uninterrupted run of either length.
`num_train_steps=0` ("fit the budget", `training.budget`) asks for no change: the run keeps the
count it fitted and saved when it started.
"""

from __future__ import annotations

import dataclasses
import datetime
import fnmatch
import json
import os
import sys
from typing import Any, Collection

import ml_collections

from diffgemma import errors

HISTORY_FILE = "config_history.json"

# fnmatch patterns of dotted config keys that may change on resume.
SAFE_KEYS = (
    "num_train_steps",  # longer or shorter run (see the module docstring: the LR schedule)
    "max_train_minutes", "log_every", "checkpoint_every", "keep_checkpoints",
    "checkpoint_timeout_s",
    "eval.*",  # cadence, size and batch of the periodic evaluation
    "sampler.*",  # the evaluation sampler (SD·RL's rollouts use sdrl.rollout_sampler)
    "data.num_threads", "data.prefetch",  # loader parallelism: the same batches
    "device_memory_gib",  # the --dry_run budget
    "grad_accum_steps",  # memory knob: micro-batches average to the batch's gradient
    "sharding.*",  # mesh layout: the same computation on other devices
    # Numerics that compute the same function (not the dtypes: they change the state).
    "model.moe_impl", "model.moe_tile_size", "model.attention_impl", "model.remat",
)


class ResumeConfigError(errors.ConfigError):
  """The requested config changes keys that cannot change on resume. One-line message."""


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """{dotted key: leaf} of nested dicts; tuples become lists (as config.json holds them); an
  empty dict is a leaf."""
  if isinstance(tree, ml_collections.ConfigDict):
    tree = tree.to_dict()
  if isinstance(tree, dict) and tree:
    out = {}
    for key, value in tree.items():
      out.update(flatten(value, f"{prefix}{key}."))
    return out
  return {prefix[:-1]: _normal(tree)}


def _normal(value):
  if isinstance(value, (tuple, list)):
    return [_normal(v) for v in value]
  if isinstance(value, dict):
    return {k: _normal(v) for k, v in value.items()}
  return value  # 1000.0 == 1000 already


def canonical(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """flatten(config) with the model section as ModelConfig resolves it, and layer_types empty
  when it is the default pattern of num_layers: equal models compare equal however written, and
  a new num_layers is not also reported as a new layer_types."""
  tree = config.to_dict()
  if isinstance(tree.get("model"), dict):
    from diffgemma.model.config import ModelConfig, default_layer_types  # local: keep this light

    try:
      model = dataclasses.asdict(ModelConfig(**tree["model"]))
    except (TypeError, ValueError):
      model = None  # not a model this code can build: compare as written
    if model is not None:
      if tuple(model["layer_types"]) == default_layer_types(model["num_layers"]):
        model["layer_types"] = []
      tree["model"] = model
  return flatten(tree)


def is_safe(key: str) -> bool:
  return any(fnmatch.fnmatchcase(key, pattern) for pattern in SAFE_KEYS)


def _architecture_keys(saved: dict) -> set[str]:
  from diffgemma.model.config import NUMERICS_FIELDS  # local: config is light, but keep this pure

  return {k for k in saved if k.startswith("model.") and k[len("model."):] not in NUMERICS_FIELDS}


def _show(value) -> str:
  text = json.dumps(value)
  return text if len(text) <= 40 else text[:37] + "..."


def reconcile(saved: ml_collections.ConfigDict, requested: ml_collections.ConfigDict,
              overridden: Collection[str] | None = None, workdir: str = "the workdir"
              ) -> tuple[ml_collections.ConfigDict, dict[str, list]]:
  """(config to resume with, {key: [old, new]} of the changes applied). Pure.

  `overridden`: the dotted keys set on the command line (None: unknown). They matter only for
  the architecture of a run started from a checkpoint (`init_from` in the saved config), whose
  values come from that checkpoint rather than from the config file. Raises ResumeConfigError
  (one line) listing every key that differs but may not change.
  """
  old, new = canonical(saved), canonical(requested)
  adopted = _architecture_keys(old) if saved.get("init_from") else set()
  explicit = set(overridden or ())
  changes, refused = {}, []
  for key in sorted(set(old) | set(new)):
    if key not in new:
      continue  # written by the trainer, or dropped from the config file: the run's value
    if key in old and old[key] == new[key]:
      continue
    if key == "num_train_steps" and new[key] == 0 and key in old:
      continue  # "fit the budget": the count the run fitted when it started
    if key in adopted and key not in explicit:
      continue  # the architecture came from --init_from's checkpoint
    if key not in old or is_safe(key):
      changes[key] = [old.get(key), new[key]]
    else:
      refused.append(key)
  if refused:
    listed = ", ".join(f"{k} (run: {_show(old[k])}, requested: {_show(new[k])})"
                       for k in refused)
    raise ResumeConfigError(
        f"cannot resume {workdir} with a different {_plural(refused)}: {listed}; rerun with the "
        "run's values (see its config.json), or start a new --workdir")
  merged = ml_collections.ConfigDict(saved.to_dict())
  with merged.unlocked():
    for key, (_, value) in changes.items():
      _set(merged, key, value)
  return merged, changes


def _plural(keys) -> str:
  return "value for a key that cannot change on resume" if len(keys) == 1 else (
      f"value for {len(keys)} keys that cannot change on resume")


def _set(config: ml_collections.ConfigDict, dotted: str, value) -> None:
  *parents, leaf = dotted.split(".")
  node = config
  for name in parents:
    if name not in node:
      node[name] = ml_collections.ConfigDict()
    node = node[name]
  node[leaf] = value


def describe(changes: dict[str, list], config: ml_collections.ConfigDict) -> list[str]:
  """One phrase per applied change, for the log."""
  lines = []
  for key, (old, new) in changes.items():
    line = f"{key}: {_show(old)} -> {_show(new)}"
    if key == "num_train_steps" and config.get("optimizer", {}).get("schedule") == "cosine":
      line += " (the cosine learning-rate schedule now spans the new length)"
    if old is None:
      line += " (key not in the run's saved config)"
    lines.append(line)
  return lines


def history(workdir: str) -> list[dict]:
  """The run's recorded resume changes, oldest first ([] if none); ValueError (one line) when
  the file is not a JSON list."""
  path = os.path.join(workdir, HISTORY_FILE)
  if not os.path.exists(path):
    return []
  try:
    with open(path) as f:
      entries = json.load(f)
  except ValueError:
    entries = None
  if not isinstance(entries, list):
    raise ValueError(f"{path} is not a JSON list of resume changes")
  return entries


def record(workdir: str, step: int, changes: dict[str, list]) -> None:
  """Append {step, time, changes} to config_history.json (atomically, like config.json). A
  damaged history (not a JSON list: edited by hand, a full disk) is kept beside it, renamed,
  and a new one starts: nothing already written is lost, and the run goes on."""
  from diffgemma.runs import checkpointing, distributed  # local: `reconcile` needs no orbax

  if not distributed.primary():  # a multi-process run's files are process 0's
    return
  path = os.path.join(workdir, HISTORY_FILE)
  try:
    previous = history(workdir)
  except ValueError as e:
    kept = f"{path}.damaged-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S-%f')}"
    os.replace(path, kept)
    print(f"warning: {e}; kept as {os.path.basename(kept)}, a new history starts",
          file=sys.stderr)
    previous = []
  entries = previous + [{
      "step": int(step),
      "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
      "changes": {k: {"old": old, "new": new} for k, (old, new) in changes.items()}}]
  checkpointing.write_text_atomic(path, json.dumps(entries, indent=2) + "\n")

