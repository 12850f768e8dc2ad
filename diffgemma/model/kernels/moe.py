"""Pallas grouped-matmul expert MLP for the MoE layer (docs/design.md, "Kernels").

`expert_mlp` is a drop-in for the grouped part of `moe.moe`: rows sorted by expert go through
their expert's gated MLP, y = (gelu_tanh(x Wg) * (x Wu)) Wd * row_weight. `moe.moe` calls it
(between its sort and scatter-add) when `moe_impl="pallas"`.

Layout. The wrapper pads every expert's rows to whole tiles of `block_m` rows (as
`model.ExpertGroups` does for moe_impl="tiled"), so a tile never straddles two experts and an
expert with no rows gets no tile. A small int32 schedule (tile -> expert, -1 for the unused tiles at the end of the
static tile bound; expert -> first tile and tile count) travels as ordinary kernel inputs: the
Triton backend has no scalar prefetch, so the kernels read it themselves and index the expert's
weights (whole-array refs, never copied per tile) with it. Unused tiles run no contraction steps
and write zeros. Nothing of size [E, M, D] exists.

Kernels (all accumulate in float32):
  forward   1. gate/up:  per (tile, I block) both halves' matmuls over D, then gelu_tanh(g) * u;
                         writes the [tiles*block_m, I] activation once (the [M, 2I]
                         pre-activation never reaches memory).
            2. down:     per (tile, D block), the row weights applied in the epilogue.
  backward  (Pallas too; the forward activations are recomputed, not saved)
            3. per (tile, I block): recomputes g, u and q = dy Wd^T in one loop over D; writes
               [dg | du] (= d(x gate_up)), the row-weighted activation, and per-I-block partial
               sums of the row-weight gradient.
            4. dx = [dg | du] gate_up^T: kernel 2's machinery with transposed weights.
            5. dW per expert, a transposed grouped matmul: per (expert, K block, N block), a loop
               over that expert's tiles of lhs_tile^T rhs_tile; experts with no rows get zeros.

Numerics. float32 or bfloat16 inputs (weights are cast to x's dtype, as model.moe does), float32
accumulation; the activation and [dg | du] are stored in the input dtype between kernels.
`interpret=None` follows `kernels.platform`: interpret mode on CPU, compiled on GPUs, where the
kernels are written for the Triton backend (power-of-two block sizes >= 16, no scratch, no scalar
prefetch), and a KernelPlatformError elsewhere (TPU).

Shape suffixes: M rows (token-expert assignments), D hidden, I expert intermediate, E experts,
R padded rows (tiles * block_m), T tiles, N tokens, k top-k.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from diffgemma.model.kernels import platform

# gelu_tanh(x) = x * 0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3))), as jax.nn.gelu.
_GELU_SCALE = float(np.sqrt(2.0 / np.pi))
_GELU_CUBIC = 0.044715
_NO_EXPERT = -1  # tile_expert value of the unused tiles past the last expert's tiles
_MIN_COMPILED_BLOCK = 16  # Triton's tl.dot needs M, N, K >= 16


@dataclasses.dataclass(frozen=True)
class _KernelConfig:
  """Static kernel settings (hashable: it is a non-differentiable argument of the custom VJP)."""
  block_m: int
  block_n: int
  block_k: int
  interpret: bool
  guarded: bool  # interpret mode inferred from a CPU trace (see platform.pallas_call)
  num_warps: int | None
  num_stages: int | None


class _Schedule(NamedTuple):
  """Where each row and tile goes in the padded, tile-aligned layout."""
  tile_expert_T: jax.Array  # int32 [T]: the tile's expert, _NO_EXPERT for unused tiles
  tile_start_E: jax.Array  # int32 [E]: the expert's first tile
  tile_count_E: jax.Array  # int32 [E]: the expert's number of tiles (0 for empty experts)
  row_M: jax.Array  # int32 [M]: the row's padded row; R (out of range) past sum(group_sizes)
  valid_M: jax.Array  # bool [M]: the row belongs to some expert


# ----------------------------------------------------------------------------- helpers


def _round_up(value: int, multiple: int) -> int:
  return -(-value // multiple) * multiple


def num_tiles_bound(num_rows: int, num_experts: int, block_m: int) -> int:
  """Static bound on sum_e ceil(g_e / block_m) over the non-empty experts (at most min(E, M))."""
  return (num_rows + min(num_experts, num_rows) * (block_m - 1)) // block_m


def _tile_schedule(group_sizes_E, num_rows: int, block_m: int) -> tuple[_Schedule, int]:
  """The tile schedule of rows sorted by expert, and the static number of tiles T."""
  num_experts = group_sizes_E.shape[0]
  num_tiles = num_tiles_bound(num_rows, num_experts, block_m)
  sizes_E = group_sizes_E.astype(jnp.int32)
  tile_count_E = (sizes_E + block_m - 1) // block_m
  tile_end_E = jnp.cumsum(tile_count_E)
  tile_start_E = tile_end_E - tile_count_E
  tiles_T = jnp.arange(num_tiles, dtype=jnp.int32)
  # side="right" skips empty experts (their end equals the previous expert's end).
  tile_expert_T = jnp.searchsorted(tile_end_E, tiles_T, side="right").astype(jnp.int32)
  tile_expert_T = jnp.where(tiles_T < tile_end_E[-1], tile_expert_T, _NO_EXPERT)
  group_end_E = jnp.cumsum(sizes_E)
  rows_M = jnp.arange(num_rows, dtype=jnp.int32)
  expert_M = jnp.searchsorted(group_end_E, rows_M, side="right")
  valid_M = expert_M < num_experts
  expert_M = jnp.minimum(expert_M, num_experts - 1)
  offset_M = rows_M - (group_end_E - sizes_E)[expert_M]
  row_M = jnp.where(valid_M, tile_start_E[expert_M] * block_m + offset_M, num_tiles * block_m)
  schedule = _Schedule(tile_expert_T, tile_start_E.astype(jnp.int32), tile_count_E,
                       row_M.astype(jnp.int32), valid_M)
  return schedule, num_tiles


def _to_tiles(a_MxK, schedule: _Schedule, num_padded_rows: int, width: int):
  """Rows into the padded tile layout [R, width]; padding rows and columns are zero."""
  out = jnp.zeros((num_padded_rows, width), a_MxK.dtype)
  return out.at[schedule.row_M, :a_MxK.shape[1]].set(a_MxK, mode="drop")


def _from_tiles(a_RxK, schedule: _Schedule, width: int):
  """Rows back from the padded tile layout; rows of no expert are zero."""
  rows = a_RxK.at[schedule.row_M, :width].get(mode="fill", fill_value=0)
  return jnp.where(schedule.valid_M[:, None], rows, jnp.zeros((), a_RxK.dtype))


def _dot(a, b, contract=((1,), (0,))):
  """2-D matmul with float32 accumulation; `contract` picks transposes (Triton lowers them)."""
  return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32)


def _gelu_tanh_and_grad(g):
  """gelu_tanh(g) (jax.nn.gelu's tanh formula) and its derivative, in g's dtype."""
  inner = _GELU_SCALE * (g + _GELU_CUBIC * (g * g * g))
  tanh = jnp.tanh(inner)
  cdf = 0.5 * (1.0 + tanh)
  dinner = _GELU_SCALE * (1.0 + 3.0 * _GELU_CUBIC * (g * g))
  return g * cdf, cdf + 0.5 * g * (1.0 - tanh * tanh) * dinner


def _trip_count(expert, num_k_blocks: int):
  """Contraction steps of a tile: none for unused tiles, which then write zeros.

  A dynamic trip count rather than pl.when: Triton still gets an scf.for (the lowering
  pattern-matches fori loops), and interpret mode avoids a conditional around a loop, which
  copies every whole-array operand (all the expert weights) once per grid step.
  """
  return jnp.where(expert == _NO_EXPERT, 0, num_k_blocks)


def _whole(shape):
  """A BlockSpec for a whole array (the kernel indexes it itself)."""
  return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _pallas_call(kernel, cfg: _KernelConfig, name: str, **kwargs):
  compiler_params = None
  if not cfg.interpret:
    # Ask for Triton explicitly: newer jax defaults pallas_call on GPU to Mosaic GPU.
    from jax.experimental.pallas import triton as pl_triton  # pylint: disable=g-import-not-at-top
    compiler_params = pl_triton.CompilerParams(num_warps=cfg.num_warps,
                                               num_stages=cfg.num_stages)
  return platform.pallas_call(kernel, interpret=cfg.interpret, guarded=cfg.guarded,
                              compiler_params=compiler_params, name=name, **kwargs)


# ----------------------------------------------------------------------------- kernels


def _gate_up_kernel(tile_expert_ref, x_ref, gate_up_ref, act_ref, *, block_k: int):
  """act[tile, I block] = gelu_tanh(x Wg) * (x Wu) for the tile's expert.

  x_ref [bm, Dp] (this tile's rows), gate_up_ref [E, Dp, 2*Ip] (whole), act_ref [bm, bn].
  """
  expert = tile_expert_ref[pl.program_id(0)]
  block_m, block_n = act_ref.shape
  inter_pad = gate_up_ref.shape[2] // 2
  col = pl.multiple_of(pl.program_id(1) * block_n, block_n)

  def body(k, carry):
    gate, up = carry
    kk = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
    x = x_ref[:, kk]
    gate += _dot(x, gate_up_ref[expert, kk, pl.ds(col, block_n)])
    up += _dot(x, gate_up_ref[expert, kk, pl.ds(inter_pad + col, block_n)])
    return gate, up

  zeros = jnp.zeros((block_m, block_n), jnp.float32)
  gate, up = jax.lax.fori_loop(0, _trip_count(expert, x_ref.shape[1] // block_k), body,
                               (zeros, zeros))
  act_ref[...] = (_gelu_tanh_and_grad(gate)[0] * up).astype(act_ref.dtype)


def _grouped_matmul_kernel(tile_expert_ref, lhs_ref, w_ref, *refs, block_k: int,
                           transpose_w: bool, has_scale: bool):
  """out[tile, N block] = lhs[tile] @ W[e] (or W[e]^T), times a per-row scale if given.

  lhs_ref [bm, K]; w_ref [E, K, N] (or [E, N, K] when transpose_w), whole; refs: optional
  scale_ref [bm] (float32), then out_ref [bm, bn].
  """
  scale_ref, out_ref = refs if has_scale else (None, *refs)
  expert = tile_expert_ref[pl.program_id(0)]
  block_m, block_n = out_ref.shape
  cols = pl.ds(pl.multiple_of(pl.program_id(1) * block_n, block_n), block_n)

  def body(k, acc):
    kk = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
    if transpose_w:
      return acc + _dot(lhs_ref[:, kk], w_ref[expert, cols, kk], ((1,), (1,)))
    return acc + _dot(lhs_ref[:, kk], w_ref[expert, kk, cols])

  acc = jax.lax.fori_loop(0, _trip_count(expert, lhs_ref.shape[1] // block_k), body,
                          jnp.zeros((block_m, block_n), jnp.float32))
  if has_scale:
    acc = acc * scale_ref[...][:, None]  # combine weights, in float32 before the cast
  out_ref[...] = acc.astype(out_ref.dtype)


def _activation_grad_kernel(tile_expert_ref, x_ref, dy_ref, gate_up_ref, down_ref, *refs,
                            block_k: int, has_scale: bool):
  """Backward through the activation for one (tile, I block), recomputing g and u.

  With q = dy Wd^T, r the row weight and a = gelu(g) u: da = r q, dg = da u gelu'(g),
  du = da gelu(g), dr = sum_i a q (summed over I blocks by the wrapper).
  x_ref, dy_ref [bm, Dp]; gate_up_ref [E, Dp, 2*Ip], down_ref [E, Ip, Dp] (whole); refs:
  optional scale_ref [bm]; dgu_ref [bm, 2, bn] (the [dg | du] halves); act_ref [bm, bn] (r a,
  the left operand of the down weights' gradient); optional dscale_ref [bm] (float32 partials).
  """
  if has_scale:
    scale_ref, dgu_ref, act_ref, dscale_ref = refs
  else:
    dgu_ref, act_ref = refs
  expert = tile_expert_ref[pl.program_id(0)]
  block_m, block_n = act_ref.shape
  inter_pad = gate_up_ref.shape[2] // 2
  col = pl.multiple_of(pl.program_id(1) * block_n, block_n)

  def body(k, carry):
    gate, up, q = carry
    kk = pl.ds(pl.multiple_of(k * block_k, block_k), block_k)
    x = x_ref[:, kk]
    gate += _dot(x, gate_up_ref[expert, kk, pl.ds(col, block_n)])
    up += _dot(x, gate_up_ref[expert, kk, pl.ds(inter_pad + col, block_n)])
    q += _dot(dy_ref[:, kk], down_ref[expert, pl.ds(col, block_n), kk], ((1,), (1,)))
    return gate, up, q

  zeros = jnp.zeros((block_m, block_n), jnp.float32)
  gate, up, q = jax.lax.fori_loop(0, _trip_count(expert, x_ref.shape[1] // block_k), body,
                                  (zeros,) * 3)
  gelu, dgelu = _gelu_tanh_and_grad(gate)
  act = gelu * up
  if has_scale:
    scale = scale_ref[...][:, None]
    dscale_ref[...] = jnp.sum(act * q, axis=1)
    q, act = q * scale, act * scale
  dgu_ref[:, 0, :] = (q * up * dgelu).astype(dgu_ref.dtype)
  dgu_ref[:, 1, :] = (q * gelu).astype(dgu_ref.dtype)
  act_ref[...] = act.astype(act_ref.dtype)


def _transposed_grouped_matmul_kernel(tile_start_ref, tile_count_ref, lhs_ref, rhs_ref, out_ref,
                                      *, block_m: int):
  """out[e, K block, N block] = sum over expert e's tiles of lhs_tile^T rhs_tile.

  lhs_ref [R, K], rhs_ref [R, N] (whole); out_ref [bk, bn]. Zero for experts with no tiles.
  """
  expert = pl.program_id(0)
  block_k, block_n = out_ref.shape
  rows_k = pl.ds(pl.multiple_of(pl.program_id(1) * block_k, block_k), block_k)
  cols = pl.ds(pl.multiple_of(pl.program_id(2) * block_n, block_n), block_n)
  first_tile = tile_start_ref[expert]

  def body(i, acc):
    rows = pl.ds(pl.multiple_of((first_tile + i) * block_m, block_m), block_m)
    return acc + _dot(lhs_ref[rows, rows_k], rhs_ref[rows, cols], ((0,), (0,)))

  acc = jax.lax.fori_loop(0, tile_count_ref[expert], body,
                          jnp.zeros((block_k, block_n), jnp.float32))
  out_ref[...] = acc.astype(out_ref.dtype)


# ----------------------------------------------------------------------------- pallas calls


def _gate_up(x_RxD, gate_up_ExDx2I, schedule: _Schedule, cfg: _KernelConfig):
  """[R, Ip] activation of the padded rows (zero in the unused tiles)."""
  num_rows, d_pad = x_RxD.shape
  inter_pad = gate_up_ExDx2I.shape[2] // 2
  num_tiles = num_rows // cfg.block_m
  return _pallas_call(
      functools.partial(_gate_up_kernel, block_k=cfg.block_k), cfg, "moe_gate_up",
      grid=(num_tiles, inter_pad // cfg.block_n),
      in_specs=[_whole((num_tiles,)),
                pl.BlockSpec((cfg.block_m, d_pad), lambda t, n: (t, 0)),
                _whole(gate_up_ExDx2I.shape)],
      out_specs=pl.BlockSpec((cfg.block_m, cfg.block_n), lambda t, n: (t, n)),
      out_shape=jax.ShapeDtypeStruct((num_rows, inter_pad), x_RxD.dtype),
  )(schedule.tile_expert_T, x_RxD, gate_up_ExDx2I)


def _grouped_matmul(lhs_RxK, w, schedule: _Schedule, cfg: _KernelConfig, *, transpose_w: bool,
                    scale_R=None):
  """[R, N] = per-tile lhs @ W[e] (W [E, K, N]) or lhs @ W[e]^T (W [E, N, K])."""
  num_rows, k_pad = lhs_RxK.shape
  n_pad = w.shape[1] if transpose_w else w.shape[2]
  num_tiles = num_rows // cfg.block_m
  in_specs = [_whole((num_tiles,)),
              pl.BlockSpec((cfg.block_m, k_pad), lambda t, n: (t, 0)),
              _whole(w.shape)]
  args = [schedule.tile_expert_T, lhs_RxK, w]
  if scale_R is not None:
    in_specs.append(pl.BlockSpec((cfg.block_m,), lambda t, n: (t,)))
    args.append(scale_R)
  kernel = functools.partial(_grouped_matmul_kernel, block_k=cfg.block_k,
                             transpose_w=transpose_w, has_scale=scale_R is not None)
  return _pallas_call(
      kernel, cfg, "moe_grouped_matmul_t" if transpose_w else "moe_grouped_matmul",
      grid=(num_tiles, n_pad // cfg.block_n),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((cfg.block_m, cfg.block_n), lambda t, n: (t, n)),
      out_shape=jax.ShapeDtypeStruct((num_rows, n_pad), lhs_RxK.dtype),
  )(*args)


def _activation_grad(x_RxD, dy_RxD, gate_up_ExDx2I, down_ExIxD, schedule: _Schedule,
                     cfg: _KernelConfig, scale_R=None):
  """([dg | du] [R, 2*Ip], r * act [R, Ip], row-weight grad [R] float32 or None)."""
  num_rows, d_pad = x_RxD.shape
  inter_pad = down_ExIxD.shape[1]
  num_tiles = num_rows // cfg.block_m
  num_col_blocks = inter_pad // cfg.block_n
  rows_spec = pl.BlockSpec((cfg.block_m, d_pad), lambda t, n: (t, 0))
  in_specs = [_whole((num_tiles,)), rows_spec, rows_spec, _whole(gate_up_ExDx2I.shape),
              _whole(down_ExIxD.shape)]
  args = [schedule.tile_expert_T, x_RxD, dy_RxD, gate_up_ExDx2I, down_ExIxD]
  # [R, 2, Ip] is [R, 2*Ip] = [dg | du] row-major, so one block writes both halves' columns.
  out_specs = [pl.BlockSpec((cfg.block_m, 2, cfg.block_n), lambda t, n: (t, 0, n)),
               pl.BlockSpec((cfg.block_m, cfg.block_n), lambda t, n: (t, n))]
  out_shape = [jax.ShapeDtypeStruct((num_rows, 2, inter_pad), x_RxD.dtype),
               jax.ShapeDtypeStruct((num_rows, inter_pad), x_RxD.dtype)]
  if scale_R is not None:
    in_specs.append(pl.BlockSpec((cfg.block_m,), lambda t, n: (t,)))
    args.append(scale_R)
    out_specs.append(pl.BlockSpec((None, cfg.block_m), lambda t, n: (n, t)))
    out_shape.append(jax.ShapeDtypeStruct((num_col_blocks, num_rows), jnp.float32))
  outs = _pallas_call(
      functools.partial(_activation_grad_kernel, block_k=cfg.block_k,
                        has_scale=scale_R is not None),
      cfg, "moe_activation_grad", grid=(num_tiles, num_col_blocks), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape)(*args)
  dgu_RxI2 = outs[0].reshape(num_rows, 2 * inter_pad)
  dscale_R = jnp.sum(outs[2], axis=0) if scale_R is not None else None
  return dgu_RxI2, outs[1], dscale_R


def _transposed_grouped_matmul(lhs_RxK, rhs_RxN, schedule: _Schedule, cfg: _KernelConfig,
                               out_dtype):
  """[E, K, N]: per expert, lhs_e^T rhs_e over its tiles' rows."""
  num_rows, k_pad = lhs_RxK.shape
  n_pad = rhs_RxN.shape[1]
  num_experts = schedule.tile_start_E.shape[0]
  return _pallas_call(
      functools.partial(_transposed_grouped_matmul_kernel, block_m=cfg.block_m), cfg,
      "moe_transposed_grouped_matmul",
      grid=(num_experts, k_pad // cfg.block_k, n_pad // cfg.block_n),
      in_specs=[_whole((num_experts,)), _whole((num_experts,)), _whole(lhs_RxK.shape),
                _whole(rhs_RxN.shape)],
      out_specs=pl.BlockSpec((None, cfg.block_k, cfg.block_n), lambda e, k, n: (e, k, n)),
      out_shape=jax.ShapeDtypeStruct((num_experts, k_pad, n_pad), out_dtype),
  )(schedule.tile_start_E, schedule.tile_count_E, lhs_RxK, rhs_RxN)


# ----------------------------------------------------------------------------- custom VJP


def _padded_sizes(d: int, inter: int, cfg: _KernelConfig) -> tuple[int, int]:
  # D and I are both N (output) and K (contraction) dims somewhere: pad to both block sizes.
  multiple = math.lcm(cfg.block_n, cfg.block_k)
  return _round_up(d, multiple), _round_up(inter, multiple)


def _pad_weights(gate_up_ExDx2I, down_ExIxD, d_pad: int, inter_pad: int):
  """Zero-pads D and I (each half of gate_up separately); free when nothing needs padding."""
  num_experts, d, inter = down_ExIxD.shape[0], down_ExIxD.shape[2], down_ExIxD.shape[1]
  if (d_pad, inter_pad) == (d, inter):
    return gate_up_ExDx2I, down_ExIxD
  gate_up = gate_up_ExDx2I.reshape(num_experts, d, 2, inter)
  gate_up = jnp.pad(gate_up, ((0, 0), (0, d_pad - d), (0, 0), (0, inter_pad - inter)))
  down = jnp.pad(down_ExIxD, ((0, 0), (0, inter_pad - inter), (0, d_pad - d)))
  return gate_up.reshape(num_experts, d_pad, 2 * inter_pad), down


def _prepare(x_MxD, group_sizes_E, gate_up_ExDx2I, down_ExIxD, row_weights_M, cfg):
  m, d = x_MxD.shape
  d_pad, inter_pad = _padded_sizes(d, down_ExIxD.shape[1], cfg)
  schedule, num_tiles = _tile_schedule(group_sizes_E, m, cfg.block_m)
  num_rows = num_tiles * cfg.block_m
  gate_up, down = _pad_weights(gate_up_ExDx2I, down_ExIxD, d_pad, inter_pad)
  x_RxD = _to_tiles(x_MxD, schedule, num_rows, d_pad)
  scale_R = None
  if row_weights_M is not None:
    scale_R = _to_tiles(row_weights_M.astype(jnp.float32)[:, None], schedule, num_rows, 1)[:, 0]
  return schedule, x_RxD, gate_up, down, scale_R


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _expert_mlp(cfg, x_MxD, group_sizes_E, gate_up_ExDx2I, down_ExIxD, row_weights_M):
  return _expert_mlp_fwd(cfg, x_MxD, group_sizes_E, gate_up_ExDx2I, down_ExIxD,
                         row_weights_M)[0]


def _expert_mlp_fwd(cfg, x_MxD, group_sizes_E, gate_up_ExDx2I, down_ExIxD, row_weights_M):
  schedule, x_RxD, gate_up, down, scale_R = _prepare(
      x_MxD, group_sizes_E, gate_up_ExDx2I, down_ExIxD, row_weights_M, cfg)
  act_RxI = _gate_up(x_RxD, gate_up, schedule, cfg)
  y_RxD = _grouped_matmul(act_RxI, down, schedule, cfg, transpose_w=False, scale_R=scale_R)
  y_MxD = _from_tiles(y_RxD, schedule, x_MxD.shape[1])
  # Only the inputs are saved: the backward recomputes the activations inside its kernel.
  return y_MxD, (x_MxD, group_sizes_E, gate_up_ExDx2I, down_ExIxD, row_weights_M)


def _expert_mlp_bwd(cfg, residuals, dy_MxD):
  x_MxD, group_sizes_E, gate_up_ExDx2I, down_ExIxD, row_weights_M = residuals
  (num_experts, inter, d) = down_ExIxD.shape
  schedule, x_RxD, gate_up, down, scale_R = _prepare(
      x_MxD, group_sizes_E, gate_up_ExDx2I, down_ExIxD, row_weights_M, cfg)
  dy_RxD = _to_tiles(dy_MxD.astype(x_MxD.dtype), schedule, x_RxD.shape[0], x_RxD.shape[1])
  dgu_RxI2, act_RxI, dscale_R = _activation_grad(x_RxD, dy_RxD, gate_up, down, schedule, cfg,
                                                 scale_R)
  dx_RxD = _grouped_matmul(dgu_RxI2, gate_up, schedule, cfg, transpose_w=True)
  dgate_up = _transposed_grouped_matmul(x_RxD, dgu_RxI2, schedule, cfg, gate_up_ExDx2I.dtype)
  ddown = _transposed_grouped_matmul(act_RxI, dy_RxD, schedule, cfg, down_ExIxD.dtype)
  d_pad, inter_pad = down.shape[2], down.shape[1]
  dgate_up = dgate_up.reshape(num_experts, d_pad, 2, inter_pad)[:, :d, :, :inter].reshape(
      num_experts, d, 2 * inter)
  ddown = ddown[:, :inter, :d]
  dx_MxD = _from_tiles(dx_RxD, schedule, d)
  drow_weights = None
  if row_weights_M is not None:
    drow_weights = _from_tiles(dscale_R[:, None], schedule, 1)[:, 0].astype(row_weights_M.dtype)
  return dx_MxD, None, dgate_up, ddown, drow_weights


_expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)


# ----------------------------------------------------------------------------- public API


def expert_mlp(x_MxD, group_sizes_E, gate_up_ExDx2I, down_ExIxD, row_weights_M=None, *,
               block_m: int = 32, block_n: int = 64, block_k: int = 64,
               interpret: bool | None = None, num_warps: int | None = None,
               num_stages: int | None = None):
  """Grouped expert MLP over rows sorted by expert, as Pallas kernels; differentiable.

  y[m] = (gelu_tanh(x[m] Wg[e]) * (x[m] Wu[e])) Wd[e] * row_weights[m], with e the row's expert
  and [Wg | Wu] = gate_up[e] split in halves along the last axis (gate first).

  Args:
    x_MxD: [M, D] float32 or bfloat16, rows sorted by expert.
    group_sizes_E: [E] int, rows of each expert in order; sum(group_sizes) <= M, and rows past
      the sum belong to no expert: their output (and gradient) is zero.
    gate_up_ExDx2I: [E, D, 2I] gate and up projections; cast to x's dtype.
    down_ExIxD: [E, I, D] down projection; cast to x's dtype.
    row_weights_M: optional [M] per-row output scale (the combine weights), applied in float32.
    block_m: rows per tile (every expert's rows are padded to whole tiles).
    block_n, block_k: output-column and contraction block sizes. D and I are zero-padded to a
      multiple of both, which copies the weights on every call: pick blocks that divide D and I
      (the defaults divide the 26B-A4B sizes D=2816, I=704).
    interpret: Pallas interpret mode; None = the rule of `kernels.platform`: interpret on CPU,
      Triton on GPUs, KernelPlatformError on other platforms.
    num_warps, num_stages: optional Triton settings on GPU.

  Returns:
    [M, D] in x's dtype.

  Gradients (jax.custom_vjp) with respect to x, gate_up, down and row_weights are Pallas kernels
  too (see the module docstring); group_sizes gets none.
  """
  if x_MxD.ndim != 2 or gate_up_ExDx2I.ndim != 3 or down_ExIxD.ndim != 3:
    raise ValueError("expected x [M, D], gate_up [E, D, 2I], down [E, I, D]; got "
                     f"{x_MxD.shape}, {gate_up_ExDx2I.shape}, {down_ExIxD.shape}")
  m, d = x_MxD.shape
  num_experts, inter, d_out = down_ExIxD.shape
  if (gate_up_ExDx2I.shape != (num_experts, d, 2 * inter) or d_out != d
      or group_sizes_E.shape != (num_experts,)):
    raise ValueError(f"inconsistent shapes: x {x_MxD.shape}, group_sizes {group_sizes_E.shape}, "
                     f"gate_up {gate_up_ExDx2I.shape}, down {down_ExIxD.shape}")
  if row_weights_M is not None and row_weights_M.shape != (m,):
    raise ValueError(f"row_weights has shape {row_weights_M.shape}, expected ({m},)")
  guarded = interpret is None
  interpret = platform.resolve_interpret(
      interpret, "the grouped expert MLP (model.moe_impl='pallas')",
      "model.moe_impl='tiled' (or 'tiled_scan', 'ragged_dot')")
  blocks = dict(block_m=block_m, block_n=block_n, block_k=block_k)
  for name, size in blocks.items():
    # Triton: loads need power-of-two sizes and tl.dot at least 16 per dimension.
    if size < 1 or (not interpret and (size < _MIN_COMPILED_BLOCK or size & (size - 1))):
      raise ValueError(f"{name}={size}: blocks must be positive, and powers of two >= "
                       f"{_MIN_COMPILED_BLOCK} when compiled")
  cfg = _KernelConfig(block_m, block_n, block_k, interpret, guarded, num_warps, num_stages)
  gate_up = gate_up_ExDx2I.astype(x_MxD.dtype)
  down = down_ExIxD.astype(x_MxD.dtype)
  if m == 0:
    return jnp.zeros((0, d), x_MxD.dtype)
  return _expert_mlp(cfg, x_MxD, jnp.asarray(group_sizes_E, jnp.int32), gate_up, down,
                     row_weights_M)
