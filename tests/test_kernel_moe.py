"""The Pallas expert MLP (interpret mode on CPU) against plain-JAX and float64 references.

Errors are measured as max|ours - reference| / max|reference| per output or gradient:
float32 within 1e-5 (float32 reference), bfloat16 within 1e-2 (float32 reference on the same
bfloat16-rounded inputs; the kernels store the activation and [dg | du] in bfloat16).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffgemma.model import layers, moe
from diffgemma.model.config import tiny
from diffgemma.model.kernels import moe as kmoe

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}

# name: (group sizes, M, D, I, (block_m, block_n, block_k), dtype, with row weights)
CASES = {
    # Empty experts, several tiles for one expert, M, D and I not multiples of the blocks.
    "ragged_empty_experts": ([3, 0, 11, 0, 6], 20, 24, 20, (8, 8, 16), jnp.float32, True),
    "all_rows_one_expert": ([0, 0, 17, 0], 17, 16, 16, (8, 8, 8), jnp.float32, False),
    # Rows past sum(group_sizes) belong to no expert: zero output and gradient.
    "rows_past_groups": ([4, 0, 5], 12, 16, 8, (8, 8, 8), jnp.float32, True),
    "tile_aligned": ([8, 16], 24, 32, 16, (8, 16, 16), jnp.float32, False),
    "bfloat16": ([5, 0, 9, 2, 0, 7], 23, 40, 24, (8, 16, 8), jnp.bfloat16, True),
    # The default blocks (32, 64, 64): tiles larger than every group, D and I padded to 64.
    "default_blocks": ([6, 0, 13, 18], 37, 40, 24, None, jnp.float32, True),
}


def max_rel_err(ours, ref):
  ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
  return np.max(np.abs(ours - ref)) / np.max(np.abs(ref))


def make_inputs(group_sizes, m, d, inter, dtype, with_weights, seed=0):
  rng = np.random.default_rng(seed)
  e = len(group_sizes)
  # Round to the test dtype once, so the float32 reference sees the very same values.
  cast = lambda a: jnp.asarray(a, dtype)
  return dict(
      x=cast(rng.normal(size=(m, d))),
      gate_up=cast(rng.normal(size=(e, d, 2 * inter)) * d ** -0.5),
      down=cast(rng.normal(size=(e, inter, d)) * inter ** -0.5),
      row_weights=cast(rng.uniform(0.1, 1.0, size=(m,))) if with_weights else None,
      cotangent=cast(rng.normal(size=(m, d))),
  )


def reference_expert_mlp(x, group_sizes, gate_up, down, row_weights):
  """The definition, row by row: gather each row's expert weights (float32, exact matmuls)."""
  m = x.shape[0]
  expert_M = jnp.repeat(jnp.arange(len(group_sizes)), np.asarray(group_sizes),
                        total_repeat_length=m)
  valid_M = jnp.arange(m) < int(np.sum(group_sizes))
  hi = jax.lax.Precision.HIGHEST
  gate, up = jnp.split(jnp.einsum("md,mdf->mf", x, gate_up[expert_M], precision=hi), 2, axis=-1)
  y = jnp.einsum("mi,mid->md", layers.gelu_tanh(gate) * up, down[expert_M], precision=hi)
  if row_weights is not None:
    y = y * row_weights[:, None]
  return jnp.where(valid_M[:, None], y, 0.0)


def value_and_grads(fn, inputs):
  """fn's output and the VJP of the cotangent w.r.t. x, gate_up, down (and row_weights)."""
  names = ["x", "gate_up", "down"] + (["row_weights"] if inputs["row_weights"] is not None else [])

  def run(args, cotangent):
    def f(*diff):
      kwargs = dict(zip(names, diff))
      return fn(kwargs["x"], kwargs["gate_up"], kwargs["down"], kwargs.get("row_weights"))
    y, vjp = jax.vjp(f, *args)
    return y, dict(zip(names, vjp(cotangent)))

  args = tuple(inputs[k] for k in names)
  return jax.jit(run).lower(args, inputs["cotangent"]).compile()(
      args, inputs["cotangent"])


@pytest.mark.parametrize("case", list(CASES))
def test_expert_mlp_forward_and_grads_match_reference(case):
  group_sizes, m, d, inter, blocks, dtype, with_weights = CASES[case]
  inputs = make_inputs(group_sizes, m, d, inter, dtype, with_weights)
  sizes = jnp.asarray(group_sizes, jnp.int32)
  block_kwargs = {} if blocks is None else dict(zip(("block_m", "block_n", "block_k"), blocks))
  kernel = lambda x, gu, dn, rw: kmoe.expert_mlp(x, sizes, gu, dn, rw, **block_kwargs)
  y, grads = value_and_grads(kernel, inputs)
  as_f32 = {k: None if v is None else v.astype(jnp.float32) for k, v in inputs.items()}
  y_ref, grads_ref = value_and_grads(
      lambda x, gu, dn, rw: reference_expert_mlp(x, group_sizes, gu, dn, rw), as_f32)
  assert y.dtype == dtype and y.shape == (m, d)
  tol = TOLERANCE[dtype]
  assert max_rel_err(y, y_ref) < tol
  for name, g in grads.items():
    assert g.dtype == dtype and g.shape == grads_ref[name].shape, name
    assert max_rel_err(g, grads_ref[name]) < tol, name
  # Rows of no expert: exactly zero.
  used = int(np.sum(group_sizes))
  np.testing.assert_array_equal(np.asarray(y[used:], np.float32), 0.0)
  np.testing.assert_array_equal(np.asarray(grads["x"][used:], np.float32), 0.0)


