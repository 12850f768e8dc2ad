"""Loading a finished (or running) training run for evaluation and sampling."""

from __future__ import annotations

import dataclasses

import ml_collections

from diffgemma import checkpointing, trainer


@dataclasses.dataclass
class Run:
  config: object
  model_cfg: object
  sampler_cfg: object
  params: dict
  step: int


def load_run(workdir: str, **sampler_overrides) -> Run:
  """Config and latest parameters of a workdir (CheckpointError if there is none); a LoRA run's
  adapters come merged into its base."""
  config, model_cfg, params, step = trainer.restore_params(workdir)
  return Run(config, model_cfg, _sampler(config, sampler_overrides), params, step)


def load_checkpoint_as_run(init_from: str, config, **sampler_overrides) -> Run:
  """A model checkpoint directory (transformers, orbax or workdir) evaluated under `config`'s
  task and sampler settings; the architecture comes from the checkpoint (step 0)."""
  config = ml_collections.ConfigDict(config.to_dict())
  params = trainer.load_initial_params(config, init_from)
  try:
    trainer.validate_config(config)  # e.g. the checkpoint's vocabulary against the task's
  except (KeyError, TypeError, ValueError) as e:
    raise checkpointing.CheckpointError(f"{init_from} does not fit the config: {e}") from None
  return Run(config, trainer.model_config(config), _sampler(config, sampler_overrides), params, 0)


def _sampler(config, overrides):
  sampler_cfg = trainer.sampler_config(config)
  return dataclasses.replace(sampler_cfg, **overrides) if overrides else sampler_cfg
