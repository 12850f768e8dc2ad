"""Model configuration: one frozen dataclass, from a few-hundred-K test model to 26B-A4B, with
an optional vision tower (`VisionConfig`).

Field names follow transformers' `DiffusionGemmaTextConfig` where one exists, so a checkpoint's
`config.json` maps onto this class field by field (see `hf_weights.config_from_hf`); the vision
tower's follow `Gemma4VisionConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from diffgemma.model import fields

SLIDING = "sliding_attention"
FULL = "full_attention"

# Gemma 4's default layer pattern: five sliding-window layers, then one full layer.
SLIDING_PATTERN_PERIOD = 6
MOE_IMPLS = ("ragged_dot", "tiled", "tiled_scan", "pallas", "expert_parallel")
ATTENTION_IMPLS = ("xla", "pallas")
# Fields that say how to compute, not what the model is: a run that starts from a checkpoint
# takes the architecture from the checkpoint and these from its own config.
NUMERICS_FIELDS = ("param_dtype", "compute_dtype", "moe_impl", "moe_tile_size", "attention_impl",
                   "remat")
REMAT_POLICIES = ("none", "full", "dots")
DTYPES = ("float32", "bfloat16", "float16")
POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim", "global_head_dim", "num_global_kv_heads", "sliding_window", "num_experts",
    "top_k_experts", "moe_intermediate_size", "canvas_length", "moe_tile_size")


BIDIRECTIONAL_CHOICES = ("vision",)
VISION_POSITIVE_INTS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "pooling_kernel_size", "patch_size",
    "position_embedding_size")


# A clippable linear W's bounds are the leaves W_clip.{input_min, ...} (see vision.py), each
# unbounded (+-inf) at init.
CLIP_SUFFIX = "_clip"
CLIP_BOUNDS = {"input_min": -math.inf, "input_max": math.inf, "output_min": -math.inf,
               "output_max": math.inf}


def is_clip_bound(path: tuple) -> bool:
  """Whether the leaf at this key path is a clippable linear's bound, for which +-inf is a
  legitimate value (unbounded) rather than a diverged weight."""
  return (len(path) >= 2 and path[-1] in CLIP_BOUNDS
          and str(path[-2]).endswith(CLIP_SUFFIX))


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """Sizes of Gemma 4's vision tower (transformers' `Gemma4VisionConfig`, same field names;
  `rope_theta` is its `rope_parameters["rope_theta"]`, the axial 2-D RoPE's base).

  An image is cut into patch_size x patch_size patches (pixel_values rows of 3 * patch_size**2),
  encoded bidirectionally by `num_hidden_layers` layers, then average-pooled over
  pooling_kernel_size x pooling_kernel_size patches into soft tokens. `position_embedding_size`
  bounds a patch's x and y index. `use_clipped_linears`: every linear clamps its input and
  output to stored bounds. `standardize`: the soft tokens get (x - std_bias) * std_scale.
  """

  hidden_size: int = 768
  intermediate_size: int = 3072
  num_hidden_layers: int = 16
  num_attention_heads: int = 12
  num_key_value_heads: int = 12
  head_dim: int = 64
  rms_norm_eps: float = 1e-6
  rope_theta: float = 100.0
  pooling_kernel_size: int = 3
  patch_size: int = 16
  position_embedding_size: int = 10 * 1024
  use_clipped_linears: bool = False
  standardize: bool = False
  initializer_range: float = 0.02
  # The image processor's soft-token budget per image, where a checkpoint's vision_config
  # carries it (Gemma 4's do); the tower does not read it.
  default_output_length: int | None = None

  def __post_init__(self):
    fields.check_types(self, "model.vision.")
    for name in VISION_POSITIVE_INTS + ("default_output_length",) * (
        self.default_output_length is not None):
      if getattr(self, name) < 1:
        raise ValueError(f"model.vision.{name} must be >= 1, got {getattr(self, name)}")
    for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.vision.{name} must be > 0, got {getattr(self, name)}")
    if self.head_dim % 4:
      raise ValueError(f"model.vision.head_dim={self.head_dim} must be a multiple of 4 (2-D "
                       "RoPE rotates pairs along x and along y)")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"model.vision.num_attention_heads={self.num_attention_heads} is not a "
                       f"multiple of model.vision.num_key_value_heads={self.num_key_value_heads}")

  @property
  def patch_dim(self) -> int:
    """Length of one patch's row of pixel values: 3 channels x patch_size**2."""
    return 3 * self.patch_size ** 2


