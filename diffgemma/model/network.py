"""The DiffusionGemma network: flax.linen modules (`Model` and its parts, at the end of this file)
that own the parameters and call the pure functions above them for the math; `encode`, `decode`
and `init_params` are thin wrappers of `Model.apply` / `Model.init` over the parameter pytree.

One set of weights, two entry points:
  * `encode`: causal (sliding-window causal on sliding layers) over new tokens; writes their K/V
    into a static-shape cache and returns hidden states.
  * `decode`: a canvas of C tokens attends bidirectionally to itself and to the valid cached
    prefix; it reads the cache and never writes it. Only the decoder has the self-conditioning
    block.
`lm_head` turns hidden states into float32 soft-capped logits with the tied embedding.

Parameter layout (linear weights are [in, out]):
  embedding [V, D], final_norm [D],
  self_conditioning: pre_norm [D], gate [D, F], up [D, F], down [F, D]
  layers[i]: input_norm, post_attn_norm, pre_ffw_norm, post_ffw_norm, post_ffw_norm_1,
             pre_ffw_norm_2, post_ffw_norm_2 [D]; layer_scalar [];
             attn: q [D, H, hd], k [D, K, hd], v [D, K, hd] (sliding layers only; full layers
                   take values from k), o [H, hd, D], q_norm [hd], k_norm [hd];
             mlp: gate [D, F], up [D, F], down [F, D];
             router: proj [D, E], scale [D], per_expert_scale [E];
             experts: gate_up [E, D, 2I], down [E, I, D].
Shape suffixes: B batch, T new tokens, S cache slots, C canvas, D hidden, H heads, K kv heads,
V vocab, E experts, N tokens (flattened), M token-expert assignments.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffgemma import errors
from diffgemma.model import attention_mask as mask_lib
from diffgemma.model import lora, quantize, sharding
from diffgemma.model.config import FULL, SLIDING, ModelConfig
from diffgemma.model.kernels import attention as attention_kernel
from diffgemma.model.kernels import moe as moe_kernel

Params = dict[str, Any]
Cache = dict[str, Any]


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
  attention)."""
  q_anchor_BxT: jnp.ndarray
  q_limit_BxT: jnp.ndarray
  kv_pos_BxS: jnp.ndarray
  kv_valid_BxS: jnp.ndarray
  window: int | None


def layer_mask_specs(cfg: ModelConfig, q_anchor_BxT, q_limit_BxT, kv_pos_BxS, kv_valid_BxS):
  """{layer type: (MaskSpec, materialised [B,T,S] mask or None)}; the XLA path builds each
  mask once per layer type, the Pallas kernel builds it block by block itself."""
  specs = {}
  for lt in dict.fromkeys(cfg.layer_types):  # not set(): hash order varies by process
    spec = MaskSpec(q_anchor_BxT, q_limit_BxT, kv_pos_BxS, kv_valid_BxS,
                    cfg.sliding_window if lt == SLIDING else None)
    mask = None if cfg.attention_impl == "pallas" else mask_lib.attention_mask(*spec)
    specs[lt] = (spec, mask)
  return specs


def attention(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, spec_and_mask, cfg: ModelConfig):
  """Attention by `cfg.attention_impl`: the XLA reference or the Pallas canvas kernel."""
  spec, mask_BxTxS = spec_and_mask
  if cfg.attention_impl == "pallas":
    return attention_kernel.canvas_attention(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, *spec[:4],
                                             spec.window)
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


def route(x_NxD, router: Params, cfg: ModelConfig):
  """Gemma 4 router: top-k of a float32 softmax, renormalised, times the per-expert scale."""
  h = rms_norm(x_NxD, None, cfg.rms_norm_eps)
  h = h * router["scale"].astype(h.dtype) * jnp.asarray(cfg.hidden_size ** -0.5, h.dtype)
  probs = jax.nn.softmax(linear(h, router["proj"]).astype(jnp.float32), axis=-1)
  weights, index = jax.lax.top_k(probs, cfg.top_k_experts)
  weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  weights = weights * router["per_expert_scale"][index].astype(jnp.float32)
  return weights, index


def moe(x_NxD, weights_Nxk, index_Nxk, experts: Params, cfg: ModelConfig,
        some_elsewhere: bool = False):
  """Mixture of experts over token-expert assignments sorted by expert (no dense E x N compute).

  `cfg.moe_impl` picks the grouped matmul: "ragged_dot" (jax.lax.ragged_dot), "tiled" (each
  expert's rows padded to whole tiles, one batched matmul over tiles with the tile's expert
  weights; exact, and much faster than ragged_dot on CPU), "tiled_scan" (the same tiles one at
  a time in a lax.scan: one expert's weights in memory instead of a gather as large as all of
  them; for large models) or "pallas" (the grouped kernel in
  diffgemma/model/kernels/moe.py with fused gate/up and the combine weights in its epilogue).
  "expert_parallel" computes here as "tiled_scan" (`moe_expert_parallel` runs it per device).
  Expert weights may be `lora.LoraWeight`s (per-expert adapters) and `quantize.QuantizedWeight`s
  (dequantized per tile): see `expert_matmul`.
  With `some_elsewhere` (the tiled layouts only), an index outside [0, E) is an expert held
  by another device: its assignment adds nothing here, and the tile loop of "tiled_scan" /
  "expert_parallel" stops after the last tile of the E experts' rows.
  """
  n, d = x_NxD.shape
  top_k = index_Nxk.shape[1]
  num_experts = _array(experts["gate_up"]).shape[0]
  flat_expert_M = index_Nxk.reshape(-1)
  if some_elsewhere:  # other devices' experts sort last, in a group of their own
    flat_expert_M = jnp.where((flat_expert_M >= 0) & (flat_expert_M < num_experts),
                              flat_expert_M, num_experts)
  order_M = jnp.argsort(flat_expert_M, stable=True)
  token_M = order_M // top_k
  group_sizes_E = jnp.bincount(flat_expert_M, length=num_experts + some_elsewhere)[
      :num_experts].astype(jnp.int32)
  x_MxD = x_NxD[token_M]
  # Combine weights are applied per assignment, then scattered back: nothing of size E x N.
  row_weights_M = weights_Nxk.reshape(-1)[order_M]
  if cfg.moe_impl == "pallas":
    # The fused kernel takes plain weights: adapters are folded in, one layer at a time.
    gate_up_w, down_w = (w.merged(x_NxD.dtype) if isinstance(w, lora.LoraWeight)
                         else w.astype(x_NxD.dtype)
                         for w in (experts["gate_up"], experts["down"]))
    # The kernel applies the combine weights in its down-projection epilogue.
    y_MxD = moe_kernel.expert_mlp(x_MxD, group_sizes_E, gate_up_w, down_w, row_weights_M)
  else:
    groups = ExpertGroups.make(group_sizes_E, x_MxD.shape[0], cfg, some_elsewhere)
    x_rows = groups.to_rows(x_MxD)
    gate, up = jnp.split(expert_matmul(x_rows, experts["gate_up"], groups), 2, axis=-1)
    y_MxD = groups.from_rows(expert_matmul(gelu_tanh(gate) * up, experts["down"], groups))
    y_MxD = y_MxD * row_weights_M[:, None].astype(y_MxD.dtype)
  return jnp.zeros((n, d), y_MxD.dtype).at[token_M].add(y_MxD)


