"""A run's ConfigDict as one typed, frozen `RunConfig`, and the checks before anything is written.

The entry points (train.py through `training.loop.prepare_config`, `--dry_run`, eval.py and
sample.py through `training.loaded`) call `build` once; everything below them takes the typed
sections it needs: the model (`ModelConfig`), the objective (`LossConfig`), the evaluation
sampler, the optimizer, LoRA, QLoRA's quantization, sharding, the loop's knobs (`TrainConfig`),
the periodic evaluation (`EvalConfig`) and the stage's own typed section. The task's sections
(`task`, `data` and its `eval` keys) are typed by the task itself when `tasks.make_task` builds
it, at the same entry point.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections

from diffgemma.model import fields, lora, quantize, sharding
from diffgemma.model.config import DTYPES, ModelConfig
from diffgemma.runs import checkpointing
from diffgemma.sampling import sampler
from diffgemma.training import budget, losses, optimizer

NONFINITE_POLICIES = ("stop", "skip")
# Every integer key (sizes, counts, steps, seeds) ends up in a 32-bit JAX or numpy integer; a
# larger one fails deep inside numpy or XLA with a traceback instead of naming the key.
INT_LIMIT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """The training loop's knobs (top-level keys of a config).

  checkpoint_timeout_s: the longest a checkpoint's background write may take (seconds): past
    it the run ends in one line naming the step (runs.checkpointing.DEFAULT_TIMEOUT_S says why
    the default is what it is).
  on_nonfinite: "stop" ends the run at the first step whose loss or gradient norm is not
    finite (nothing of it is applied or saved); "skip" leaves the parameters and optimizer state
    of such a step unchanged and goes on, at most `max_nonfinite_skips` times in a run.
  """

  seed: int = 0
  num_train_steps: int = 1000  # 0: fitted to max_train_minutes when the run starts
  min_useful_steps: int = 0  # with num_train_steps=0: fewer fitted steps are warned about
  batch_size: int = 16
  grad_accum_steps: int = 1
  max_train_minutes: float = 0.0
  log_every: int = 20
  checkpoint_every: int = 250
  keep_checkpoints: int = 2
  checkpoint_timeout_s: float = checkpointing.DEFAULT_TIMEOUT_S
  freeze_router: bool = False
  # A model with a vision tower: full fine-tuning leaves it and its embedder unchanged (LoRA
  # adapts them only where lora.targets name them).
  freeze_vision: bool = True
  on_nonfinite: str = "stop"
  max_nonfinite_skips: int = 10
  device_memory_gib: float = 80.0
  # Written by the loop of a num_train_steps=0 run (`training.budget`): [step, count] of each fit
  # decision, the calibration first; num_train_steps is the count in effect.
  fitted_schedule: tuple = ()

  def __post_init__(self):
    fields.check_types(self, "")
    try:
      decisions = tuple((int(step), int(count)) for step, count in self.fitted_schedule)
    except (TypeError, ValueError):
      raise ValueError(f"fitted_schedule must hold [step, count] pairs (it is written by the "
                       f"training loop), got {self.fitted_schedule!r}") from None
    object.__setattr__(self, "fitted_schedule", decisions)  # hashable, as config.json's lists
    if self.seed < 0:
      raise ValueError(f"seed must be >= 0, got {self.seed}")
    for name in ("batch_size", "grad_accum_steps", "log_every", "checkpoint_every",
                 "keep_checkpoints"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.num_train_steps < 0:
      raise ValueError(f"num_train_steps must be >= 1, or 0 to fit max_train_minutes; got "
                       f"{self.num_train_steps}")
    if self.num_train_steps == 0 and self.max_train_minutes <= 0:
      raise ValueError("num_train_steps=0 fits the schedule to max_train_minutes: set "
                       "max_train_minutes > 0, or an explicit num_train_steps")
    if self.min_useful_steps < 0:
      raise ValueError(f"min_useful_steps must be >= 0, got {self.min_useful_steps}")
    if self.batch_size % self.grad_accum_steps:
      raise ValueError(f"grad_accum_steps={self.grad_accum_steps} does not divide "
                       f"batch_size={self.batch_size}")
    if self.max_train_minutes < 0:
      raise ValueError(f"max_train_minutes must be >= 0 (0 = no limit), got "
                       f"{self.max_train_minutes}")
    if self.on_nonfinite not in NONFINITE_POLICIES:
      raise ValueError(f"unknown on_nonfinite {self.on_nonfinite!r}; choose one of "
                       f"{NONFINITE_POLICIES}")
    if not 0 < self.checkpoint_timeout_s < math.inf:
      raise ValueError(f"checkpoint_timeout_s must be a positive number of seconds, got "
                       f"{self.checkpoint_timeout_s}")
    if self.max_nonfinite_skips < 0:
      raise ValueError(f"max_nonfinite_skips must be >= 0, got {self.max_nonfinite_skips}")
    if self.device_memory_gib <= 0:
      raise ValueError(f"device_memory_gib must be positive, got {self.device_memory_gib}")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """The loop's periodic held-out evaluation (generic keys of section `eval`; the task reads
  its own keys of that section).

  every_steps: evaluate every N steps (and at the end); 0 = never.
  batch_size: rows per sampler call.
  trace_examples: denoising traces of the first N held-out examples written to TensorBoard.
  """

  every_steps: int = 0
  batch_size: int = 16
  trace_examples: int = 0

  def __post_init__(self):
    fields.check_types(self, "eval.")
    for name in ("every_steps", "trace_examples"):
      if getattr(self, name) < 0:
        raise ValueError(f"eval.{name} must be >= 0, got {getattr(self, name)}")
    if self.batch_size < 1:
      raise ValueError(f"eval.batch_size must be >= 1, got {self.batch_size}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A run's whole config, typed and frozen (built once by `build`).

  sampler: the evaluation sampler as configured; the task's stop ids are added where the task
    is known (`sampler.SamplerConfig.with_stops`).
  stage / stage_settings: the stage's registry name and its typed section (None for SFT; see
    `training.stages`).
  init_from: the checkpoint a new run starts from (absolute), or None.
  """

  train: TrainConfig
  model: ModelConfig
  loss: losses.LossConfig
  sampler: sampler.SamplerConfig
  optimizer: optimizer.OptimizerConfig
  lora: lora.LoraConfig
  quantize: quantize.QuantizeConfig | None
  sharding: sharding.ShardingConfig
  eval: EvalConfig
  stage: str = "sft"
  stage_settings: Any = None
  init_from: str | None = None

  def __post_init__(self):
    """The checks across sections (each section checks its own fields)."""
    steps = self.train.num_train_steps
    if steps != budget.FIT and self.optimizer.warmup_steps > steps:
      raise ValueError(f"optimizer.warmup_steps={self.optimizer.warmup_steps} exceeds "
                       f"num_train_steps={steps}: the run would end before the learning rate "
                       "reaches optimizer.lr")
    if steps == budget.FIT:
      if self.stage != "sft":
        raise ValueError(f"num_train_steps=0 (fit the budget) is for SFT runs; the {self.stage} "
                         "stage needs an explicit num_train_steps")
      if self.optimizer.warmup_steps < budget.MIN_TIMED_STEPS + 1:
        raise ValueError(f"num_train_steps=0 times the first steps inside the warmup: set "
                         f"optimizer.warmup_steps >= {budget.MIN_TIMED_STEPS + 1}, or an "
                         "explicit num_train_steps")
    # int8 / int4: QLoRA, the frozen base quantized (diffgemma/model/quantize.py).
    if self.lora.base_dtype not in DTYPES + tuple(quantize.QTYPES):
      raise ValueError(f"unknown lora.base_dtype {self.lora.base_dtype!r}; choose one of "
                       f"{DTYPES + tuple(quantize.QTYPES)}")


