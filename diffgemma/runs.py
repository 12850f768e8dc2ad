"""Loading a finished (or running) training run for evaluation and sampling."""

from __future__ import annotations

import dataclasses

import jax

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
  sampler_cfg = trainer.sampler_config(config)
  if sampler_overrides:
    sampler_cfg = dataclasses.replace(sampler_cfg, **sampler_overrides)
  return Run(config, model_cfg, sampler_cfg, state["params"], int(step))
