"""LoRA: low-rank adapters on any linear weight of the model, as a transformation of the params.

A LoRA run keeps two pytrees: the frozen base parameters and the adapters, a flat dict
{path: {"a": A, "b": B}} for every targeted weight ("layers.3.attn.q", "layers.0.experts.gate_up",
"self_conditioning.down", ...). `wrap` puts them together: each targeted leaf becomes a
`LoraWeight`, which the model's one linear function (`layers.linear`, and `moe.moe` for the
stacked experts) computes as

    x @ W + (alpha / rank) * (dropout(x) @ A) @ B

without ever forming W + A @ B. The factors keep the weight's axes: W [in..., out...] gets
A [in..., r] and B [r, out...]; the stacked experts W [E, in, out] get a per-expert pair
A [E, in, r], B [E, r, out], batched with the expert dimension. `merge` folds the adapters into
the base for export or serving.

The base may be quantized (QLoRA): a `quantize.QuantizedWeight` is one weight leaf like an array
(`is_weight`), wrapped and merged the same way.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp

from diffgemma.model import fields

Params = dict[str, Any]

# Per linear weight name: (leading expert axes, input axes); the remaining axes are outputs.
# These are all the linear maps of the model (transformer.py's parameter layout), and of the
# vision tower and its embedder (vision.py's; the default targets leave those frozen).
LINEAR_LAYOUTS = {
    "attn.q": (0, 1), "attn.k": (0, 1), "attn.v": (0, 1), "attn.o": (0, 2),
    "mlp.gate": (0, 1), "mlp.up": (0, 1), "mlp.down": (0, 1),
    "router.proj": (0, 1),
    "experts.gate_up": (1, 1), "experts.down": (1, 1),
    "self_conditioning.gate": (0, 1), "self_conditioning.up": (0, 1),
    "self_conditioning.down": (0, 1),
    "attn.q_proj": (0, 1), "attn.k_proj": (0, 1), "attn.v_proj": (0, 1), "attn.o_proj": (0, 2),
    "mlp.gate_proj": (0, 1), "mlp.up_proj": (0, 1), "mlp.down_proj": (0, 1),
    "patch_embedder.input_proj": (0, 1), "embed_vision.projection": (0, 1),
}
ROUTER_PATTERN = r"router\.proj$"
INITS = ("kaiming_uniform", "gaussian")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Which weights get adapters and how (every field is a config key under `lora.`).

  targets: regular expressions searched in each weight's dotted path; the default covers every
    linear of the language model (the report's "all linear operations"), not the vision tower's
    (`vision_tower.layers.0.attn.q_proj`, ...: add e.g. r"^vision_tower[.].*_proj$" to adapt
    them).
  init: "kaiming_uniform" (A ~ U(+-1/sqrt(fan_in)), as PEFT) or "gaussian" (A ~ N(0, 1/rank));
    B starts at zero either way, so training starts from the base model exactly.
  base_dtype: dtype the frozen base weights are stored in ("bfloat16" halves their memory), or
    "int8" / "int4": a weight-only quantized base (QLoRA; see quantize.py and the training
    config's optional `quantize` section).
  """

  enabled: bool = False
  rank: int = 8
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] = (r"attn\.(q|k|v|o)$", r"mlp\.(gate|up|down)$", ROUTER_PATTERN,
                              r"experts\.(gate_up|down)$", r"self_conditioning\.(gate|up|down)$")
  init: str = "kaiming_uniform"
  base_dtype: str = "bfloat16"
  # Keep only the adapters in checkpoints; the base is re-read from the run's init_from.
  save_base: bool = False

  def __post_init__(self):
    object.__setattr__(self, "targets", tuple(self.targets))
    fields.check_types(self, "lora.")
    if self.rank < 1:
      raise ValueError(f"lora.rank must be >= 1, got {self.rank}")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
    if self.alpha <= 0:
      raise ValueError(f"lora.alpha must be > 0, got {self.alpha}")
    if self.init not in INITS:
      raise ValueError(f"unknown lora.init {self.init!r}; choose one of {INITS}")
    for pattern in self.targets:
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"lora.targets pattern {pattern!r} is not a regular expression: {e}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def run_lora_config(section: dict | None, freeze_router: bool = False) -> LoraConfig:
  """A run's LoRA settings from its config's `lora` section (disabled when there is none: runs
  written before LoRA existed); a run that freezes the router gives it no adapter."""
  cfg = LoraConfig(**(section or {}))
  if cfg.enabled and freeze_router:
    cfg = dataclasses.replace(cfg, targets=tuple(t for t in cfg.targets if t != ROUTER_PATTERN))
  return cfg


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraWeight:
  """A frozen weight with its adapter; a pytree whose leaves are the three arrays."""

  base: jax.Array
  a: jax.Array
  b: jax.Array
  dropout_key: jax.Array | None = None
  scale: float = dataclasses.field(default=1.0, metadata={"static": True})
  dropout: float = dataclasses.field(default=0.0, metadata={"static": True})

  def low_rank_input(self, x):
    """The adapter's input: x with dropout when training with it."""
    if self.dropout_key is None or self.dropout == 0.0:
      return x
    keep = jax.random.bernoulli(self.dropout_key, 1.0 - self.dropout, x.shape)
    return jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)

  def merged(self, dtype=None):
    """W + scale * A @ B (float32 sum, then `dtype`, default the base's)."""
    return merge_weight(self.base, self.a, self.b, self.scale, dtype)