def moe_per_batch_shard(x_NxD, weights_Nxk, index_Nxk, experts: Params, cfg: ModelConfig,
                        shards: int):
  """`moe` run separately on each of `shards` equal row blocks (the batch's device shards).

  One global sort by expert would gather every device's tokens onto every device; per block,
  each device sorts and multiplies only its own rows. Same result as `moe` (the combine is per
  token). LoRA dropout draws a different mask per block. For the "tiled" and "tiled_scan"
  layouts (vmapped).
  """
  def split(a):
    a = a.reshape(shards, -1, *a.shape[1:])
    return sharding.constrain(a, ("batch",) + (None,) * (a.ndim - 1))

  def one_block(x, weights, index, block):
    fold = lambda w: (dataclasses.replace(w, dropout_key=jax.random.fold_in(w.dropout_key, block))
                      if isinstance(w, lora.LoraWeight) and w.dropout_key is not None else w)
    block_experts = jax.tree_util.tree_map(fold, experts,
                                           is_leaf=lambda w: isinstance(w, lora.LoraWeight))
    return moe(x, weights, index, block_experts, cfg)

  y = jax.vmap(one_block)(split(x_NxD), split(weights_Nxk), split(index_Nxk), jnp.arange(shards))
  return y.reshape(x_NxD.shape)


def moe_expert_parallel(x_BxTxD, weights_BxTxk, index_BxTxk, experts: Params, cfg: ModelConfig):
  """`moe` with the experts split over devices (moe_impl="expert_parallel"), [B, T, D].

  Under `sharding.activation_rules` whose mesh splits the stacked experts (rule "experts", e.g.
  "fsdp"; nothing else of an expert weight may be split), each device holds E/n experts and,
  in a `jax.shard_map`:
    1. all-gathers the tokens, combine weights and expert indices of the devices it shares
       experts with (the expert axes that also split the batch; a few MB per layer);
    2. runs `moe` on every gathered assignment routed to ITS experts, exactly (no capacity, no
       dropped tokens; the tile loop runs only over the tiles those rows fill);
    3. sums the partial outputs back onto the tokens' owners (psum_scatter; a psum over expert
       axes that do not split the batch).
  The weight gradient of a device's experts is therefore computed where they live, with no
  all-reduce of a full [E, D, 2I] gradient, and no expert weight is ever gathered. Outside
  `activation_rules`, or on one device, it is plain `moe` over all experts.
  """
  b, t, d = x_BxTxD.shape
  top_k = index_BxTxk.shape[-1]
  flat = lambda a: a.reshape(b * t, a.shape[-1])
  mesh = sharding.active_mesh()
  if mesh is None:
    return moe(flat(x_BxTxD), flat(weights_BxTxk), flat(index_BxTxk), experts, cfg).reshape(
        x_BxTxD.shape)
  num_experts = _array(experts["gate_up"]).shape[0]

  def spec(path, x):
    return sharding.active_spec(sharding.logical_axes(path, x.ndim), x.shape)

  def weight_specs(name, w):
    if isinstance(w, lora.LoraWeight):
      return dataclasses.replace(
          w, base=spec(f"experts.{name}", w.base), a=spec(f"experts.{name}.a", w.a),
          b=spec(f"experts.{name}.b", w.b),
          dropout_key=None if w.dropout_key is None else jax.sharding.PartitionSpec())
    return spec(f"experts.{name}", w)

  expert_specs = {name: weight_specs(name, w) for name, w in experts.items()}
  gate_up_spec = expert_specs["gate_up"]
  if isinstance(gate_up_spec, lora.LoraWeight):
    gate_up_spec = gate_up_spec.base
  expert_axes = sharding.entry_axes(gate_up_spec[0])
  for leaf in jax.tree_util.tree_leaves(
      expert_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)):
    if len(leaf) and (sharding.entry_axes(leaf[0]) != expert_axes or any(leaf[1:])):
      raise errors.ConfigError(
          f"moe_impl='expert_parallel' splits the stacked experts over devices and nothing "
          f"else of their weights; the sharding rules give {leaf} (set e.g. "
          "--config.sharding.rules.experts=fsdp, and no tensor axis on expert_mlp)")
  if not expert_axes:
    raise errors.ConfigError(
        "moe_impl='expert_parallel' needs the stacked experts split over devices: map "
        f"sharding.rules.experts to a mesh axis whose size divides {num_experts} (e.g. "
        "--config.sharding.rules.experts=fsdp)")
  batch_axes = sharding.entry_axes(sharding.active_spec(("batch",), (b,))[0])
  gather_axes = tuple(a for a in expert_axes if a in batch_axes)
  sum_axes = tuple(a for a in expert_axes if a not in batch_axes)
  local_experts = num_experts // int(np.prod([mesh.shape[a] for a in expert_axes]))

  def local(x_btD, weights_btk, index_btk, experts_here):
    if gather_axes:
      x_btD, weights_btk, index_btk = (
          jax.lax.all_gather(a, gather_axes, axis=0, tiled=True)
          for a in (x_btD, weights_btk, index_btk))
    first = jax.lax.axis_index(expert_axes) * local_experts
    n = x_btD.shape[0] * t
    y = moe(x_btD.reshape(n, d), weights_btk.reshape(n, top_k),
            index_btk.reshape(n, top_k) - first, experts_here, cfg, some_elsewhere=True)
    y = y.reshape(x_btD.shape)
    if gather_axes:
      y = jax.lax.psum_scatter(y, gather_axes, scatter_dimension=0, tiled=True)
    if sum_axes:
      y = jax.lax.psum(y, sum_axes)
    return y

  tokens = jax.sharding.PartitionSpec(batch_axes or None)
  return jax.shard_map(local, mesh=mesh, in_specs=(tokens, tokens, tokens, expert_specs),
                       out_specs=tokens, check_vma=False)(
                           x_BxTxD, weights_BxTxk, index_BxTxk, experts)


