"""Every generic run-config value checked up front: types, ranges, enums, consistency.

`validate_run_config(config)` is pure and runs before anything is written (no workdir, no
config.json): a bad value raises ValueError with one line naming the key, the value and what
is allowed. Keys a config does not have are skipped (older runs, SFT vs SD·RL sections); the
task's own sections (`data`, most of `eval`) are checked by the task. The typed dataclasses (ModelConfig, SamplerConfig, LoraConfig, ...) keep their own checks; these
are the ones they lack, and the ones that would otherwise fail mid-run (a zero batch in the
data loader, a ZeroDivisionError in ModelConfig, a schedule name read only when traced).
"""

from __future__ import annotations

import math
import ml_collections

from diffgemma.model import quantize
from diffgemma.sampling import sampler
from diffgemma.training import diffusion, losses

DTYPES = ("float32", "bfloat16", "float16")
SCHEDULES = ("cosine", "constant")
_MISSING = object()


def _get(config, dotted: str):
  node = config
  for name in dotted.split("."):
    if not isinstance(node, (ml_collections.ConfigDict, dict)) or name not in node:
      return _MISSING
    node = node[name]
  return node


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
  return (isinstance(value, (int, float)) and not isinstance(value, bool)
          and math.isfinite(value))


def _check_int(config, key: str, low: int | None = None, high: int | None = None) -> None:
  value = _get(config, key)
  if value is _MISSING:
    return
  if not _is_int(value):
    raise ValueError(f"{key} must be an integer, got {value!r}")
  if low is not None and value < low:
    raise ValueError(f"{key} must be >= {low}, got {value}")
  if high is not None and value > high:
    raise ValueError(f"{key} must be <= {high}, got {value}")


def _check_float(config, key: str, low: float | None = None, high: float | None = None,
                 low_open: bool = False, high_open: bool = False) -> None:
  value = _get(config, key)
  if value is _MISSING:
    return
  if not _is_number(value):
    raise ValueError(f"{key} must be a finite number, got {value!r}")
  if low is not None and (value <= low if low_open else value < low):
    raise ValueError(f"{key} must be {'>' if low_open else '>='} {low}, got {value}")
  if high is not None and (value >= high if high_open else value > high):
    raise ValueError(f"{key} must be {'<' if high_open else '<='} {high}, got {value}")


def _check_choice(config, key: str, choices: tuple) -> None:
  value = _get(config, key)
  if value is not _MISSING and value not in choices:
    raise ValueError(f"unknown {key} {value!r}; choose one of {', '.join(map(repr, choices))}")


def _check_bool(config, key: str) -> None:
  value = _get(config, key)
  if value is not _MISSING and not isinstance(value, bool):
    raise ValueError(f"{key} must be True or False, got {value!r}")


# Integer keys and their lower bounds.
_RUN_INTS = {
    "seed": 0, "num_train_steps": 0, "batch_size": 1, "log_every": 1, "checkpoint_every": 1,
    "keep_checkpoints": 1, "grad_accum_steps": 1,
    "eval.every_steps": 0, "eval.batch_size": 1,
    "sampler.max_denoising_steps": 1, "sampler.stability_threshold": 0,
    "sampler.max_new_tokens": 1, "sampler.top_k": 0,
    "lora.rank": 1,
}
_MODEL_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim", "global_head_dim", "num_global_kv_heads", "sliding_window", "num_experts",
    "top_k_experts", "moe_intermediate_size", "canvas_length", "moe_tile_size")


def _check_run(config) -> None:
  for key, low in _RUN_INTS.items():
    _check_int(config, key, low)
  _check_float(config, "max_train_minutes", 0.0)
  _check_float(config, "device_memory_gib", 0.0, low_open=True)
  for key in ("freeze_router", "lora.enabled", "lora.save_base", "sampler.fused_step"):
    _check_bool(config, key)
  batch, accum = _get(config, "batch_size"), _get(config, "grad_accum_steps")
  if accum is not _MISSING and batch % accum:
    raise ValueError(f"grad_accum_steps={accum} does not divide batch_size={batch}")