def test_expert_mlp_matches_float64_loop():
  """Forward against the definition in float64 numpy, one row and expert at a time."""
  group_sizes, m, d, inter, (bm, bn, bk), _, _ = CASES["ragged_empty_experts"]
  inputs = make_inputs(group_sizes, m, d, inter, jnp.float32, True, seed=1)
  args = (inputs["x"], jnp.asarray(group_sizes), inputs["gate_up"], inputs["down"],
          inputs["row_weights"])
  run = lambda *a: kmoe.expert_mlp(*a, block_m=bm, block_n=bn, block_k=bk)
  y = jax.jit(run).lower(*args).compile()(*args)
  x, gate_up, down, weights = (np.asarray(inputs[k], np.float64)
                               for k in ("x", "gate_up", "down", "row_weights"))
  gelu = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
  expected = np.zeros_like(x)
  experts = np.repeat(np.arange(len(group_sizes)), group_sizes)
  for row, e in enumerate(experts):
    g, u = np.split(x[row] @ gate_up[e], 2)
    expected[row] = weights[row] * ((gelu(g) * u) @ down[e])
  assert max_rel_err(y, expected) < TOLERANCE[jnp.float32]


def test_tile_schedule_never_straddles_experts_and_skips_empty_ones():
  group_sizes = jnp.asarray([3, 0, 11, 0, 6, 0], jnp.int32)
  block_m, m = 4, 22  # two rows past the groups
  schedule, num_tiles = kmoe._tile_schedule(group_sizes, m, block_m)
  assert num_tiles == kmoe.num_tiles_bound(m, 6, block_m)
  tile_expert = np.asarray(schedule.tile_expert_T)
  # ceil(3/4) + ceil(11/4) + ceil(6/4) = 1 + 3 + 2 tiles, in expert order, then unused ones.
  np.testing.assert_array_equal(tile_expert[:6], [0, 2, 2, 2, 4, 4])
  assert (tile_expert[6:] == kmoe._NO_EXPERT).all()
  np.testing.assert_array_equal(schedule.tile_count_E, [1, 0, 3, 0, 2, 0])
  row_M = np.asarray(schedule.row_M)
  experts = np.repeat(np.arange(6), np.asarray(group_sizes))
  np.testing.assert_array_equal(tile_expert[row_M[:20] // block_m], experts)
  assert len(set(row_M[:20].tolist())) == 20
  np.testing.assert_array_equal(schedule.valid_M, np.arange(m) < 20)


def test_model_moe_pallas_equals_tiled():
  """model.moe with moe_impl="pallas" (route -> sort -> Pallas expert MLP -> scatter-add)
  equals moe_impl="tiled": outputs and gradients."""
  cfg = tiny(moe_impl="tiled", moe_tile_size=8)
  d, e, inter = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
  rng = np.random.default_rng(2)
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
  # The layer's router and experts built directly: transformer.init_params is slow on 2 CPU cores.
  params = {"router": {"proj": normal(d, e), "scale": 1.0 + normal(d),
                       "per_expert_scale": 1.0 + normal(e)},
            "experts": {"gate_up": normal(e, d, 2 * inter), "down": normal(e, inter, d)}}
  x = normal(13, d) / 0.3
  cotangent = normal(13, d)
  # I = 24 is not a multiple of the default blocks: exercises the weight padding.

  def run(combine):
    def layer(x, params):
      weights, index = moe.route(x, params["router"], cfg)
      # Force an expert with no tokens: route everything away from expert 0.
      index = jnp.where(index == 0, 1 + (index + 1) % (e - 1), index)
      return combine(x, weights, index, params["experts"])

    def value_and_vjp(x, params):
      y, vjp = jax.vjp(layer, x, params)
      return y, vjp(cotangent)

    return jax.jit(value_and_vjp).lower(x, params).compile()(x, params)

  ours = run(lambda *a: moe.moe(*a, cfg.replace(moe_impl="pallas")))
  ref = run(lambda *a: moe.moe(*a, cfg))
  for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(ref)):
    assert max_rel_err(a, b) < TOLERANCE[jnp.float32]
  np.testing.assert_allclose(ours[0], ref[0], atol=1e-5)