def default_layer_types(num_layers: int) -> tuple[str, ...]:
  """The reference's pattern: every 6th layer is full, and the last layer is always full."""
  types = [FULL if (i + 1) % SLIDING_PATTERN_PERIOD == 0 else SLIDING for i in range(num_layers)]
  types[-1] = FULL
  return tuple(types)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Sizes and numerics of a DiffusionGemma text model.

  Full ("global") layers use `global_head_dim` and `num_global_kv_heads`, and take their values
  from the key projection (k_eq_v); sliding layers use `head_dim` and `num_kv_heads`.
  """

  vocab_size: int = 262_144
  hidden_size: int = 2816
  intermediate_size: int = 2112  # dense MLP and self-conditioning MLP
  num_layers: int = 30
  num_heads: int = 16
  num_kv_heads: int = 8
  head_dim: int = 256
  global_head_dim: int = 512
  num_global_kv_heads: int = 2
  sliding_window: int = 1024
  layer_types: tuple[str, ...] = ()  # empty: the default 5:1 pattern
  num_experts: int = 128
  top_k_experts: int = 8
  moe_intermediate_size: int = 704
  rms_norm_eps: float = 1e-6
  final_logit_softcap: float = 30.0
  sliding_rope_theta: float = 10_000.0
  full_rope_theta: float = 1_000_000.0
  full_rope_partial_factor: float = 0.25  # "proportional" RoPE on full layers
  pad_token_id: int = 0
  eos_token_id: int = 1
  bos_token_id: int = 2
  canvas_length: int = 256
  initializer_range: float = 0.02  # std of linear and embedding weights at init
  # Initial q_norm/k_norm scale. With scaling 1.0 and unit-RMS q and k, attention logits start
  # with std sqrt(head_dim); d**-0.25 here starts them at std 1 (matters only from scratch).
  qk_norm_init: float = 1.0
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  # "tiled": exact, faster on CPU; "tiled_scan": tiles in a loop, least memory; "pallas": the
  # grouped kernel; "expert_parallel": experts split over devices (model.moe_expert_parallel).
  moe_impl: str = "ragged_dot"
  moe_tile_size: int = 128  # rows per tile for moe_impl="tiled"
  # "xla": a materialised mask and two einsums; "pallas": the flash-style canvas-attention
  # kernel (diffgemma/model/kernels/attention.py; interpret mode on CPU, slow there).
  attention_impl: str = "xla"
  # Activation rematerialisation per layer in training: "none" keeps every activation for the
  # backward pass; "full" keeps only each layer's input and recomputes the rest; "dots" also
  # keeps matmul outputs without batch dimensions (jax.checkpoint_policies).
  remat: str = "none"
  # The vision tower (None: a text-only model). Its soft tokens replace the prompt's
  # `image_token_id` placeholders, which the processor writes between boi and eoi tokens.
  vision: VisionConfig | None = None
  image_token_id: int = 258_880
  boi_token_id: int = 255_999
  eoi_token_id: int = 258_882
  # "vision": the encoder attends bidirectionally inside each image's run of placeholder
  # tokens (the larger Gemma 4 models); None: causal everywhere.
  use_bidirectional_attention: str | None = None

  def __post_init__(self):
    if isinstance(self.vision, dict):  # from a config.json or a config section
      object.__setattr__(self, "vision", VisionConfig(**self.vision))
    if self.vision is not None and not isinstance(self.vision, VisionConfig):
      raise ValueError(f"model.vision must be a VisionConfig, a dict of its fields or None, got "
                       f"{self.vision!r}")
    fields.check_types(self, "model.")
    for name in POSITIVE_INTS:
      if getattr(self, name) < 1:
        raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
      token = getattr(self, name)
      if not 0 <= token < self.vocab_size:
        raise ValueError(f"model.{name}={token} is outside the vocabulary "
                         f"(vocab_size={self.vocab_size})")
    # May lie outside the vocabulary (transformers' defaults in a small test model): such a
    # model keeps its vision tower but can take no image (vision.check_image_tokens says so).
    for name in ("image_token_id", "boi_token_id", "eoi_token_id"):
      if getattr(self, name) < 0:
        raise ValueError(f"model.{name} must be >= 0, got {getattr(self, name)}")
    if (self.use_bidirectional_attention is not None
        and self.use_bidirectional_attention not in BIDIRECTIONAL_CHOICES):
      raise ValueError(f"model.use_bidirectional_attention={self.use_bidirectional_attention!r} "
                       f"is not supported; choose None or one of {BIDIRECTIONAL_CHOICES}")
    for name in ("rms_norm_eps", "sliding_rope_theta", "full_rope_theta", "qk_norm_init",
                 "initializer_range"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be > 0, got {getattr(self, name)}")
    if self.final_logit_softcap < 0:
      raise ValueError(f"model.final_logit_softcap must be >= 0, got {self.final_logit_softcap}")
    if not 0.0 < self.full_rope_partial_factor <= 1.0:
      raise ValueError("model.full_rope_partial_factor must be in (0, 1], got "
                       f"{self.full_rope_partial_factor}")
    for name in ("head_dim", "global_head_dim"):
      if getattr(self, name) % 2:
        raise ValueError(f"model.{name}={getattr(self, name)} must be even (rotary embeddings "
                         "rotate pairs)")
    for name in ("param_dtype", "compute_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ValueError(f"unknown model.{name} {getattr(self, name)!r}; choose one of {DTYPES}")
    if not self.layer_types:
      object.__setattr__(self, "layer_types", default_layer_types(self.num_layers))
    # A string (--config.model.layer_types=full_attention) would become its characters.
    if isinstance(self.layer_types, str) or any(t not in (SLIDING, FULL)
                                                for t in self.layer_types):
      raise ValueError(f"layer_types must be a tuple of {SLIDING!r} / {FULL!r}, one per layer; "
                       f"got {self.layer_types!r}")
    object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if len(self.layer_types) != self.num_layers:
      raise ValueError(
          f"layer_types has {len(self.layer_types)} entries but num_layers is {self.num_layers}")
    if self.layer_types[-1] != FULL:
      raise ValueError("the last of layer_types must be 'full_attention' (the reference forces "
                       "it)")
    for name in ("num_kv_heads", "num_global_kv_heads"):
      n_kv = getattr(self, name)
      if n_kv < 1 or self.num_heads % n_kv:
        raise ValueError(f"model.num_heads={self.num_heads} is not a multiple of "
                         f"model.{name}={n_kv}")
    if self.top_k_experts > self.num_experts:
      raise ValueError(f"model.top_k_experts={self.top_k_experts} exceeds "
                       f"model.num_experts={self.num_experts}")
    if self.moe_impl not in MOE_IMPLS:
      raise ValueError(f"unknown moe_impl {self.moe_impl!r}; choose one of {MOE_IMPLS}")
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"unknown remat {self.remat!r}; choose one of {REMAT_POLICIES}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"unknown attention_impl {self.attention_impl!r}; choose one of "
                       f"{ATTENTION_IMPLS}")

  def layer_head_dim(self, i: int) -> int:
    return self.head_dim if self.layer_types[i] == SLIDING else self.global_head_dim

  def layer_kv_heads(self, i: int) -> int:
    return self.num_kv_heads if self.layer_types[i] == SLIDING else self.num_global_kv_heads

  def replace(self, **kwargs: Any) -> "ModelConfig":
    return dataclasses.replace(self, **kwargs)


def gemma_26b_a4b(**overrides: Any) -> ModelConfig:
  """The released DiffusionGemma 26B-A4B text model."""
  return ModelConfig(**overrides)


def gemma_26b_a4b_vision_tower(**overrides: Any) -> VisionConfig:
  """The released 26B-A4B's vision tower (its config.json's vision_config): 27 layers of width
  1152 (16 heads of 72), MLP 4304, standardized soft tokens, no clipped linears, 16 px patches
  pooled 3 x 3 into up to 280 soft tokens; 573M parameters with the embedder (the model card's
  ~550M). transformers' Gemma4VisionConfig defaults (width 768, 16 layers, clipped linears) are
  the smaller Gemma 4 models' tower."""
  return VisionConfig(**{**dict(
      hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
      num_key_value_heads=16, head_dim=72, standardize=True, default_output_length=280),
      **overrides})


def gemma_26b_a4b_vision(**overrides: Any) -> ModelConfig:
  """The released DiffusionGemma 26B-A4B with its vision tower, bidirectional attention inside
  each image's placeholders as the larger Gemma 4 models."""
  return ModelConfig(**{**dict(vision=gemma_26b_a4b_vision_tower(),
                               use_bidirectional_attention="vision"), **overrides})


def tiny(**overrides: Any) -> ModelConfig:
  """A few-hundred-K parameter model for tests: every architectural feature, tiny sizes."""
  defaults = dict(
      vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=7, num_heads=4,
      num_kv_heads=2, head_dim=16, global_head_dim=32, num_global_kv_heads=1, sliding_window=8,
      num_experts=4, top_k_experts=2, moe_intermediate_size=24, canvas_length=8)
  defaults.update(overrides)
  return ModelConfig(**defaults)


PRESETS = {"gemma_26b_a4b": gemma_26b_a4b, "gemma_26b_a4b_vision": gemma_26b_a4b_vision,
           "tiny": tiny}