def _check_optimizer(config) -> None:
  _check_float(config, "optimizer.lr", 0.0, low_open=True)
  _check_int(config, "optimizer.warmup_steps", 0)
  _check_choice(config, "optimizer.schedule", SCHEDULES)
  _check_float(config, "optimizer.end_lr_fraction", 0.0, 1.0)
  _check_float(config, "optimizer.weight_decay", 0.0)
  _check_float(config, "optimizer.b1", 0.0, 1.0, high_open=True)
  _check_float(config, "optimizer.b2", 0.0, 1.0, high_open=True)
  _check_float(config, "optimizer.grad_clip", 0.0, low_open=True)
  warmup, steps = _get(config, "optimizer.warmup_steps"), _get(config, "num_train_steps")
  if warmup is not _MISSING and steps is not _MISSING and 0 < steps < warmup:
    raise ValueError(f"optimizer.warmup_steps={warmup} exceeds num_train_steps={steps}: the "
                     "run would end before the learning rate reaches optimizer.lr")


def _check_loss(config) -> None:
  for key in ("loss.encoder_weight", "loss.decoder_weight"):
    _check_float(config, key, 0.0)
  _check_float(config, "loss.t_eps", 0.0, 1.0, low_open=True, high_open=True)
  _check_float(config, "loss.self_conditioning_prob", 0.0, 1.0)
  _check_choice(config, "loss.noise_schedule", diffusion.SCHEDULES)
  _check_choice(config, "loss.decoder_weighting", losses.DECODER_WEIGHTINGS)
  _check_choice(config, "loss.normalization", losses.NORMALIZATIONS)
  _check_choice(config, "loss.t_distribution", diffusion.T_DISTRIBUTIONS)
  _check_choice(config, "loss.fill_noise", losses.FILL_NOISES)
  weights = [_get(config, k) for k in ("loss.encoder_weight", "loss.decoder_weight")]
  if _MISSING not in weights and not any(weights):
    raise ValueError("loss.encoder_weight and loss.decoder_weight are both 0: nothing to train")


def _check_model(config) -> None:
  for name in _MODEL_POSITIVE_INTS:
    _check_int(config, f"model.{name}", 1)
  for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
    _check_int(config, f"model.{name}", 0)
    vocab, token = _get(config, "model.vocab_size"), _get(config, f"model.{name}")
    if vocab is not _MISSING and token is not _MISSING and token >= vocab:
      raise ValueError(f"model.{name}={token} is outside the vocabulary (vocab_size={vocab})")
  for name in ("rms_norm_eps", "sliding_rope_theta", "full_rope_theta", "qk_norm_init",
               "initializer_range"):
    _check_float(config, f"model.{name}", 0.0, low_open=True)
  _check_float(config, "model.final_logit_softcap", 0.0)
  _check_float(config, "model.full_rope_partial_factor", 0.0, 1.0, low_open=True)
  for name in ("head_dim", "global_head_dim"):
    value = _get(config, f"model.{name}")
    if value is not _MISSING and value % 2:
      raise ValueError(f"model.{name}={value} must be even (rotary embeddings rotate pairs)")
  for name in ("param_dtype", "compute_dtype"):
    _check_choice(config, f"model.{name}", DTYPES)
  top_k, experts = _get(config, "model.top_k_experts"), _get(config, "model.num_experts")
  if top_k is not _MISSING and experts is not _MISSING and top_k > experts:
    raise ValueError(f"model.top_k_experts={top_k} exceeds model.num_experts={experts}")


def _check_sampler_and_lora(config) -> None:
  for key in ("sampler.entropy_bound", "sampler.confidence_threshold", "sampler.t_min",
              "sampler.t_max", "sampler.ar_temperature"):
    _check_float(config, key, 0.0)
  _check_choice(config, "sampler.mode", (sampler.DIFFUSION, sampler.AR))
  _check_float(config, "lora.alpha", 0.0, low_open=True)
  _check_float(config, "lora.dropout", 0.0, 1.0, high_open=True)
  # int8 / int4: QLoRA, the frozen base quantized (diffgemma/model/quantize.py).
  _check_choice(config, "lora.base_dtype", DTYPES + tuple(quantize.QTYPES))


def validate_run_config(config: ml_collections.ConfigDict) -> None:
  """Raise ValueError (one line) at the first bad value of `config`. Pure; writes nothing."""
  _check_run(config)
  _check_optimizer(config)
  _check_loss(config)
  _check_model(config)
  _check_sampler_and_lora(config)

