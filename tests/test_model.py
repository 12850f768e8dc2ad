"""Model pieces against brute-force references: the attention mask, both MoE paths, bf16."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffgemma.model import attention_mask, moe, transformer
from diffgemma.model.config import tiny

# Jitted entry points: op-by-op dispatch of a whole model is ~5x slower than one compile.
encode = jax.jit(transformer.encode, static_argnums=1)
decode = jax.jit(transformer.decode, static_argnums=1)


def test_attention_mask_matches_brute_force_rules():
  rng = np.random.default_rng(0)
  b, t, s, window = 2, 5, 12, 4
  q_pos = rng.integers(0, s, (b, t))
  kv_pos = np.broadcast_to(np.arange(s), (b, s))
  valid = rng.random((b, s)) < 0.8
  causal = np.asarray(attention_mask.attention_mask(q_pos, q_pos, kv_pos, valid, window))
  decoder = np.asarray(attention_mask.attention_mask(np.full((b, t), 7), np.full((b, t), 9), kv_pos,
                                            valid, window))
  for i in range(b):
    for q in range(t):
      for j in range(s):
        assert causal[i, q, j] == (valid[i, j] and q_pos[i, q] - window < j <= q_pos[i, q])
        # A canvas at 7..9 sees valid keys up to 9 and the last window-1 positions before 7.
        assert decoder[i, q, j] == (valid[i, j] and 7 - window < j <= 9)


@pytest.mark.parametrize("tile,impl", [(3, "tiled"), (8, "tiled"), (128, "tiled"),
                                       (3, "tiled_scan"), (8, "tiled_scan")])
def test_tiled_moe_equals_ragged_dot_forward_and_grad(tile, impl):
  cfg = tiny(moe_tile_size=tile)
  layer = transformer.init_params(cfg, jax.random.PRNGKey(0), std=0.3)["layers"][0]
  x = jax.random.normal(jax.random.PRNGKey(1), (29, cfg.hidden_size))
  weights, index = moe.route(x, layer["router"], cfg)
  # Force an expert with no tokens: route everything away from expert 0.
  index = jnp.where(index == 0, 1 + (index + 1) % (cfg.num_experts - 1), index)

  def run(impl):
    c = cfg.replace(moe_impl=impl)
    run_moe = jax.jit(moe.moe, static_argnums=4)
    f = lambda x, e: run_moe(x, weights, index, e, c).sum()
    return run_moe(x, weights, index, layer["experts"], c), jax.jit(jax.grad(f, (0, 1)))(
        x, layer["experts"])

  (y_t, g_t), (y_r, g_r) = run(impl), run("ragged_dot")
  np.testing.assert_allclose(y_t, y_r, atol=1e-5)
  chex.assert_trees_all_close(g_t, g_r, atol=1e-4, rtol=1e-7)


@pytest.mark.parametrize("impl", ["tiled", "tiled_scan"])
def test_moe_per_batch_shard_equals_one_sort(impl):
  """Sorting each batch shard's tokens apart (sharded training) changes nothing but the order."""
  cfg = tiny(moe_impl=impl, moe_tile_size=4)
  experts = transformer.init_params(cfg, jax.random.PRNGKey(0), std=0.3)["layers"][0]["experts"]
  x = jax.random.normal(jax.random.PRNGKey(1), (24, cfg.hidden_size))
  weights = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(2), (24, cfg.top_k_experts)))
  index = jax.random.randint(jax.random.PRNGKey(3), (24, cfg.top_k_experts), 1, cfg.num_experts)

  def run(shards):
    f = lambda x, e: (moe.moe(x, weights, index, e, cfg) if shards == 1 else
                      moe.moe_per_batch_shard(x, weights, index, e, cfg, shards))
    return jax.jit(jax.value_and_grad(lambda x, e: (f(x, e) ** 2).sum(), (0, 1)))(x, experts)

  (y1, g1), (y3, g3) = run(1), run(3)
  np.testing.assert_allclose(y3, y1, rtol=1e-5)
  chex.assert_trees_all_close(g3, g1, atol=1e-4, rtol=1e-7)


def test_moe_matches_per_token_loop():
  """Against the definition: each token sums its top-k experts' gated MLPs times weights."""
  cfg = tiny()
  layer = transformer.init_params(cfg, jax.random.PRNGKey(2), std=0.3)["layers"][1]
  x = np.asarray(jax.random.normal(jax.random.PRNGKey(3), (7, cfg.hidden_size)), np.float64)
  weights, index = moe.route(jnp.asarray(x, jnp.float32), layer["router"], cfg)
  ours = np.asarray(moe.moe(jnp.asarray(x, jnp.float32), weights, index, layer["experts"], cfg))
  gate_up = np.asarray(layer["experts"]["gate_up"], np.float64)
  down = np.asarray(layer["experts"]["down"], np.float64)
  gelu = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
  expected = np.zeros_like(x)
  for n in range(x.shape[0]):
    for w, e in zip(np.asarray(weights[n]), np.asarray(index[n])):
      g, u = np.split(x[n] @ gate_up[e], 2)
      expected[n] += w * ((gelu(g) * u) @ down[e])
  np.testing.assert_allclose(ours, expected, atol=1e-5)


def test_bfloat16_compute_tracks_float32():
  cfg = tiny(num_layers=2)
  params = transformer.init_params(cfg, jax.random.PRNGKey(4), std=0.1)
  tokens = jax.random.randint(jax.random.PRNGKey(5), (2, 9), 3, cfg.vocab_size)
  canvas = jax.random.randint(jax.random.PRNGKey(6), (2, cfg.canvas_length), 0, cfg.vocab_size)

  def logits(c):
    cache = transformer.init_cache(c, 2, 9)
    _, cache = encode(params, c, tokens, cache)
    return decode(params, c, canvas, cache)

  f32 = logits(cfg)
  bf16 = logits(cfg.replace(compute_dtype="bfloat16"))
  assert bf16.dtype == jnp.float32  # logits are always float32
  # bfloat16 keeps ~3 significant digits, and a router near a tie may pick another expert for a
  # few tokens; so the typical token must be within a few percent.
  per_token = jnp.linalg.norm(bf16 - f32, axis=-1) / jnp.linalg.norm(f32, axis=-1)
  assert float(jnp.median(per_token)) < 0.05, per_token


def test_decoder_ignores_cache_slots_past_its_prefix():
  """Training decodes canvas k against a cache holding the whole sequence: slots at or after the
  canvas start must not change the logits, and a shorter prefix must."""
  cfg = tiny()
  params = transformer.init_params(cfg, jax.random.PRNGKey(7), std=0.3)
  tokens = jax.random.randint(jax.random.PRNGKey(8), (1, 20), 3, cfg.vocab_size)
  canvas = jax.random.randint(jax.random.PRNGKey(9), (1, cfg.canvas_length), 0, cfg.vocab_size)
  _, short = encode(params, cfg, tokens[:, :6], transformer.init_cache(cfg, 1, 6))
  _, full = encode(params, cfg, tokens, transformer.init_cache(cfg, 1, 20))
  prefix = jnp.array([6])
  np.testing.assert_allclose(decode(params, cfg, canvas, full, prefix),
                             decode(params, cfg, canvas, short), atol=1e-4)
  assert not np.allclose(decode(params, cfg, canvas, full, prefix - 1),
                         decode(params, cfg, canvas, short), atol=1e-3)