def _array(w):
  return w.base if isinstance(w, lora.LoraWeight) else w


class ExpertGroups(NamedTuple):
  """How rows sorted by expert meet their expert's weights.

  "ragged_dot": rows stay [M, ...] and `group_sizes_E` says which expert owns which run.
  "tiled": each group is padded to a multiple of `tile` rows, so every tile of the padded
  [tiles, tile, ...] layout belongs to one expert (`tile_expert_T`); the layout has a static
  bound of ceil(M / tile) + E tiles. With `used_tiles` (rows past the groups' total belong to
  no expert here), those rows are dropped and only the first `used_tiles` tiles hold rows.
  """
  group_sizes_E: jnp.ndarray
  tile_expert_T: jnp.ndarray | None = None
  row_M: jnp.ndarray | None = None  # padded-row index of each sorted row (tiled only)
  tile: int = 0
  one_tile_at_a_time: bool = False  # "tiled_scan" / "expert_parallel": a loop over tiles
  used_tiles: jnp.ndarray | None = None  # tiles holding rows (None: all; tiled only)

  @classmethod
  def make(cls, group_sizes_E, m: int, cfg: ModelConfig, some_elsewhere: bool = False
           ) -> ExpertGroups:
    if cfg.moe_impl == "ragged_dot":
      return cls(group_sizes_E)
    num_experts = group_sizes_E.shape[0]
    tile = min(cfg.moe_tile_size, max(m, 1))
    num_tiles = -(-m // tile) + num_experts
    padded_sizes_E = -(-group_sizes_E // tile) * tile
    padded_end_E = jnp.cumsum(padded_sizes_E)
    group_start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
    expert_M = jnp.repeat(jnp.arange(num_experts), group_sizes_E, total_repeat_length=m)
    row_M = (padded_end_E - padded_sizes_E)[expert_M] + jnp.arange(m) - group_start_E[expert_M]
    used_tiles = None
    if some_elsewhere:  # rows past the groups: out of the padded layout's range
      row_M = jnp.where(jnp.arange(m) < jnp.sum(group_sizes_E), row_M, num_tiles * tile)
      used_tiles = padded_end_E[-1] // tile
    tile_expert_T = jnp.minimum(
        jnp.searchsorted(padded_end_E, jnp.arange(num_tiles) * tile, side="right"),
        num_experts - 1)
    return cls(group_sizes_E, tile_expert_T, row_M, tile,
               cfg.moe_impl in ("tiled_scan", "expert_parallel"), used_tiles)

  def to_rows(self, x_MxD):
    if self.tile_expert_T is None:
      return x_MxD
    num_tiles, d = self.tile_expert_T.shape[0], x_MxD.shape[-1]
    padded = jnp.zeros((num_tiles * self.tile, d), x_MxD.dtype)
    if self.used_tiles is None:
      padded = padded.at[self.row_M].set(x_MxD)
    else:
      padded = padded.at[self.row_M].set(x_MxD, mode="drop")
    return padded.reshape(num_tiles, self.tile, d)

  def from_rows(self, rows):
    if self.tile_expert_T is None:
      return rows
    rows = rows.reshape(-1, rows.shape[-1])
    if self.used_tiles is None:
      return rows[self.row_M]
    return rows.at[self.row_M].get(mode="fill", fill_value=0)


def expert_matmul(rows, w, groups: ExpertGroups, frozen: bool = False):
  """Each row (in `groups`' layout) times its expert's matrix, w [E, in, out]; a LoraWeight adds
  its per-expert low-rank path, (rows @ A_e) @ B_e, in the same grouped layout. `frozen`: w gets
  no gradient (a LoRA base, or any quantized weight), so "tiled_scan" does not accumulate one."""
  if isinstance(w, lora.LoraWeight):
    low_rank = expert_matmul(expert_matmul(w.low_rank_input(rows), w.a, groups), w.b, groups)
    return (expert_matmul(rows, w.base, groups, frozen=True)
            + jnp.asarray(w.scale, rows.dtype) * low_rank)
  if groups.tile_expert_T is None:
    return jax.lax.ragged_dot(rows, w.astype(rows.dtype), groups.group_sizes_E)
  if groups.one_tile_at_a_time:
    frozen = frozen or isinstance(w, quantize.QuantizedWeight)
    return _tile_matmul_scan(rows, w, groups.tile_expert_T, groups.used_tiles, not frozen)
  return jnp.einsum("nti,nio->nto", rows, w[groups.tile_expert_T].astype(rows.dtype))


def _scan_tiles_with_weights(step, w_ExIxO, init, xs, used=None):
  """lax.scan of step(w, carry, xs) -> (carry, y) that reads an [E, I, O] weight loop-invariantly.
  The weight rides in the loop state behind an optimization barrier so that it looks
  loop-variant: otherwise XLA:CPU converts the whole bf16 weight to float32 for its dots and
  hoists that copy (4 bytes x E x I x O) out of the loop, defeating one-expert-at-a-time.
  With `used` (a traced count), only the first `used` elements of xs are visited (a loop with
  that trip count); the other ys are zeros."""
  def body(state, xs):
    w, carry = jax.lax.optimization_barrier(state)
    carry, y = step(w, carry, xs)
    return (w, carry), y

  if used is None:
    (_, carry), ys = jax.lax.scan(body, (w_ExIxO, init), xs)
    return carry, ys
  first = lambda tree: jax.tree_util.tree_map(lambda x: x[0], tree)
  y_shapes = jax.eval_shape(lambda *a: body(*a)[1], (w_ExIxO, init), first(xs))
  ys = jax.tree_util.tree_map(
      lambda y: jnp.zeros((jax.tree_util.tree_leaves(xs)[0].shape[0],) + y.shape, y.dtype),
      y_shapes)

  def loop_body(i, loop_state):
    state, ys = loop_state
    xs_i = jax.tree_util.tree_map(lambda x: jax.lax.dynamic_index_in_dim(x, i, 0, False), xs)
    state, y = body(state, xs_i)
    ys = jax.tree_util.tree_map(
        lambda buf, y: jax.lax.dynamic_update_index_in_dim(buf, y, i, 0), ys, y)
    return state, ys

  (_, carry), ys = jax.lax.fori_loop(0, used, loop_body, ((w_ExIxO, init), ys))
  return carry, ys


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _tile_matmul_scan(rows_NxtxI, w_ExIxO, tile_expert_N, used_tiles, weight_grad: bool):
  """Tile n's rows times its expert's matrix, [N, t, I] x [E, I, O] -> [N, t, O], one tile per
  lax.scan step: only one expert's matrix is gathered at a time (the batched form gathers as
  much as all the layer's experts). The backward pass loops the same way; with `weight_grad`
  False it returns a zero weight gradient instead of carrying an [E, I, O] float32 sum through
  the loop (XLA does not remove unused loop state). `used_tiles` (None: all) is a traced
  count: tiles from it on hold no rows and are skipped, forward and backward."""
  def step(w, _, xs):
    rows_txI, expert = xs
    return None, rows_txI @ w[expert].astype(rows_txI.dtype)

  return _scan_tiles_with_weights(step, w_ExIxO, None, (rows_NxtxI, tile_expert_N),
                                  used_tiles)[1]


def _tile_matmul_scan_fwd(rows_NxtxI, w_ExIxO, tile_expert_N, used_tiles, weight_grad):
  out = _tile_matmul_scan(rows_NxtxI, w_ExIxO, tile_expert_N, used_tiles, weight_grad)
  return out, (rows_NxtxI, w_ExIxO, tile_expert_N, used_tiles)


def _tile_matmul_scan_bwd(weight_grad, residuals, grad_NxtxO):
  rows_NxtxI, w_ExIxO, tile_expert_N, used_tiles = residuals
  xs = (rows_NxtxI, grad_NxtxO, tile_expert_N)

  def grad_rows_step(w, rows_txI, grad_txO, expert):
    return (grad_txO @ w[expert].astype(grad_txO.dtype).T).astype(rows_txI.dtype)

  if not weight_grad:
    grad_rows = _scan_tiles_with_weights(lambda w, _, xs: (None, grad_rows_step(w, *xs)),
                                         w_ExIxO, None, xs, used_tiles)[1]
    return grad_rows, jax.tree_util.tree_map(_zero_cotangent, w_ExIxO), None, None

  def step(w, grad_w, xs):
    rows_txI, grad_txO, expert = xs
    grad_w = grad_w.at[expert].add((rows_txI.T @ grad_txO.astype(rows_txI.dtype)).astype(
        grad_w.dtype))
    return grad_w, grad_rows_step(w, *xs)

  grad_w, grad_rows = _scan_tiles_with_weights(
      step, w_ExIxO, jnp.zeros(w_ExIxO.shape, jnp.float32), xs, used_tiles)
  return grad_rows, grad_w.astype(w_ExIxO.dtype), None, None


def _zero_cotangent(x):
  """A zero cotangent for x (float0 for the integer values of a quantized weight)."""
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


_tile_matmul_scan.defvjp(_tile_matmul_scan_fwd, _tile_matmul_scan_bwd)


# ----------------------------------------------------------------------------- one layer


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


# ----------------------------------------------------------------------------- embeddings & head


@jax.named_scope("embedding")
def embed(params: Params, tokens_BxT, cfg: ModelConfig):
  """Scaled embedding lookup; the reference rounds sqrt(D) to the weight dtype."""
  table = params["embedding"]
  scale = jnp.asarray(cfg.hidden_size ** 0.5, table.dtype)
  return sharding.constrain((table[tokens_BxT] * scale).astype(cfg.compute_dtype), sharding.HIDDEN)


@jax.named_scope("lm_head")
def lm_head(params: Params, h_BxTxD, cfg: ModelConfig):
  """Tied-embedding logits in float32, soft-capped: cap * tanh(logits / cap)."""
  logits = (h_BxTxD @ params["embedding"].astype(h_BxTxD.dtype).T).astype(jnp.float32)
  cap = cfg.final_logit_softcap
  return sharding.constrain(cap * jnp.tanh(logits / cap), sharding.LOGITS)


@jax.named_scope("self_conditioning")
def self_conditioning_embedding(params: Params, logits_BxCxV, cfg: ModelConfig):
  """softmax(previous logits) @ embedding * sqrt(D): the decoder's soft input."""
  return soft_embedding(params, jax.nn.softmax(logits_BxCxV.astype(jnp.float32), axis=-1), cfg)


def soft_embedding(params: Params, probs_BxCxV, cfg: ModelConfig, token_ids_BxCxK=None):
  """probs @ embedding * sqrt(D), [B, C, D] in the compute dtype.

  With `token_ids_BxCxK`, probs_BxCxK is a distribution over those K tokens only (a top-k
  truncation): K embedding rows are gathered instead of a [V, D] matmul.
  """
  table = params["embedding"]
  probs = probs_BxCxV.astype(table.dtype)
  if token_ids_BxCxK is None:
    # Batch-sharded probabilities and a hidden-layout output: otherwise the partitioner may
    # gather the [B, C, V] probabilities onto every device rather than reduce the [B, C, D]
    # product.
    soft = sharding.constrain(probs, sharding.LOGITS) @ table
  else:
    soft = jnp.einsum("bck,bckd->bcd", probs, table[token_ids_BxCxK])
  soft = (soft * jnp.asarray(cfg.hidden_size ** 0.5, table.dtype)).astype(cfg.compute_dtype)
  return sharding.constrain(soft, sharding.HIDDEN)


# ----------------------------------------------------------------------------- cache


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> Cache:
  """An empty static-shape KV cache of `max_len` slots; slot index = token position."""
  dt = jnp.dtype(cfg.compute_dtype)
  layers = []
  for i in range(cfg.num_layers):
    shape = (batch, max_len, cfg.layer_kv_heads(i), cfg.layer_head_dim(i))
    layers.append({"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)})
  return {"layers": layers, "valid": jnp.zeros((batch, max_len), bool),
          "end": jnp.zeros((), jnp.int32)}


# ----------------------------------------------------------------------------- entry points


def encode(params: Params, cfg: ModelConfig, tokens_BxT, cache: Cache, valid_BxT=None):
  """Causal pass over T new tokens written at cache slots [end, end+T).

  Args:
    tokens_BxT: int tokens; `valid_BxT` marks real tokens (False = padding, never attended).
    cache: from `init_cache` or a previous `encode`; positions are cache slot indices.
  Returns:
    (hidden_BxTxD after the final norm, updated cache with end += T).
  A thin wrapper: `Model.encode` is the network.
  """
  return Model(cfg).apply(to_variables(params), tokens_BxT, cache, valid_BxT,
                                  method=Model.encode)


def decode(params: Params, cfg: ModelConfig, canvas_BxC, cache: Cache, prefix_len_B=None,
           self_cond_logits_BxCxV=None, self_cond_mask_B=None, self_cond_embedding_BxCxD=None):
  """Bidirectional denoiser over a canvas; returns float32 logits [B, C, V].

  The canvas occupies positions prefix_len .. prefix_len + C - 1 and sees cached slots
  j < prefix_len that are valid (sliding layers: only the last window-1 of them). Self-
  conditioning logits are optional; examples with `self_cond_mask_B` False get zeros. A
  precomputed `self_cond_embedding_BxCxD` (`soft_embedding` of the previous probabilities, as
  the fused sampling step makes it) replaces the logits.
  `prefix_len_B` defaults to the cache end (sampling); training passes a per-example value.
  A thin wrapper: `Model.decode` is the network.
  """
  return Model(cfg).apply(to_variables(params), canvas_BxC, cache, prefix_len_B,
                                  self_cond_logits_BxCxV, self_cond_mask_B,
                                  self_cond_embedding_BxCxD, method=Model.decode)


# ----------------------------------------------------------------------------- init


@functools.partial(jax.jit, static_argnums=(2, 3))
def _normal_leaf(key, std, shape, dtype):
  """std * normal(key, shape) in `dtype`: one small program per (shape, dtype)."""
  return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _ones_leaf(shape, dtype):
  return jnp.ones(shape, dtype)


def init_params(cfg: ModelConfig, rng, std: float | None = None) -> Params:
  """Random parameters: `Model(cfg).init` as a `Params` tree (normal(std) linears and
  embedding, std defaulting to cfg.initializer_range; unit norms and scales; q/k norms at
  cfg.qk_norm_init).

  The normal draws take the keys this function has always used (one split of `rng`, layer by
  layer, then the embedding, then the self-conditioning block), so a seed gives the same weights
  as before the  Each leaf is drawn by a small jitted program per distinct shape (a few
  compiles, reused across layers and models): one program holding every leaf's draw took
  XLA:CPU ~20 s to compile for the 7-layer test model, far more than the draws.
  """
  return from_variables(init_variables(cfg, rng, std))


@functools.partial(jax.jit, static_argnums=(0, 2))
def init_self_conditioning(cfg: ModelConfig, rng, std: float | None = None) -> Params:
  """A fresh self-conditioning block, initialised as `init_params` does (for a decoder built
  from a Gemma 4 AR backbone, which has none)."""
  std = cfg.initializer_range if std is None else std
  with draw_keys(jax.random.split(rng, 3)):
    variables = SelfConditioning(cfg, std, 0).init(
        rng, method=SelfConditioning.declare)
  return dict(nn.unbox(variables)["params"])


def abstract_params(cfg: ModelConfig) -> Params:
  """Shapes and dtypes of the parameters (of `Model(cfg).init`), without allocating."""
  return jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))


def param_counts(cfg: ModelConfig) -> dict[str, int]:
  """Total and per-token active parameter counts of a config (no weights allocated).

  "Active" counts what one token's forward pass touches: the embedding (tied with the LM head),
  every attention, dense-MLP, router and norm weight, and top_k of num_experts experts per layer.
  The self-conditioning block is decoder-only and reported separately; `total` and `active`
  exclude it, as the backbone counts of Gemma 4 do.
  """
  shapes = abstract_params(cfg)
  size = lambda tree: int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
  self_cond = size(shapes["self_conditioning"])
  backbone = size(shapes) - self_cond
  experts = sum(size(layer["experts"]) for layer in shapes["layers"])
  active_experts = experts * cfg.top_k_experts // cfg.num_experts
  return {"total": backbone, "active": backbone - experts + active_experts,
          "embedding": size(shapes["embedding"]), "experts": experts,
          "self_conditioning": self_cond}


def count_params(params: Params) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


# ============================================================================= flax.linen modules
#
# Module tree (the `params` collection it owns; linear weights are [in, out]):
#
#     Model                              encode / decode / lm_head via apply(..., method=...)
#     ├── Embedder        embedding [V, D]                (shares Model's scope)
#     ├── RMSNorm         final_norm [D]                  (shares Model's scope)
#     ├── layers_{i}: Layer
#     │   ├── attn: Attention     q [D,H,hd], k [D,K,hd], v [D,K,hd] (sliding layers only),
#     │   │                       o [H,hd,D], q_norm [hd], k_norm [hd]; the Pallas kernel or XLA
#     │   │                       attention as cfg.attention_impl says
#     │   ├── mlp: MLP            gate [D,F], up [D,F], down [F,D]
#     │   ├── router: Router      proj [D,E], scale [D], per_expert_scale [E]
#     │   ├── experts: Experts    gate_up [E,D,2I], down [E,I,D]; cfg.moe_impl's grouped matmul
#     │   ├── RMSNorm x 7         input_norm, post_attn_norm, pre_ffw_norm, post_ffw_norm,
#     │   │                       post_ffw_norm_1, pre_ffw_norm_2, post_ffw_norm_2 [D] (shared scope)
#     │   └── layer_scalar []
#     └── self_conditioning: SelfConditioning
#         ├── RMSNorm pre_norm [D]          (shared scope)
#         └── MLP gate, up, down            (shared scope)
#
# The modules own the parameters and call the pure functions above for the math
# (`rms_norm`, `project_qkv`, `attention`, `route`, `moe`, ...), so XLA sees the program the
# function form built. `nn.share_scope` keeps each norm's weight (and the self-conditioning MLP's)
# a leaf of its parent, as the parameter tree has always had it.
#
# The one difference between the linen `params` collection and `network.Params` (the tree every
# checkpoint, the HF converter, LoRA, QLoRA, sharding and the memory plans use) is the layers:
# a Python list `params["layers"]` there, submodules `layers_0`, `layers_1`, ... here.
# `to_variables` and `from_variables` map one to the other (no array is touched); `encode`,
# `decode` and `init_params` call them, so nothing outside this file sees linen's names.
#
# Parameters are read with `get_variable` outside init rather than `self.param`: a weight may be a
# `lora.LoraWeight` or a `quantize.QuantizedWeight` (pytrees whose leaves are not the weight's
# shape), which `self.param`'s shape check would reject.


# ----------------------------------------------------------------------------- initialisers

# Per-leaf PRNG keys of the draw `network.init_params` has always made (one split of the seed,
# consumed layer by layer, then the embedding, then the self-conditioning block): while set,
# each normal initialiser takes the key of its draw index instead of linen's per-path key, so a
# seed gives the same weights as before the modules.
_DRAW_KEYS = contextvars.ContextVar("diffgemma_draw_keys", default=None)


@contextlib.contextmanager
def draw_keys(keys):
  token = _DRAW_KEYS.set(keys)
  try:
    yield
  finally:
    _DRAW_KEYS.reset(token)


def normal_init(std: float, draw: int):
  def init(key, shape, dtype):
    keys = _DRAW_KEYS.get()
    if keys is not None:
      key = keys[draw]
    return _normal_leaf(key, jnp.float32(std), tuple(shape), jnp.dtype(dtype))
  return init


def ones_init(value: float = 1.0):
  def init(key, shape, dtype):
    del key
    ones = _ones_leaf(tuple(shape), jnp.dtype(dtype))
    return ones if value == 1.0 else value * ones
  return init


def layer_draw_offsets(cfg: ModelConfig) -> list[int]:
  """Index of each layer's first normal draw: q, k, o, (v), mlp gate/up/down, router proj,
  experts gate_up/down per layer; the embedding and the self-conditioning block follow."""
  offsets, n = [], 0
  for lt in cfg.layer_types:
    offsets.append(n)
    n += 9 + (lt == SLIDING)
  return offsets + [n]


def num_draws(cfg: ModelConfig) -> int:
  return 8 + 12 * cfg.num_layers  # the split init_params has always made


class _Module(nn.Module):
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


class RMSNorm(_Module):
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


def _norms(names, dim: int, cfg: ModelConfig) -> dict[str, RMSNorm]:
  """RMSNorms for `setup`; assign them, then `_share(self, self.norms)`."""
  return {n: RMSNorm(n, dim, cfg.rms_norm_eps, cfg.param_dtype) for n in names}


def _share(parent: nn.Module, children) -> None:
  for child in children.values():
    nn.share_scope(parent, child)


class Embedder(_Module):
  """The tied embedding: token lookup, soft embedding (self-conditioning) and the LM head."""
  cfg: ModelConfig
  std: float
  draw: int

  def setup(self):
    cfg = self.cfg
    self.embedding = self.weight("embedding", normal_init(self.std, self.draw),
                                 (cfg.vocab_size, cfg.hidden_size), cfg.param_dtype,
                                 ("vocab", "embed"))

  def _params(self):
    return {"embedding": self.embedding}

  def encode(self, tokens_BxT):
    chex.assert_rank(tokens_BxT, 2)
    return embed(self._params(), tokens_BxT, self.cfg)

  def decode(self, h_BxTxD):
    chex.assert_axis_dimension(h_BxTxD, -1, self.cfg.hidden_size)
    return lm_head(self._params(), h_BxTxD, self.cfg)

  def self_conditioning(self, logits_BxCxV):
    chex.assert_axis_dimension(logits_BxCxV, -1, self.cfg.vocab_size)
    return self_conditioning_embedding(self._params(), logits_BxCxV, self.cfg)


class MLP(_Module):
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


class Attention(_Module):
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


class Router(_Module):
  """Gemma 4 router: top-k of a float32 softmax, renormalised, times the per-expert scale."""
  cfg: ModelConfig
  std: float
  draw: int

  def setup(self):
    d, e, dt = self.cfg.hidden_size, self.cfg.num_experts, self.cfg.param_dtype
    self.proj = self.weight("proj", normal_init(self.std, self.draw), (d, e), dt,
                            ("embed", "router_experts"))
    self.scale = self.weight("scale", ones_init(), (d,), dt)
    self.per_expert_scale = self.weight("per_expert_scale", ones_init(), (e,), dt)

  def __call__(self, x_NxD):
    chex.assert_rank(x_NxD, 2)
    router = {"proj": self.proj, "scale": self.scale, "per_expert_scale": self.per_expert_scale}
    return route(x_NxD, router, self.cfg)


class Experts(_Module):
  """The stacked experts, run by cfg.moe_impl (`network.moe` and its sharded forms)."""
  cfg: ModelConfig
  std: float
  draw: int

  def setup(self):
    cfg, dt = self.cfg, self.cfg.param_dtype
    d, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    self.gate_up = self.weight("gate_up", normal_init(self.std, self.draw), (e, d, 2 * i), dt,
                               ("experts", "embed", "expert_mlp"))
    self.down = self.weight("down", normal_init(self.std, self.draw + 1), (e, i, d), dt,
                            ("experts", "expert_mlp", "embed"))

  def __call__(self, x_NxD, weights_Nxk, index_Nxk, batch: int, length: int):
    """Combined expert outputs [N, D] for inputs x [N = batch * length, D]."""
    chex.assert_equal_shape([weights_Nxk, index_Nxk])
    experts = {"gate_up": self.gate_up, "down": self.down}
    cfg = self.cfg
    shards = sharding.batch_shards(batch)
    if cfg.moe_impl == "expert_parallel":
      return moe_expert_parallel(*(a.reshape((batch, length) + a.shape[1:])
                                     for a in (x_NxD, weights_Nxk, index_Nxk)), experts, cfg)
    # ragged_dot has no batching rule for this vmap; pallas is untested under it.
    if shards == 1 or cfg.moe_impl not in ("tiled", "tiled_scan"):
      return moe(x_NxD, weights_Nxk, index_Nxk, experts, cfg)
    return moe_per_batch_shard(x_NxD, weights_Nxk, index_Nxk, experts, cfg, shards)


LAYER_NORMS = ("input_norm", "post_attn_norm", "pre_ffw_norm", "post_ffw_norm", "post_ffw_norm_1",
               "pre_ffw_norm_2", "post_ffw_norm_2")


class Layer(_Module):
  """Pre/post-normed attention, then the parallel dense + MoE block, then the layer scalar."""
  cfg: ModelConfig
  index: int
  std: float

  def setup(self):
    cfg, i = self.cfg, self.index
    draw = layer_draw_offsets(cfg)[i]
    layer_type = cfg.layer_types[i]
    self.attn = Attention(cfg, layer_type, cfg.layer_head_dim(i), cfg.layer_kv_heads(i), self.std,
                          draw)
    after_attn = draw + 3 + (layer_type == SLIDING)
    self.mlp = MLP(cfg, self.std, after_attn)
    self.router = Router(cfg, self.std, after_attn + 3)
    self.experts = Experts(cfg, self.std, after_attn + 4)
    self.norms = _norms(LAYER_NORMS, cfg.hidden_size, cfg)
    _share(self, self.norms)
    self.layer_scalar = self.weight("layer_scalar", ones_init(), (), cfg.param_dtype)

  def declare(self):
    """Creates every parameter (`Model.declare`)."""
    for sub in (self.attn, self.mlp, self.router, self.experts, *self.norms.values()):
      sub.declare()

  def __call__(self, h_BxTxD, positions_BxT, attend: Callable):
    """`attend(q, k, v) -> (out_BxTxHxd, extra)` is the encoder's or decoder's attention."""
    chex.assert_rank(h_BxTxD, 3)
    norm = self.norms
    # Named scopes label the compiled operations (benchmarks/step_profile.py reads them).
    with jax.named_scope("attention"):
      q, k, v = self.attn.project(norm["input_norm"](h_BxTxD), positions_BxT)
      attn_out, extra = attend(q, k, v)
      h = h_BxTxD + norm["post_attn_norm"](self.attn.out(attn_out))
    h = h + self.feed_forward(h)
    # layer_scalar is a fixed buffer in the reference, never trained.
    h = h * jax.lax.stop_gradient(self.layer_scalar).astype(h.dtype)
    chex.assert_equal_shape([h, h_BxTxD])
    return sharding.constrain(h, sharding.HIDDEN), extra

  def feed_forward(self, h_BxTxD):
    """Dense MLP and MoE in parallel from the residual stream h (the router reads h itself)."""
    norm = self.norms
    with jax.named_scope("dense_mlp"):
      dense = norm["post_ffw_norm_1"](self.mlp(norm["pre_ffw_norm"](h_BxTxD)))
    with jax.named_scope("moe"):
      b, t, d = h_BxTxD.shape
      h_NxD = h_BxTxD.reshape(-1, d)
      weights, index = self.router(h_NxD)
      sparse = self.experts(norm["pre_ffw_norm_2"](h_NxD), weights, index, b, t)
      sparse = norm["post_ffw_norm_2"](sparse.reshape(h_BxTxD.shape))
    return norm["post_ffw_norm"](dense + sparse)


class SelfConditioning(_Module):
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


class Model(_Module):
  """The DiffusionGemma network: `encode`, `decode` and `lm_head` (use them through
  `Model(cfg).apply({"params": to_variables(params)}, ..., method=Model.encode)`, or the
  `network` functions of the same names, which do exactly that)."""
  cfg: ModelConfig
  init_std: float | None = None  # None: cfg.initializer_range

  def setup(self):
    cfg = self.cfg
    std = cfg.initializer_range if self.init_std is None else self.init_std
    offsets = layer_draw_offsets(cfg)
    self.layers = [Layer(cfg, i, std) for i in range(cfg.num_layers)]
    self.embedder = Embedder(cfg, std, offsets[-1])
    nn.share_scope(self, self.embedder)
    self.norms = _norms(("final_norm",), cfg.hidden_size, cfg)
    _share(self, self.norms)
    self.self_conditioning = SelfConditioning(cfg, std, offsets[-1] + 1)

  def declare(self):
    """Creates every parameter without running the network: `Model(cfg).init(rng,
    method=Model.declare)`."""
    for layer in self.layers:
      layer.declare()
    self.embedder.declare()
    self.norms["final_norm"].declare()
    self.self_conditioning.declare()

  def lm_head(self, h_BxTxD):
    return self.embedder.decode(h_BxTxD)

  def _run_layer(self, i: int, h_BxTxD, positions_BxT, attend):
    """Layer i under the config's rematerialisation policy (cfg.remat).

    The layer runs as a pure function of its parameter subtree, which passes an optimization
    barrier with the layer's input first: a sharded weight's all-gather can then not be
    scheduled before the previous layer is done (else every layer's gathered weights may be
    live at once).
    """
    cfg = self.cfg
    layer_params = self.get_variable("params", f"layers_{i}")
    layer = Layer(cfg, i, self.layers[i].std, parent=None)

    def fn(h, params):
      h, params = jax.lax.optimization_barrier((h, params))
      # The q/k/v projections read the weights from outside the barrier (and, under remat,
      # from outside the checkpointed function): the program the function form always built.
      params = {**params, "attn": {**params["attn"], **{
          k: w for k, w in layer_params["attn"].items() if k != "o"}}}
      return layer.apply({"params": params}, h, positions_BxT, attend)

    if cfg.remat == "full":
      fn = jax.checkpoint(fn)
    elif cfg.remat == "dots":
      fn = jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return fn(h_BxTxD, layer_params)

  def encode(self, tokens_BxT, cache, valid_BxT=None):
    """`network.encode`: causal pass over T new tokens written at cache slots [end, end+T)."""
    cfg = self.cfg
    chex.assert_rank(tokens_BxT, 2)
    chex.assert_type(tokens_BxT, int)
    b, t = tokens_BxT.shape
    chex.assert_shape(cache["valid"], (b, None))
    start = cache["end"]
    if valid_BxT is None:
      valid_BxT = jnp.ones((b, t), bool)
    chex.assert_shape(valid_BxT, (b, t))
    positions_BxT = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
    kv_valid_BxS = jax.lax.dynamic_update_slice(cache["valid"], valid_BxT, (0, start))
    num_slots = kv_valid_BxS.shape[1]
    kv_pos_BxS = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), (b, num_slots))
    masks = layer_mask_specs(cfg, positions_BxT, positions_BxT, kv_pos_BxS, kv_valid_BxS)

    h = self.embedder.encode(tokens_BxT)
    new_layers = []
    for i, layer_type in enumerate(cfg.layer_types):
      layer_cache = cache["layers"][i]

      def attend(q, k, v, layer_type=layer_type, layer_cache=layer_cache):
        k_all = jax.lax.dynamic_update_slice(layer_cache["k"], k.astype(layer_cache["k"].dtype),
                                             (0, start, 0, 0))
        v_all = jax.lax.dynamic_update_slice(layer_cache["v"], v.astype(layer_cache["v"].dtype),
                                             (0, start, 0, 0))
        out = attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype), masks[layer_type],
                          cfg)
        return out, {"k": k_all, "v": v_all}

      h, new_cache = self._run_layer(i, h, positions_BxT, attend)
      new_layers.append(new_cache)
    h = self.norms["final_norm"](h)
    return h, {"layers": new_layers, "valid": kv_valid_BxS, "end": start + t}

  def decode(self, canvas_BxC, cache, prefix_len_B=None, self_cond_logits_BxCxV=None,
             self_cond_mask_B=None, self_cond_embedding_BxCxD=None):
    """`network.decode`: the bidirectional denoiser over a canvas; float32 logits [B, C, V]."""
    cfg = self.cfg
    chex.assert_rank(canvas_BxC, 2)
    chex.assert_type(canvas_BxC, int)
    b, c = canvas_BxC.shape
    if prefix_len_B is None:
      prefix_len_B = jnp.broadcast_to(cache["end"], (b,))
    chex.assert_shape(prefix_len_B, (b,))
    prefix_len_B = prefix_len_B.astype(jnp.int32)
    positions_BxC = prefix_len_B[:, None] + jnp.arange(c, dtype=jnp.int32)
    num_slots = cache["valid"].shape[1]
    slot_BxS = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), (b, num_slots))
    kv_pos = jnp.concatenate([slot_BxS, positions_BxC], axis=1)
    kv_valid = jnp.concatenate(
        [cache["valid"] & (slot_BxS < prefix_len_B[:, None]), jnp.ones((b, c), bool)], axis=1)
    anchor_BxC = jnp.broadcast_to(prefix_len_B[:, None], (b, c))
    limit_BxC = anchor_BxC + c - 1
    masks = layer_mask_specs(cfg, anchor_BxC, limit_BxC, kv_pos, kv_valid)

    x = self.embedder.encode(canvas_BxC)
    if self_cond_embedding_BxCxD is not None:
      chex.assert_shape(self_cond_embedding_BxCxD, (b, c, cfg.hidden_size))
      soft = self_cond_embedding_BxCxD.astype(x.dtype)
    elif self_cond_logits_BxCxV is not None:
      chex.assert_shape(self_cond_logits_BxCxV, (b, c, cfg.vocab_size))
      soft = self.embedder.self_conditioning(self_cond_logits_BxCxV)
    else:
      soft = jnp.zeros_like(x)
    if self_cond_mask_B is not None:
      chex.assert_shape(self_cond_mask_B, (b,))
      soft = soft * self_cond_mask_B.astype(soft.dtype)[:, None, None]
    h = rms_norm(x + self.self_conditioning(soft), None, cfg.rms_norm_eps)

    for i, layer_type in enumerate(cfg.layer_types):
      layer_cache = cache["layers"][i]

      def attend(q, k, v, layer_type=layer_type, layer_cache=layer_cache):
        k_all = jnp.concatenate([layer_cache["k"].astype(q.dtype), k], axis=1)
        v_all = jnp.concatenate([layer_cache["v"].astype(q.dtype), v], axis=1)
        return attention(q, k_all, v_all, masks[layer_type], cfg), None

      h, _ = self._run_layer(i, h, positions_BxC, attend)
    h = self.norms["final_norm"](h)
    logits = self.embedder.decode(h)
    chex.assert_shape(logits, (b, c, cfg.vocab_size))
    return logits


