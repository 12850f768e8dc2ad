"""The network's building blocks: the math as pure functions (RMSNorm, linear maps with LoRA and
quantized weights, RoPE, the attention mask per layer type, attention by the XLA reference or the
Pallas kernel) and the flax.linen modules that own their parameters (`RMSNorm`, `MLP`,
`Attention`, `SelfConditioning`) on the shared `Module` base.

Shape suffixes as in diffgemma/model/transformer.py.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp

from diffgemma.model import attention_mask as mask_lib
from diffgemma.model import lora
from diffgemma.model.config import SLIDING, ModelConfig
from diffgemma.model.initializers import normal_init, ones_init
from diffgemma.model.kernels import attention as attention_kernel

Params = dict[str, Any]


# ----------------------------------------------------------------------------- building blocks


def rms_norm(x, weight, eps: float):
  """RMSNorm computed in float32; multiplies by `weight` (not 1 + weight); None = no scale."""
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  if weight is not None:
    normed = normed * weight.astype(jnp.float32)
  return normed.astype(x.dtype)


def gelu_tanh(x):
  return jax.nn.gelu(x, approximate=True)


def linear(x, w, num_in_axes: int = 1):
  """The model's one linear map: x[..., in...] contracted with w[in..., out...].

  `w` is an array (cast to x's dtype), a `quantize.QuantizedWeight` (dequantized to x's dtype)
  or a `lora.LoraWeight` (over either), computed as x @ W + scale * (dropout(x) @ A) @ B without
  forming W + A @ B.
  """
  if isinstance(w, lora.LoraWeight):
    low_rank = jnp.tensordot(w.low_rank_input(x), w.a.astype(x.dtype), num_in_axes)
    return (linear(x, w.base, num_in_axes)
            + jnp.asarray(w.scale, x.dtype) * jnp.tensordot(low_rank, w.b.astype(x.dtype), 1))
  return jnp.tensordot(x, w.astype(x.dtype), num_in_axes)


def gated_mlp(x, gate, up, down):
  return linear(gelu_tanh(linear(x, gate)) * linear(x, up), down)


def rope_inv_freq(cfg: ModelConfig, layer_type: str) -> jnp.ndarray:
  """Inverse frequencies [hd/2]; full layers use "proportional" RoPE (zero frequency past the
  rotated fraction, so those dims pass through unrotated)."""
  if layer_type == SLIDING:
    dim = cfg.head_dim
    return 1.0 / (cfg.sliding_rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  dim = cfg.global_head_dim
  rope_angles = int(cfg.full_rope_partial_factor * dim // 2)
  rotated = 1.0 / (cfg.full_rope_theta ** (
      jnp.arange(0, 2 * rope_angles, 2, dtype=jnp.float32) / dim))
  return jnp.concatenate([rotated, jnp.zeros((dim // 2 - rope_angles,), jnp.float32)])


def apply_rope(x_BxTxHxd, positions_BxT, inv_freq):
  """Rotate-half RoPE, angles computed in float32 as the reference does."""
  freqs = positions_BxT.astype(jnp.float32)[..., None] * inv_freq  # B,T,hd/2
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb).astype(x_BxTxHxd.dtype), jnp.sin(emb).astype(x_BxTxHxd.dtype)
  half = x_BxTxHxd.shape[-1] // 2
  rotated = jnp.concatenate([-x_BxTxHxd[..., half:], x_BxTxHxd[..., :half]], axis=-1)
  return x_BxTxHxd * cos + rotated * sin


class MaskSpec(NamedTuple):
  """The ingredients of `mask_lib.attention_mask` for one layer type (window None = full
  attention; segments None = one example per row; block ids None = no image attends
  bidirectionally). The fields follow `mask_lib.attention_mask`'s arguments."""
  q_anchor_BxT: jnp.ndarray
  q_limit_BxT: jnp.ndarray
  kv_pos_BxS: jnp.ndarray
  kv_valid_BxS: jnp.ndarray
  window: int | None
  q_segment_BxT: jnp.ndarray | None = None
  kv_segment_BxS: jnp.ndarray | None = None
  q_block_BxT: jnp.ndarray | None = None
  kv_block_BxS: jnp.ndarray | None = None


