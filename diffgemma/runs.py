"""Loading a finished (or running) training run for evaluation and sampling."""

from __future__ import annotations

import dataclasses

import jax
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
  """Config and latest parameters of a workdir (CheckpointError if there is none)."""
  config = checkpointing.load_config(workdir)
  model_cfg = trainer.model_config(config)
  tx, _ = trainer.make_optimizer(config)
  abstract_state = jax.eval_shape(lambda: trainer.init_state(config, model_cfg, tx))
  step, state = checkpointing.restore_latest(workdir, abstract_state)
  return Run(config, model_cfg, _sampler(config, sampler_overrides), state["params"], int(step))


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
