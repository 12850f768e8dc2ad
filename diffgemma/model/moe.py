"""Mixture of experts: the router, the grouped expert MLP by cfg.moe_impl (ragged_dot, tiled,
tiled_scan, the Pallas kernel), its per-batch-shard and expert-parallel forms, and the linen
modules `Router` and `Experts` that own their weights.

Shape suffixes as in diffgemma/model/transformer.py (E experts, N tokens, M token-expert
assignments).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from diffgemma import errors
from diffgemma.model import lora, quantize, sharding
from diffgemma.model.config import ModelConfig
from diffgemma.model.initializers import normal_init, ones_init
from diffgemma.model.kernels import moe as moe_kernel
from diffgemma.model.layers import Module, Params, gelu_tanh, linear, rms_norm


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


class Router(Module):
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


class Experts(Module):
  """The stacked experts, run by cfg.moe_impl (`moe` and its sharded forms)."""
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
