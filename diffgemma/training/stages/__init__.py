"""Training stages by name: `config.stage` picks the module whose class feeds the update step.

The interface is `diffgemma.training.stages.base.Stage`. Only this registry names a stage
module; the loop and --dry_run receive a stage from `make_stage`.
"""

from __future__ import annotations

import importlib

import ml_collections

from diffgemma.training.stages.base import Stage

# name -> (module, class name).
STAGES = {"sft": ("diffgemma.training.stages.sft", "SftStage"),
          "sdrl": ("diffgemma.training.stages.sdrl", "SdrlStage")}


def stage_name(config: ml_collections.ConfigDict) -> str:
  """`config.stage`; a config saved before that key existed is SD·RL when it has an `sdrl`
  section, else SFT. A section named after another stage is an error (its settings would be
  ignored silently)."""
  name = config.get("stage") or ("sdrl" if "sdrl" in config else "sft")
  if name not in STAGES:
    raise ValueError(f"unknown stage {name!r}; choose one of {tuple(STAGES)}")
  other = [s for s in STAGES if s != name and s in config]
  if other:
    raise ValueError(f"the config has a {other[0]!r} section but stage={name!r}; set "
                     f"--config.stage={other[0]} or drop the section")
  return name


def stage_class(config: ml_collections.ConfigDict) -> type[Stage]:
  return _registered(stage_name(config))


def _registered(name: str) -> type[Stage]:
  module, cls = STAGES[name]
  return getattr(importlib.import_module(module), cls)


def stage_settings(config: ml_collections.ConfigDict) -> dict:
  """{"stage": name, "stage_settings": the stage's typed section}: the stage's part of
  `training.run_config.build` (ValueError, one line, if its section is bad)."""
  name = stage_name(config)
  return {"stage": name, "stage_settings": _registered(name).settings(config)}


def make_stage(task, setup) -> Stage:
  """The run's stage (`setup.run.stage`), built from its typed settings, task and setup."""
  return _registered(setup.run.stage)(setup.run.stage_settings, task, setup)


__all__ = ["STAGES", "Stage", "make_stage", "stage_class", "stage_name", "stage_settings"]
