"""A run's ConfigDict as typed configs, and the checks that run before anything is written.

Every section a generic module reads becomes a frozen dataclass here, once: the model
(`ModelConfig`), the objective (`LossConfig`), the sampler, the optimizer, LoRA, sharding and
the loop's own knobs (`TrainConfig`). Task sections (`task`, `data`, `eval`) are checked by the
task itself (`diffgemma.tasks.make_task`).
"""

from __future__ import annotations

import dataclasses

import ml_collections

from diffgemma.model import lora, quantize, sharding
from diffgemma.model.config import ModelConfig
from diffgemma.runs import validation
from diffgemma.sampling import sampler
from diffgemma.training import losses, optimizer

NONFINITE_POLICIES = ("stop", "skip")
# Loss keys of configs written before `encoder_scope` existed.
_LEGACY_LOSS_KEYS = ("encoder_loss_on_prompt",)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The training loop's knobs (top-level keys of a config).

  on_nonfinite: "stop" ends the run at the first step whose loss or gradient norm is not
    finite (nothing of it is applied or saved); "skip" leaves the parameters and optimizer state
    of such a step unchanged and goes on, at most `max_nonfinite_skips` times in a run.
  """

  seed: int = 0
  num_train_steps: int = 1000
  batch_size: int = 16
  grad_accum_steps: int = 1
  max_train_minutes: float = 0.0
  log_every: int = 20
  checkpoint_every: int = 250
  keep_checkpoints: int = 2
  freeze_router: bool = False
  on_nonfinite: str = "stop"
  max_nonfinite_skips: int = 10
  device_memory_gib: float = 80.0

  def __post_init__(self):
    for name in ("num_train_steps", "batch_size", "grad_accum_steps", "log_every",
                 "checkpoint_every", "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.batch_size % self.grad_accum_steps:
      raise ValueError(f"grad_accum_steps={self.grad_accum_steps} does not divide "
                       f"batch_size={self.batch_size}")
    if self.max_train_minutes < 0:
      raise ValueError(f"max_train_minutes must be >= 0 (0 = no limit), got "
                       f"{self.max_train_minutes}")
    if self.on_nonfinite not in NONFINITE_POLICIES:
      raise ValueError(f"unknown on_nonfinite {self.on_nonfinite!r}; choose one of "
                       f"{NONFINITE_POLICIES}")
    if self.max_nonfinite_skips < 0:
      raise ValueError(f"max_nonfinite_skips must be >= 0, got {self.max_nonfinite_skips}")
    if self.device_memory_gib <= 0:
      raise ValueError(f"device_memory_gib must be positive, got {self.device_memory_gib}")


def train_config(config: ml_collections.ConfigDict) -> TrainConfig:
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  return TrainConfig(**{k: config[k] for k in fields if k in config})


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  return ModelConfig(**config.model.to_dict())


def loss_config(config: ml_collections.ConfigDict) -> losses.LossConfig:
  fields = dict(config.loss.to_dict())
  on_prompt = fields.pop("encoder_loss_on_prompt", None)
  if on_prompt is not None and "encoder_scope" not in fields:
    fields["encoder_scope"] = "prompt_and_target" if on_prompt else "target"
  return losses.LossConfig(**fields)


def sampler_config(config: ml_collections.ConfigDict, stop_token_ids=()) -> sampler.SamplerConfig:
  """The evaluation sampler (section `sampler`), ending rows also at the task's stop ids."""
  cfg = sampler.SamplerConfig(**config.sampler.to_dict())
  stops = tuple(dict.fromkeys(tuple(cfg.stop_token_ids) + tuple(stop_token_ids)))
  return cfg.replace(stop_token_ids=stops)


def optimizer_config(config: ml_collections.ConfigDict) -> optimizer.OptimizerConfig:
  return optimizer.OptimizerConfig(**config.optimizer.to_dict())


def lora_config(config: ml_collections.ConfigDict) -> lora.LoraConfig:
  """The run's LoRA settings (disabled for configs written before LoRA existed)."""
  if "lora" not in config:
    return lora.LoraConfig()
  cfg = lora.LoraConfig(**config.lora.to_dict())
  if cfg.enabled and config.get("freeze_router", False):
    cfg = dataclasses.replace(
        cfg, targets=tuple(t for t in cfg.targets if t != lora.ROUTER_PATTERN))
  return cfg


def quantize_config(config: ml_collections.ConfigDict) -> quantize.QuantizeConfig | None:
  """A QLoRA run's base quantization: lora.base_dtype "int8" / "int4", refined by an optional
  `quantize` section (quantize.QuantizeConfig fields but dtype); None for any other run."""
  lora_cfg = lora_config(config)
  if not lora_cfg.enabled or lora_cfg.base_dtype not in quantize.QTYPES:
    return None
  fields = config.quantize.to_dict() if "quantize" in config else {}
  return quantize.QuantizeConfig(dtype=lora_cfg.base_dtype, **fields)


def sharding_config(config: ml_collections.ConfigDict) -> sharding.ShardingConfig:
  if "sharding" not in config:
    return sharding.ShardingConfig()
  fields = config.sharding.to_dict()
  return sharding.ShardingConfig(**{**fields, "rules": dict(fields.get("rules", {}))})


def validate(config: ml_collections.ConfigDict) -> None:
  """Build every generic typed piece once, so a bad value fails before any work starts.

  Raises ValueError / TypeError / KeyError with a one-line message (train.py prefixes it with
  "bad config:"). The task's sections are checked by `make_task`.
  """
  validation.validate_run_config(config)
  train = train_config(config)
  model_config(config), loss_config(config), sampler_config(config)
  optimizer_config(config), lora_config(config), sharding_config(config)
  quantize_config(config)
  del train