def layer_mask_specs(cfg: ModelConfig, q_anchor_BxT, q_limit_BxT, kv_pos_BxS, kv_valid_BxS,
                     q_segment_BxT=None, kv_segment_BxS=None, q_block_BxT=None,
                     kv_block_BxS=None):
  """{layer type: (MaskSpec, materialised [B,T,S] mask or None)}; the XLA path builds each
  mask once per layer type, the Pallas kernel builds it block by block itself. With image block
  ids (`mask_lib.image_blocks`; an encoder pass over an image prompt with
  use_bidirectional_attention="vision") the mask is materialised and attended by XLA whatever
  the attention_impl: the kernel knows no blocks, and a prompt is encoded once."""
  specs = {}
  for lt in dict.fromkeys(cfg.layer_types):  # not set(): hash order varies by process
    spec = MaskSpec(q_anchor_BxT, q_limit_BxT, kv_pos_BxS, kv_valid_BxS,
                    cfg.sliding_window if lt == SLIDING else None, q_segment_BxT,
                    kv_segment_BxS, q_block_BxT, kv_block_BxS)
    kernel_builds_it = cfg.attention_impl == "pallas" and q_block_BxT is None
    specs[lt] = (spec, None if kernel_builds_it else mask_lib.attention_mask(*spec))
  return specs


def attention(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, spec_and_mask, cfg: ModelConfig):
  """Attention by `cfg.attention_impl`: the XLA reference or the Pallas canvas kernel (which
  builds the mask itself: `layer_mask_specs` left it None)."""
  spec, mask_BxTxS = spec_and_mask
  if mask_BxTxS is None:
    return attention_kernel.canvas_attention(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, *spec[:4],
                                             spec.window, q_segment_BxT=spec.q_segment_BxT,
                                             kv_segment_BxS=spec.kv_segment_BxS)
  return attend(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, mask_BxTxS)


def attend(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, mask_BxTxS):
  """Grouped-query softmax attention with scaling 1.0 (q and k are RMS-normalised).

  Heads move ahead of the sequence axes before the matmuls: on CPU this layout runs about twice
  as fast as contracting in [B, T, H, d] order.
  """
  b, t, h, d = q_BxTxHxd.shape
  kv_heads = k_BxSxKxd.shape[2]
  q = q_BxTxHxd.reshape(b, t, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)
  k = k_BxSxKxd.transpose(0, 2, 1, 3)
  v = v_BxSxKxd.transpose(0, 2, 1, 3)
  scores = jnp.einsum("bkgtd,bksd->bkgts", q, k).astype(jnp.float32)
  scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bksd->bkgtd", probs, v)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)



def project_qkv(x_BxTxD, attn: Params, layer_type: str, positions_BxT, cfg: ModelConfig):
  """Queries, keys (normed, rotated) and values (v_norm; from k on full layers)."""
  q = linear(x_BxTxD, attn["q"])
  k_raw = linear(x_BxTxD, attn["k"])
  v_raw = linear(x_BxTxD, attn["v"]) if "v" in attn else k_raw
  inv_freq = rope_inv_freq(cfg, layer_type)
  q = apply_rope(rms_norm(q, attn["q_norm"], cfg.rms_norm_eps), positions_BxT, inv_freq)
  k = apply_rope(rms_norm(k_raw, attn["k_norm"], cfg.rms_norm_eps), positions_BxT, inv_freq)
  v = rms_norm(v_raw, None, cfg.rms_norm_eps)
  return q, k, v



# ============================================================================= flax.linen modules
#
# Parameters are read with `get_variable` outside init rather than `self.param`: a weight may be a
# `lora.LoraWeight` or a `quantize.QuantizedWeight` (pytrees whose leaves are not the weight's
# shape), which `self.param`'s shape check would reject.


class Module(nn.Module):
  """Shared parameter declaration: logical axes as flax partitioning metadata."""

  def declare(self):
    """Creates the module's parameters: calling any method runs `setup`, which declares them
    (modules with submodules call theirs)."""

  def weight(self, name: str, init: Callable, shape, dtype, axes=None):
    if not self.is_initializing() and self.has_variable("params", name):
      # May be a LoraWeight / QuantizedWeight; boxed when an NNX bridge passes it.
      return _unbox(self.get_variable("params", name))
    if axes is not None:
      init = nn.with_logical_partitioning(init, axes)
    return _unbox(self.param(name, init, tuple(shape), jnp.dtype(dtype), unbox=False))


def _unbox(value):
  """A boxed weight's value, without a sharding constraint from flax's own rules (placement
  is sharding.py's job)."""
  if isinstance(value, (nn.Partitioned, nn.LogicallyPartitioned)):
    return value.unbox(apply_constraint=False)
  if isinstance(value, nn.meta.AxisMetadata):
    return value.unbox()
  return value


# ----------------------------------------------------------------------------- modules