# ----------------------------------------------------------------------------- the params tree


def to_variables(params: Params) -> dict:
  """`network.Params` -> linen variables: params["layers"][i] becomes params["layers_{i}"]."""
  tree = {k: v for k, v in params.items() if k != "layers"}
  tree.update({f"layers_{i}": layer for i, layer in enumerate(params.get("layers", ()))})
  return {"params": tree}


def from_variables(variables) -> Params:
  """Linen variables (or their "params" collection) -> `network.Params` (the inverse; the
  partitioning metadata is dropped)."""
  tree = dict(nn.unbox(variables.get("params", variables)))
  layer_keys = sorted((k for k in tree if k.startswith("layers_")), key=lambda k: int(k[7:]))
  params = {k: v for k, v in tree.items() if not k.startswith("layers_")}
  params["layers"] = [tree[k] for k in layer_keys]
  return params


def init_variables(cfg: ModelConfig, rng, std: float | None = None, boxed: bool = False):
  """Model(cfg).init with the draw of `network.init_params` (same values for the same seed).
  With `boxed`, the leaves keep their `nn.LogicallyPartitioned` metadata."""
  with draw_keys(jax.random.split(rng, num_draws(cfg))):
    variables = Model(cfg, std).init(rng, method=Model.declare)
  return variables if boxed else nn.unbox(variables)


@functools.cache
def logical_axes_table() -> dict[str, tuple[str, ...]]:
  """{weight name: logical axes} from the modules' partitioning metadata ("embedding",
  "attn.q", "experts.gate_up", "self_conditioning.down", ...: the path without "layers_{i}");
  weights without metadata (norms, scales) are absent. sharding.py reads this."""
  cfg = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=4, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=2, global_head_dim=2,
                    num_global_kv_heads=1, num_experts=2, top_k_experts=1,
                    moe_intermediate_size=2, layer_types=(SLIDING, FULL))
  boxed = jax.eval_shape(lambda: init_variables(cfg, jax.random.PRNGKey(0), boxed=True))
  table = {}
  leaves = jax.tree_util.tree_flatten_with_path(
      boxed["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]
  for path, leaf in leaves:
    if isinstance(leaf, nn.LogicallyPartitioned):
      names = [str(k.key) for k in path]
      if names[0].startswith("layers_"):
        names = names[1:]
      table[".".join(names)] = tuple(leaf.names)
  return table


sharding.set_param_axes_source(logical_axes_table)