def build(config: ml_collections.ConfigDict, stage: str = "sft",
          stage_settings: Any = None) -> RunConfig:
  """The one conversion of a run's ConfigDict: every generic section checked and typed.

  Raises ValueError / TypeError / KeyError with a one-line message (the entry points prefix it
  with "bad config:"): each section checks its own fields, `RunConfig` the ones across
  sections. `stage` and `stage_settings` come from the stage registry
  (`training.stages.stage_settings`), which sits above this module.
  """
  check_integer_range(config.to_dict())
  lora_cfg = _lora_config(config)
  return RunConfig(
      train=_train_config(config), model=_model_config(config), loss=_loss_config(config),
      sampler=sampler.SamplerConfig(**config.sampler.to_dict()),
      optimizer=optimizer.OptimizerConfig(**config.optimizer.to_dict()),
      lora=lora_cfg, quantize=_quantize_config(config, lora_cfg),
      sharding=_sharding_config(config), eval=_eval_config(config), stage=stage,
      stage_settings=stage_settings, init_from=config.get("init_from") or None)


def check_integer_range(tree: dict, prefix: str = "") -> None:
  """ValueError naming the first integer of the nested dict `tree` (or of a tuple in it)
  outside +-INT_LIMIT. Walks the tree itself: `runs.resume_config.flatten` sits a layer above."""
  for key, value in tree.items():
    if isinstance(value, dict):
      check_integer_range(value, f"{prefix}{key}.")
      continue
    for item in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(item, int) and not isinstance(item, bool) and abs(item) > INT_LIMIT:
        raise ValueError(f"{prefix}{key}={value!r} is outside the 32-bit integer range "
                         f"(|value| <= {INT_LIMIT}) that sizes, steps and seeds are held in")


def _eval_config(config: ml_collections.ConfigDict) -> EvalConfig:
  section = config.get("eval") or {}
  fields = {f.name for f in dataclasses.fields(EvalConfig)}
  return EvalConfig(**{k: section[k] for k in fields if k in section})


def _train_config(config: ml_collections.ConfigDict) -> TrainConfig:
  fields = {f.name for f in dataclasses.fields(TrainConfig)}
  return TrainConfig(**{k: config[k] for k in fields if k in config})


def _model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  return ModelConfig(**config.model.to_dict())


def _loss_config(config: ml_collections.ConfigDict) -> losses.LossConfig:
  return losses.LossConfig(**config.loss.to_dict())


def _lora_config(config: ml_collections.ConfigDict) -> lora.LoraConfig:
  section = config.lora.to_dict() if "lora" in config else None
  return lora.run_lora_config(section, config.get("freeze_router", False))


def _quantize_config(config: ml_collections.ConfigDict,
                     lora_cfg: lora.LoraConfig) -> quantize.QuantizeConfig | None:
  """A QLoRA run's base quantization: lora.base_dtype "int8" / "int4", refined by an optional
  `quantize` section (quantize.QuantizeConfig fields but dtype); None for any other run."""
  if not lora_cfg.enabled or lora_cfg.base_dtype not in quantize.QTYPES:
    return None
  fields = config.quantize.to_dict() if "quantize" in config else {}
  return quantize.QuantizeConfig(dtype=lora_cfg.base_dtype, **fields)


def _sharding_config(config: ml_collections.ConfigDict) -> sharding.ShardingConfig:
  if "sharding" not in config:
    return sharding.ShardingConfig()
  fields = config.sharding.to_dict()
  return sharding.ShardingConfig(**{**fields, "rules": dict(fields.get("rules", {}))})