class RMSNorm(Module):
  """RMSNorm in float32, times `weight_name`'s weight (not 1 + weight); dim None = no scale.
  Used with `nn.share_scope`: the weight is a leaf of the parent, named `weight_name`."""
  weight_name: str
  dim: int | None
  eps: float
  param_dtype: Any = jnp.float32

  def setup(self):
    self.scale = (None if self.dim is None else
                  self.weight(self.weight_name, ones_init(), (self.dim,), self.param_dtype))

  def __call__(self, x):
    return rms_norm(x, self.scale, self.eps)


def rms_norms(names, dim: int, cfg: ModelConfig) -> dict[str, RMSNorm]:
  """RMSNorms for `setup`; assign them, then `share_scopes(self, self.norms)`."""
  return {n: RMSNorm(n, dim, cfg.rms_norm_eps, cfg.param_dtype) for n in names}


def share_scopes(parent: nn.Module, children) -> None:
  for child in children.values():
    nn.share_scope(parent, child)


class MLP(Module):
  """Gated GELU-tanh MLP: down(gelu(x @ gate) * (x @ up))."""
  cfg: ModelConfig
  std: float
  draw: int

  def setup(self):
    d, f, dt = self.cfg.hidden_size, self.cfg.intermediate_size, self.cfg.param_dtype
    self.gate = self.weight("gate", normal_init(self.std, self.draw), (d, f), dt, ("embed", "mlp"))
    self.up = self.weight("up", normal_init(self.std, self.draw + 1), (d, f), dt, ("embed", "mlp"))
    self.down = self.weight("down", normal_init(self.std, self.draw + 2), (f, d), dt,
                            ("mlp", "embed"))

  def __call__(self, x_BxTxD):
    return gated_mlp(x_BxTxD, self.gate, self.up, self.down)


class Attention(Module):
  """Q/K/V projections with q/k RMSNorm and RoPE (values from k on full layers), and the
  output projection; what lies between (the cache, the mask, the kernel) is the caller's."""
  cfg: ModelConfig
  layer_type: str
  head_dim: int
  kv_heads: int
  std: float
  draw: int

  def setup(self):
    cfg, hd, kv, dt = self.cfg, self.head_dim, self.kv_heads, self.cfg.param_dtype
    d, h = cfg.hidden_size, cfg.num_heads
    self.q = self.weight("q", normal_init(self.std, self.draw), (d, h, hd), dt,
                         ("embed", "heads", "head_dim"))
    self.k = self.weight("k", normal_init(self.std, self.draw + 1), (d, kv, hd), dt,
                         ("embed", "kv_heads", "head_dim"))
    self.o = self.weight("o", normal_init(self.std, self.draw + 2), (h, hd, d), dt,
                         ("heads", "head_dim", "embed"))
    self.q_norm = self.weight("q_norm", ones_init(cfg.qk_norm_init), (hd,), dt)
    self.k_norm = self.weight("k_norm", ones_init(cfg.qk_norm_init), (hd,), dt)
    self.v = (self.weight("v", normal_init(self.std, self.draw + 3), (d, kv, hd), dt,
                          ("embed", "kv_heads", "head_dim"))
              if self.layer_type == SLIDING else None)

  def project(self, x_BxTxD, positions_BxT):
    """(q [B,T,H,hd], k [B,T,K,hd], v [B,T,K,hd]): normed, rotated; v normed."""
    attn = {"q": self.q, "k": self.k, "q_norm": self.q_norm, "k_norm": self.k_norm}
    if self.v is not None:
      attn["v"] = self.v
    q, k, v = project_qkv(x_BxTxD, attn, self.layer_type, positions_BxT, self.cfg)
    b, t = positions_BxT.shape
    chex.assert_shape(q, (b, t, self.cfg.num_heads, self.head_dim))
    chex.assert_shape([k, v], (b, t, self.kv_heads, self.head_dim))
    return q, k, v

  def out(self, attn_BxTxHxd):
    return linear(attn_BxTxHxd, self.o, num_in_axes=2)



class SelfConditioning(Module):
  """The decoder's self-conditioning block: MLP(RMSNorm(soft embedding))."""
  cfg: ModelConfig
  std: float
  draw: int

  def setup(self):
    self.norm = RMSNorm("pre_norm", self.cfg.hidden_size, self.cfg.rms_norm_eps,
                        self.cfg.param_dtype)
    self.mlp = MLP(self.cfg, self.std, self.draw)
    nn.share_scope(self, self.norm)
    nn.share_scope(self, self.mlp)

  def declare(self):
    self.norm.declare()
    self.mlp.declare()

  def __call__(self, soft_BxCxD):
    return self.mlp(self.norm(soft_BxCxD))

