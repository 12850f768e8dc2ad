"""Weight-only int8 / int4 quantization of a frozen base, as a transformation of the params.

`quantize_params` replaces each targeted linear weight with a `QuantizedWeight`: integer values
(int8, or int4 stored two to a byte by XLA) and float scales, computed by qwix (`qwix.quantize`,
symmetric absmax calibration: scale = absmax / (qmax + 1/2), q = clip(round(w / scale))). The
model consumes it where it consumes any weight: `w.astype(dtype)` (what `layers.linear`, the
expert matmuls and `lora.merge_weight` call) dequantizes, q * scale in `dtype`, and `w[e]` takes
expert e's rows, so the "tiled_scan" MoE dequantizes one expert at a time. Activations stay in
the compute dtype (weight-only); nothing about the model's code paths changes.

QLoRA: a LoRA run's frozen base may be a quantized tree (`lora.base_dtype` "int8" / "int4" in a
training config); `lora.wrap` puts each quantized weight under its `LoraWeight`, and gradients
reach only the float adapters.

Scales: one per output channel (int8 default), or one per group of `group_size` consecutive
rows of the last input axis (int4 default 128; the largest divisor of that axis not above
`group_size`). Scale shape = the weight's rank with 1 on the reduced input axes.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from diffgemma.model import lora

Params = dict[str, Any]
QTYPES = {"int8": jnp.int8, "int4": jnp.int4}
# Every linear of the model except the router (small, and it picks the experts).
DEFAULT_TARGETS = (r"attn\.(q|k|v|o)$", r"mlp\.(gate|up|down)$", r"experts\.(gate_up|down)$",
                   r"self_conditioning\.(gate|up|down)$")
DEFAULT_GROUP_SIZE = {"int8": 0, "int4": 128}


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
  """dtype: "int8" or "int4". group_size: rows of the last input axis per scale (0: one scale
  per output channel; None: the dtype's default). scale_dtype: the scales' float dtype.
  targets: regular expressions searched in each linear weight's dotted path."""

  dtype: str = "int8"
  group_size: int | None = None
  scale_dtype: str = "float32"
  targets: tuple[str, ...] = DEFAULT_TARGETS

  def __post_init__(self):
    if self.dtype not in QTYPES:
      raise ValueError(f"unknown quantization dtype {self.dtype!r}; choose one of "
                       f"{tuple(QTYPES)}")
    if self.group_size is None:
      object.__setattr__(self, "group_size", DEFAULT_GROUP_SIZE[self.dtype])
    if self.group_size < 0:
      raise ValueError(f"quantize group_size must be >= 0 (0 = per channel), got "
                       f"{self.group_size}")
    object.__setattr__(self, "targets", tuple(self.targets))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantizedWeight:
  """A weight stored as integers and scales; dequantizes as w ~ qvalue * scale (broadcast by
  groups). A pytree whose leaves are the two arrays."""

  qvalue: jax.Array  # int8 / int4, the weight's shape
  scale: jax.Array  # float, the weight's rank; each axis divides the weight's

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.qvalue.shape)

  @property
  def ndim(self) -> int:
    return len(self.qvalue.shape)

  @property
  def dtype(self):
    return self.scale.dtype

  def astype(self, dtype) -> jax.Array:
    """The dequantized weight in `dtype` (the scales are cast first: one rounding)."""
    scale = self.scale.astype(dtype)
    return qwix.dequantize(qwix.QArray(self.qvalue, scale, None, self.qvalue.dtype))

  def __getitem__(self, index) -> QuantizedWeight:
    """Index the leading (expert) axes; every scale axis there has the weight's size."""
    return QuantizedWeight(self.qvalue[index], self.scale[index])


def group_size_for(axis_size: int, group_size: int) -> int:
  """Rows per scale along an input axis: the largest divisor of it not above group_size
  (0: the whole axis)."""
  if group_size <= 0 or group_size >= axis_size:
    return axis_size
  return max(g for g in range(1, group_size + 1) if axis_size % g == 0)


def quantize_weight(w, layout: tuple[int, int], cfg: QuantizeConfig) -> QuantizedWeight:
  """Quantize one weight [experts.., in.., out..] (`layout` = (expert axes, input axes))."""
  num_expert, num_in = layout
  in_axes = range(num_expert, num_expert + num_in)
  channel_axes = [a for a in range(w.ndim) if a not in in_axes]
  last_in = num_expert + num_in - 1
  group = group_size_for(w.shape[last_in], cfg.group_size)
  tiled = {last_in: group} if group < w.shape[last_in] else {}
  q = qwix.quantize(w.astype(jnp.float32), QTYPES[cfg.dtype], channelwise_axes=channel_axes,
                    tiled_axes=tiled)
  return QuantizedWeight(q.qvalue, q.scale.astype(cfg.scale_dtype))


def target_paths(params: Params, cfg: QuantizeConfig) -> list[str]:
  """Dotted paths of the linear weights `cfg` quantizes, in tree order."""
  leaves = jax.tree_util.tree_flatten_with_path(params, is_leaf=lora.is_weight)[0]
  return [name for name in (lora.dotted(p) for p, _ in leaves)
          if lora.linear_layout(name) and any(re.search(t, name) for t in cfg.targets)]


def quantize_params(params: Params, cfg: QuantizeConfig, shardings=None) -> Params:
  """`params` with the targeted linear weights as `QuantizedWeight`s (the rest unchanged).

  Jittable (`jax.eval_shape` gives the quantized tree's shapes). With `shardings`, a tree
  matching the result (`jax.sharding.Sharding` per array), each weight is quantized by its own
  jitted call straight onto its devices: the float base may sit in host memory, and the
  devices hold the quantized tree plus one float weight at a time.
  """
  targets = set(target_paths(params, cfg))

  def visit(path, w):
    name = lora.dotted(path)
    if name not in targets:
      if shardings is None:
        return w
      return jax.device_put(w, _at(shardings, path))
    fn = jax.jit(lambda w, name=name: quantize_weight(w, lora.linear_layout(name), cfg))
    if shardings is None:
      return fn(w)
    target = _at(shardings, path)  # a QuantizedWeight of shardings; the values' fits w
    return jax.jit(fn, out_shardings=target)(jax.device_put(w, target.qvalue))

  return jax.tree_util.tree_map_with_path(visit, params, is_leaf=lora.is_weight)


def _at(tree, path):
  for key in path:
    tree = tree[getattr(key, "key", getattr(key, "idx", key))]
  return tree


def bits_per_value(dtype) -> int:
  """Storage bits of one value: 4 for int4 (XLA packs two to a byte), else 8 * itemsize."""
  dtype = jnp.dtype(dtype)
  return jnp.iinfo(dtype).bits if jnp.issubdtype(dtype, jnp.integer) else 8 * dtype.itemsize


def nbytes(tree) -> int:
  """Bytes of a tree's arrays or ShapeDtypeStructs, as XLA stores them."""
  return sum(int(np.prod(x.shape)) * bits_per_value(x.dtype) // 8
             for x in jax.tree_util.tree_leaves(tree))