def linear_layout(path: str) -> tuple[int, int] | None:
  """(expert axes, input axes) of the linear weight at a dotted path, None if not a linear."""
  for suffix, layout in LINEAR_LAYOUTS.items():
    if path == suffix or path.endswith("." + suffix):
      return layout
  return None


def dotted(path) -> str:
  """A jax key path as "layers.3.attn.q" (a dataclass field, e.g. a quantized weight's values,
  as "layers.3.attn.q.qvalue")."""
  return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def is_weight(x) -> bool:
  """A weight leaf of a params tree: an array or a wrapper of one (`LoraWeight`, a quantized
  weight), not a dict or list of them."""
  return not isinstance(x, (dict, list, tuple))


def target_paths(params: Params, cfg: LoraConfig) -> list[str]:
  """Dotted paths of the weights that get adapters, in tree order."""
  paths = []
  for path, _ in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_weight)[0]:
    name = dotted(path)
    if linear_layout(name) and any(re.search(p, name) for p in cfg.targets):
      paths.append(name)
  return paths


def factor_shapes(shape: tuple[int, ...], layout: tuple[int, int], rank: int):
  """Shapes of A and B for a weight of `shape`: ([E..] in.. r, [E..] r out..)."""
  num_expert, num_in = layout
  lead, ins, outs = shape[:num_expert], shape[num_expert:num_expert + num_in], shape[
      num_expert + num_in:]
  return lead + ins + (rank,), lead + (rank,) + outs


def init(params: Params, cfg: LoraConfig, rng) -> Params:
  """Float32 adapters {path: {"a", "b"}} for the targeted weights of `params` (B = 0)."""
  leaves = {dotted(p): x for p, x in
            jax.tree_util.tree_flatten_with_path(params, is_leaf=is_weight)[0]}
  adapters = {}
  for i, name in enumerate(target_paths(params, cfg)):
    layout = linear_layout(name)
    shape_a, shape_b = factor_shapes(leaves[name].shape, layout, cfg.rank)
    fan_in = 1
    for n in shape_a[layout[0]:-1]:
      fan_in *= n
    key = jax.random.fold_in(rng, i)
    if cfg.init == "kaiming_uniform":
      bound = fan_in ** -0.5
      a = jax.random.uniform(key, shape_a, jnp.float32, -bound, bound)
    else:
      a = jax.random.normal(key, shape_a, jnp.float32) / cfg.rank
    adapters[name] = {"a": a, "b": jnp.zeros(shape_b, jnp.float32)}
  return adapters


def wrap(base: Params, adapters: Params, cfg: LoraConfig, dropout_rng=None) -> Params:
  """The base params with each adapted leaf replaced by a `LoraWeight` (what the model runs).

  The base is wrapped in stop_gradient: gradients flow to the adapters only. With
  `dropout_rng` and cfg.dropout > 0, each adapter's input gets its own dropout mask.
  """
  def visit(path, x):
    name = dotted(path)
    x = jax.lax.stop_gradient(x)
    if name not in adapters:
      return x
    key = None
    if dropout_rng is not None and cfg.dropout > 0:
      key = jax.random.fold_in(dropout_rng, zlib.crc32(name.encode()))  # stable per name
    return LoraWeight(x, adapters[name]["a"], adapters[name]["b"], key, cfg.scale, cfg.dropout)

  return jax.tree_util.tree_map_with_path(visit, base, is_leaf=is_weight)


def merge_weight(base, a, b, scale: float, dtype=None):
  """base + scale * A @ B, contracting the rank axis (batched over leading expert axes)."""
  num_expert = a.ndim + b.ndim - base.ndim - 2  # A and B share the expert axes and the rank
  a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
  if num_expert:
    e = a.shape[:num_expert]
    delta = jax.vmap(lambda x, y: jnp.tensordot(x, y, 1))(
        a32.reshape((-1,) + a.shape[num_expert:]), b32.reshape((-1,) + b.shape[num_expert:]))
    delta = delta.reshape(e + delta.shape[1:])
  else:
    delta = jnp.tensordot(a32, b32, 1)
  return (base.astype(jnp.float32) + scale * delta).astype(dtype or base.dtype)


def merge(base: Params, adapters: Params, cfg: LoraConfig, dtype=None) -> Params:
  """Plain params with every adapter folded in (for export, serving or evaluation)."""
  def visit(path, x):
    name = dotted(path)
    if name not in adapters:
      return x.astype(dtype or x.dtype)
    return merge_weight(x, adapters[name]["a"], adapters[name]["b"], cfg.scale, dtype)

  return jax.tree_util.tree_map_with_path(visit, base, is_leaf=is_weight)

