"""Flash-style Pallas canvas attention.

`canvas_attention` is a drop-in for

    layers.attend(q, k, v, attention_mask(q_anchor, q_limit, kv_pos, kv_valid, window,
                                          q_segment, kv_segment))

that takes the mask's ingredients instead of a materialised [B, T, S] mask. It serves the decoder
(C canvas queries against [cached prefix slots | canvas keys]) and the causal encoder (anchor =
limit = the query's own position) alike, one example per row or packed rows (segment ids; None
= every query and key of a row in segment 0).

Forward: one Pallas program per (batch, query head, query block) runs an online softmax over KV
blocks in a `fori_loop` (Triton has no scratch memory, so the accumulators live in the loop carry).
The block's mask comes from `attention_mask.attention_mask` on [1, block_q] x [1, block_kv] slices,
so the mask rule lives in one place; a KV block with no visible key for any query of the block is skipped
(its K/V are never loaded), which makes the sliding window and the unfilled static cache cheap.
GQA: query head h reads kv head h // (H // K) through the BlockSpec index map.

Backward (`jax.custom_vjp`): a blocked plain-JAX flash backward. It recomputes the scores of one
KV block at a time from the saved logsumexp inside a `lax.scan`, so it holds [B, H, T, block_kv_bwd]
float32 intermediates, never the full [B, H, T, S] probabilities; KV blocks that no query sees are
skipped with `lax.cond`.

Rows with no visible key (the model only makes them for padding queries) reproduce the reference:
its softmax over S scores all equal to finfo.min is uniform, so the row is the mean of v over all
S keys. The kernel flags them with logsumexp = -inf and the wrapper substitutes that mean.

Shape suffixes: B batch, T queries, S keys, H query heads, K kv heads, d head dim, G = H // K,
Q a query block, V a KV block (in-kernel), N number of KV blocks.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from diffgemma.model import attention_mask as mask_lib
from diffgemma.model.kernels import platform

# Score of a masked entry inside the kernel; finite so the running max never becomes -inf and the
# rescaling exp(m_old - m_new) never sees inf - inf.
_MASK_VALUE = float(np.finfo(np.float32).min)
# q_limit of a padding query row: below every position, so the row sees no key and never makes a
# KV block look visible.
_NO_KEY_LIMIT = int(np.iinfo(np.int32).min)


@dataclasses.dataclass(frozen=True)
class _Options:
  """Static settings shared by the forward kernel and the backward pass."""
  sliding_window: int | None
  block_q: int | None
  block_kv: int | None
  block_kv_bwd: int
  max_tile_elements: int
  max_block: int
  min_block: int
  interpret: bool
  guarded: bool  # interpret mode inferred from a CPU trace (see platform.pallas_call)
  num_warps: int | None
  num_stages: int | None


# ----------------------------------------------------------------------------- public entry


def canvas_attention(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, q_anchor_BxT, q_limit_BxT, kv_pos_BxS,
                     kv_valid_BxS, sliding_window: int | None, *, q_segment_BxT=None,
                     kv_segment_BxS=None, block_q: int | None = None,
                     block_kv: int | None = None, block_kv_bwd: int = 256,
                     max_tile_elements: int = 64 * 256, max_block: int = 64,
                     min_block: int = 16, interpret: bool | None = None,
                     num_warps: int | None = None, num_stages: int | None = 2):
  """Masked GQA softmax attention (scaling 1.0, float32 softmax) without a materialised mask.

  Key j is visible to query t when kv_valid[j] and kv_pos[j] <= q_limit[t] and (with a sliding
  window) kv_pos[j] > q_anchor[t] - sliding_window and kv_segment[j] == q_segment[t]; see
  `attention_mask.attention_mask`.

  Args:
    q_BxTxHxd: queries (bfloat16 or float32).
    k_BxSxKxd, v_BxSxKxd: keys and values, same dtype and head dim as q; H % K == 0.
    q_anchor_BxT, q_limit_BxT: int per-query window anchor and last visible position.
    kv_pos_BxS: int key positions (any order); kv_valid_BxS: bool key validity.
    sliding_window: window size, or None for full attention.
    q_segment_BxT, kv_segment_BxS: int example ids of packed rows (both or neither; None: one
      segment per row).
    block_q, block_kv: forward tile sizes, powers of two. None: the largest power of two
      <= `max_block` whose [block, d] tile has at most `max_tile_elements` elements (64 for d <= 256,
      32 for d = 512); tiles shrink to the (padded) sequence lengths. T and S need not be
      multiples: padded queries are dropped, padded keys are invalid.
    block_kv_bwd: KV block of the blocked backward (any size); it holds
      [B, H, T, block_kv_bwd] float32 intermediates.
    max_tile_elements, max_block: bounds for the default tile sizes (see block_q).
    min_block: smallest compiled tile and head dim (Triton dots need 16); ignored when
      interpreting. Head dims that are not powers of two are zero-padded.
    interpret: Pallas interpret mode; None = the rule of `kernels.platform`: interpret on CPU,
      Triton on GPUs, KernelPlatformError on other platforms.
    num_warps, num_stages: Triton compiler parameters, used when not interpreting (passing them
      is what selects Triton over Mosaic GPU); num_warps None = 4 for d <= 64 else 8.

  Returns:
    out_BxTxHxd in q's dtype, equal to `layers.attend(q, k, v, attention_mask(...))` up to
    float rounding (rows with no visible key included).
  """
  b, t, h, d = q_BxTxHxd.shape
  _, s, kv_heads, _ = k_BxSxKxd.shape
  if k_BxSxKxd.shape != (b, s, kv_heads, d) or v_BxSxKxd.shape != k_BxSxKxd.shape:
    raise ValueError(f"k and v must be [B, S, K, d] = {(b, s, kv_heads, d)}; got "
                     f"k {k_BxSxKxd.shape}, v {v_BxSxKxd.shape}")
  if h % kv_heads:
    raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({kv_heads})")
  if not (q_BxTxHxd.dtype == k_BxSxKxd.dtype == v_BxSxKxd.dtype):
    raise ValueError(f"q, k, v dtypes differ: {q_BxTxHxd.dtype}, {k_BxSxKxd.dtype}, "
                     f"{v_BxSxKxd.dtype}")
  if (q_segment_BxT is None) != (kv_segment_BxS is None):
    raise ValueError("give q_segment and kv_segment together")
  if q_segment_BxT is None:
    q_segment_BxT, kv_segment_BxS = jnp.zeros((b, t), jnp.int32), jnp.zeros((b, s), jnp.int32)
  for name, x, shape in (("q_anchor", q_anchor_BxT, (b, t)), ("q_limit", q_limit_BxT, (b, t)),
                         ("kv_pos", kv_pos_BxS, (b, s)), ("kv_valid", kv_valid_BxS, (b, s)),
                         ("q_segment", q_segment_BxT, (b, t)),
                         ("kv_segment", kv_segment_BxS, (b, s))):
    if x.shape != shape:
      raise ValueError(f"{name} must have shape {shape}; got {x.shape}")
  for name, block in (("block_q", block_q), ("block_kv", block_kv)):
    if block is not None and (block < 1 or block & (block - 1)):
      raise ValueError(f"{name} must be a power of two; got {block}")
  guarded = interpret is None
  interpret = platform.resolve_interpret(
      interpret, "canvas attention (model.attention_impl='pallas')", "model.attention_impl='xla'")
  opts = _Options(sliding_window, block_q, block_kv, block_kv_bwd, max_tile_elements, max_block,
                  min_block, interpret, guarded, num_warps, num_stages)
  return _canvas_attention(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, q_anchor_BxT, q_limit_BxT,
                           kv_pos_BxS, kv_valid_BxS, q_segment_BxT, kv_segment_BxS, opts)


@functools.partial(jax.jit, static_argnums=(9,))
def _canvas_attention(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, q_anchor_BxT, q_limit_BxT, kv_pos_BxS,
                      kv_valid_BxS, q_segment_BxT, kv_segment_BxS, opts: _Options):
  """`canvas_attention` after validation; `opts` (static) holds the resolved platform mode, so
  a trace for one platform is never reused for another."""
  h, kv_heads = q_BxTxHxd.shape[2], k_BxSxKxd.shape[2]
  out_BxTxHxd, lse_BxHxT = _attention_core(
      q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, q_anchor_BxT.astype(jnp.int32),
      q_limit_BxT.astype(jnp.int32), kv_pos_BxS.astype(jnp.int32), kv_valid_BxS.astype(bool),
      q_segment_BxT.astype(jnp.int32), kv_segment_BxS.astype(jnp.int32), opts)
  # Rows that saw no key: the reference's uniform softmax over all S keys (differentiable in v).
  has_key_BxTxH = (lse_BxHxT > -jnp.inf).transpose(0, 2, 1)
  uniform_BxHxd = _uniform_average(v_BxSxKxd, h // kv_heads)
  return jnp.where(has_key_BxTxH[..., None], out_BxTxHxd, uniform_BxHxd[:, None])


def _uniform_average(v_BxSxKxd, group: int):
  """What the reference gives a fully masked row: sum_s bf16(1/S) * v_s, per query head."""
  s = v_BxSxKxd.shape[1]
  # The reference rounds the probabilities to v's dtype before the matmul.
  prob = jnp.asarray(1.0 / s, jnp.float32).astype(v_BxSxKxd.dtype).astype(jnp.float32)
  mean_BxKxd = (jnp.sum(v_BxSxKxd.astype(jnp.float32), axis=1) * prob).astype(v_BxSxKxd.dtype)
  return jnp.repeat(mean_BxKxd, group, axis=1)


# ----------------------------------------------------------------------------- custom vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(9,))
def _attention_core(q, k, v, anchor, limit, pos, valid, q_seg, kv_seg, opts: _Options):
  """(out_BxTxHxd with zero rows where nothing is visible, lse_BxHxT with -inf there)."""
  return _forward(q, k, v, anchor, limit, pos, valid, q_seg, kv_seg, opts)


def _attention_core_fwd(q, k, v, anchor, limit, pos, valid, q_seg, kv_seg, opts: _Options):
  out, lse = _forward(q, k, v, anchor, limit, pos, valid, q_seg, kv_seg, opts)
  return (out, lse), (q, k, v, anchor, limit, pos, valid, q_seg, kv_seg, out, lse)


def _attention_core_bwd(opts: _Options, residuals, cotangents):
  q, k, v, anchor, limit, pos, valid, q_seg, kv_seg, out, lse = residuals
  g_out, g_lse = cotangents
  dq, dk, dv = _backward_blocked(q, k, v, anchor, limit, pos, valid, q_seg, kv_seg, out, lse,
                                 g_out, g_lse, sliding_window=opts.sliding_window,
                                 block_kv=opts.block_kv_bwd)
  return dq, dk, dv, None, None, None, None, None, None


_attention_core.defvjp(_attention_core_fwd, _attention_core_bwd)


# ----------------------------------------------------------------------------- forward


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _next_power_of_2(x: int) -> int:
  return 1 << max(x - 1, 0).bit_length()


def _tile(requested: int | None, length: int, head_dim: int, opts: _Options) -> int:
  """A power-of-two tile: the request (or the default), shrunk to the padded length."""
  if requested is None:
    requested = opts.max_block
    while requested > 1 and requested * head_dim > opts.max_tile_elements:
      requested //= 2
  min_block = 1 if opts.interpret else opts.min_block
  return min(requested, max(_next_power_of_2(length), min_block))


def _pad_axis(x, axis: int, size: int, value=0):
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _forward(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, anchor_BxT, limit_BxT, pos_BxS, valid_BxS,
             q_seg_BxT, kv_seg_BxS, opts: _Options):
  """Pads to whole tiles, runs the Pallas kernel, crops. Returns (out_BxTxHxd, lse_BxHxT)."""
  b, t, h, d = q_BxTxHxd.shape
  s, kv_heads = k_BxSxKxd.shape[1], k_BxSxKxd.shape[2]
  group = h // kv_heads
  # Triton tensors need power-of-two sizes; zero dims change neither q.k nor the kept columns.
  dp = max(_next_power_of_2(d), 1 if opts.interpret else opts.min_block)
  block_q = _tile(opts.block_q, t, dp, opts)
  block_kv = _tile(opts.block_kv, s, dp, opts)
  tp, sp = _round_up(t, block_q), _round_up(s, block_kv)

  q = _pad_axis(_pad_axis(q_BxTxHxd, 3, dp), 1, tp)
  k = _pad_axis(_pad_axis(k_BxSxKxd, 3, dp), 1, sp)
  v = _pad_axis(_pad_axis(v_BxSxKxd, 3, dp), 1, sp)
  anchor = _pad_axis(anchor_BxT, 1, tp)
  limit = _pad_axis(limit_BxT, 1, tp, _NO_KEY_LIMIT)
  pos = _pad_axis(pos_BxS, 1, sp)
  q_seg = _pad_axis(q_seg_BxT, 1, tp)
  kv_seg = _pad_axis(kv_seg_BxS, 1, sp)
  # int32, not bool: the safest element type for Triton loads.
  valid = _pad_axis(valid_BxS.astype(jnp.int32), 1, sp)

  kernel = functools.partial(_forward_kernel, sliding_window=opts.sliding_window,
                             block_kv=block_kv, num_kv_blocks=sp // block_kv)
  q_rows = pl.BlockSpec((None, block_q), lambda bi, hi, qi: (bi, qi))
  kv_rows = pl.BlockSpec((None, sp), lambda bi, hi, qi: (bi, 0))
  q_tile = pl.BlockSpec((None, block_q, None, dp), lambda bi, hi, qi: (bi, qi, hi, 0))
  kv_all = pl.BlockSpec((None, sp, None, dp), lambda bi, hi, qi: (bi, 0, hi // group, 0))
  lse_tile = pl.BlockSpec((None, None, block_q), lambda bi, hi, qi: (bi, hi, qi))
  out, lse = platform.pallas_call(
      kernel,
      grid=(b, h, tp // block_q),
      in_specs=[q_rows, q_rows, kv_rows, kv_rows, q_rows, kv_rows, q_tile, kv_all, kv_all],
      out_specs=[q_tile, lse_tile],
      out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                 jax.ShapeDtypeStruct((b, h, tp), jnp.float32)],
      interpret=opts.interpret,
      guarded=opts.guarded,
      compiler_params=_compiler_params(opts, d),
      name="canvas_attention",
  )(anchor, limit, pos, valid, q_seg, kv_seg, q, k, v)
  return out[:, :t, :, :d], lse[:, :, :t]


def _compiler_params(opts: _Options, head_dim: int):
  """Triton compiler parameters when compiling; None when interpreting.

  Passing Triton parameters is what selects the Triton backend: since jax 0.10 a GPU pallas_call
  without them lowers to Mosaic GPU, which would stage the whole-S K/V blocks in shared memory.
  """
  if opts.interpret:
    return None
  from jax.experimental.pallas import triton as plgpu  # pylint: disable=g-import-not-at-top
  small_head_dim = 64  # few warps suffice for narrow tiles
  num_warps = opts.num_warps or (4 if head_dim <= small_head_dim else 8)
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=opts.num_stages)


def _forward_kernel(anchor_ref, limit_ref, pos_ref, valid_ref, q_seg_ref, kv_seg_ref, q_ref,
                    k_ref, v_ref, o_ref, lse_ref, *, sliding_window: int | None, block_kv: int,
                    num_kv_blocks: int):
  """One (batch, head, query block): online softmax over the KV blocks any of its rows sees."""
  q_Qxd = q_ref[...]
  anchor_1xQ = anchor_ref[...][None, :]
  limit_1xQ = limit_ref[...][None, :]
  q_seg_1xQ = q_seg_ref[...][None, :]
  block_q, head_dim = q_Qxd.shape

  def accumulate(kv, mask_QxV, carry):
    m_Q, l_Q, acc_Qxd = carry
    k_Vxd = k_ref[kv, :]
    v_Vxd = v_ref[kv, :]
    scores_QxV = jax.lax.dot_general(q_Qxd, k_Vxd, (((1,), (1,)), ((), ())),
                                     preferred_element_type=jnp.float32)
    scores_QxV = jnp.where(mask_QxV, scores_QxV, _MASK_VALUE)
    m_new_Q = jnp.maximum(m_Q, jnp.max(scores_QxV, axis=1))
    # Masked entries weigh exactly 0 (also in rows with nothing visible yet, where m stays finite).
    p_QxV = jnp.where(mask_QxV, jnp.exp(scores_QxV - m_new_Q[:, None]), 0.0)
    rescale_Q = jnp.exp(m_Q - m_new_Q)
    l_Q = rescale_Q * l_Q + jnp.sum(p_QxV, axis=1)
    acc_Qxd = rescale_Q[:, None] * acc_Qxd + jnp.dot(
        p_QxV.astype(v_Vxd.dtype), v_Vxd, preferred_element_type=jnp.float32)
    return m_new_Q, l_Q, acc_Qxd

  def body(j, carry):
    kv = pl.ds(j * block_kv, block_kv)
    pos_1xV = pos_ref[kv][None, :]
    valid_1xV = valid_ref[kv][None, :] != 0
    kv_seg_1xV = kv_seg_ref[kv][None, :]
    mask_QxV = mask_lib.attention_mask(anchor_1xQ, limit_1xQ, pos_1xV, valid_1xV, sliding_window,
                                       q_seg_1xQ, kv_seg_1xV).reshape(block_q, block_kv)
    # Triton has no reduce_or: "any" as a max over int32.
    any_visible = jnp.max(mask_QxV.astype(jnp.int32)) > 0
    return jax.lax.cond(any_visible, functools.partial(accumulate, kv, mask_QxV),
                        lambda c: c, carry)

  init = (jnp.full((block_q,), _MASK_VALUE, jnp.float32), jnp.zeros((block_q,), jnp.float32),
          jnp.zeros((block_q, head_dim), jnp.float32))
  m_Q, l_Q, acc_Qxd = jax.lax.fori_loop(0, num_kv_blocks, body, init)
  has_key_Q = l_Q > 0
  safe_l_Q = jnp.where(has_key_Q, l_Q, 1.0)
  o_ref[...] = (acc_Qxd / safe_l_Q[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(has_key_Q, m_Q + jnp.log(safe_l_Q), -jnp.inf)


# ----------------------------------------------------------------------------- backward


def _backward_blocked(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, anchor_BxT, limit_BxT, pos_BxS, valid_BxS,
                      q_seg_BxT, kv_seg_BxS, out_BxTxHxd, lse_BxHxT, g_out_BxTxHxd, g_lse_BxHxT, *,
                      sliding_window: int | None, block_kv: int):
  """Flash-attention backward in plain JAX, one KV block per `lax.scan` step.

  With P = softmax probabilities recomputed as exp(scores - lse) on visible entries:
    dV = P^T dO,  dS = P * (dO V^T - rowsum(dO * O) + g_lse),  dQ = dS K,  dK = dS^T Q.
  Returns (dq_BxTxHxd, dk_BxSxKxd, dv_BxSxKxd) in the input dtypes.
  """
  b, t, h, d = q_BxTxHxd.shape
  s, kv_heads = k_BxSxKxd.shape[1], k_BxSxKxd.shape[2]
  group = h // kv_heads
  dtype = q_BxTxHxd.dtype
  block_kv = min(block_kv, s)
  sp = _round_up(s, block_kv)
  num_blocks = sp // block_kv

  def to_groups(x_BxTxHxd):  # -> B,K,G,T,d
    return x_BxTxHxd.reshape(b, t, kv_heads, group, -1).transpose(0, 2, 3, 1, 4)

  def rows_to_groups(x_BxHxT):  # -> B,K,G,T
    return x_BxHxT.reshape(b, kv_heads, group, t)

  q_BxKxGxTxd = to_groups(q_BxTxHxd)
  g_out_BxKxGxTxd = to_groups(g_out_BxTxHxd.astype(dtype))
  delta_BxKxGxT = to_groups(jnp.sum(
      g_out_BxTxHxd.astype(jnp.float32) * out_BxTxHxd.astype(jnp.float32), axis=-1,
      keepdims=True))[..., 0]
  # Rows with no visible key have lse = -inf; every entry of theirs is masked anyway.
  lse_BxKxGxT = rows_to_groups(jnp.where(lse_BxHxT > -jnp.inf, lse_BxHxT, 0.0))
  g_lse_BxKxGxT = rows_to_groups(g_lse_BxHxT.astype(jnp.float32))

  def blocks(x_BxS, fill=0):  # -> N,B,V,...
    x_BxS = _pad_axis(x_BxS, 1, sp, fill)
    return jnp.moveaxis(x_BxS.reshape(b, num_blocks, block_kv, *x_BxS.shape[2:]), 1, 0)

  xs = (blocks(k_BxSxKxd), blocks(v_BxSxKxd), blocks(pos_BxS), blocks(valid_BxS, False),
        blocks(kv_seg_BxS))
  einsum = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

  def step(dq_BxKxGxTxd, block):
    k_BxVxKxd, v_BxVxKxd, pos_BxV, valid_BxV, kv_seg_BxV = block
    mask_BxTxV = mask_lib.attention_mask(anchor_BxT, limit_BxT, pos_BxV, valid_BxV, sliding_window,
                                         q_seg_BxT, kv_seg_BxV)

    def compute(dq_BxKxGxTxd):
      scores_BxKxGxTxV = einsum("bkgtd,bvkd->bkgtv", q_BxKxGxTxd, k_BxVxKxd)
      p_BxKxGxTxV = jnp.where(mask_BxTxV[:, None, None],
                              jnp.exp(scores_BxKxGxTxV - lse_BxKxGxT[..., None]), 0.0)
      dp_BxKxGxTxV = einsum("bkgtd,bvkd->bkgtv", g_out_BxKxGxTxd, v_BxVxKxd)
      # Like the forward's P @ V, the matmuls take P and dS in the input dtype.
      ds_BxKxGxTxV = (p_BxKxGxTxV * (dp_BxKxGxTxV - delta_BxKxGxT[..., None]
                                     + g_lse_BxKxGxT[..., None])).astype(dtype)
      dv_BxVxKxd = einsum("bkgtv,bkgtd->bvkd", p_BxKxGxTxV.astype(dtype), g_out_BxKxGxTxd)
      dk_BxVxKxd = einsum("bkgtv,bkgtd->bvkd", ds_BxKxGxTxV, q_BxKxGxTxd)
      dq_BxKxGxTxd = dq_BxKxGxTxd + einsum("bkgtv,bvkd->bkgtd", ds_BxKxGxTxV, k_BxVxKxd)
      return dq_BxKxGxTxd, (dk_BxVxKxd, dv_BxVxKxd)

    def skip(dq_BxKxGxTxd):
      zeros = jnp.zeros(k_BxVxKxd.shape, jnp.float32)
      return dq_BxKxGxTxd, (zeros, zeros)

    return jax.lax.cond(jnp.any(mask_BxTxV), compute, skip, dq_BxKxGxTxd)

  dq0 = jnp.zeros(q_BxKxGxTxd.shape, jnp.float32)
  dq_BxKxGxTxd, (dk_NxBxVxKxd, dv_NxBxVxKxd) = jax.lax.scan(step, dq0, xs)

  def unblock(x_NxBxVxKxd):
    return jnp.moveaxis(x_NxBxVxKxd, 0, 1).reshape(b, sp, kv_heads, d)[:, :s]

  dq_BxTxHxd = dq_BxKxGxTxd.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)
  return (dq_BxTxHxd.astype(dtype), unblock(dk_NxBxVxKxd).astype(k_BxSxKxd.dtype),
          unblock(dv_NxBxVxKxd).astype(v_BxSxKxd.dtype))
