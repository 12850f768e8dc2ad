"""The attention recorder: it leaves the model's outputs unchanged and records the
probabilities the model actually used."""

import jax
import jax.numpy as jnp
import numpy as np

from diffgemma.model import attention_probe, layers, transformer
from diffgemma.model.config import SLIDING, tiny

ENCODED_LEN = 12  # cache slots the decoder reads in the decoder test


def test_recorded_probabilities_reproduce_attend():
  """probs @ v (kv heads shared by groups of query heads) equals model.attend's output, and
  the probabilities are a softmax over the visible keys only."""
  b, t, s, h, kv, d = 2, 5, 7, 4, 2, 8
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  q = jax.random.normal(keys[0], (b, t, h, d))
  k = jax.random.normal(keys[1], (b, s, kv, d))
  v = jax.random.normal(keys[2], (b, s, kv, d))
  mask = jax.random.uniform(keys[3], (b, t, s)) < 0.7
  mask = mask.at[:, :, 0].set(True)  # every query sees at least one key
  probs = np.asarray(attention_probe.attention_probs(q, k, mask), np.float64)
  assert probs.shape == (b, h, t, s)
  v_rep = np.repeat(np.asarray(v, np.float64), h // kv, axis=2)  # head h reads kv head h // 2
  expected = np.einsum("bhts,bshd->bthd", probs, v_rep)
  np.testing.assert_allclose(np.asarray(layers.attend(q, k, v, mask)), expected, atol=1e-5)
  np.testing.assert_allclose(probs.sum(-1), 1.0, atol=1e-6)
  assert np.all(probs[~np.broadcast_to(np.asarray(mask)[:, None], probs.shape)] == 0)


def test_recording_leaves_decoder_logits_unchanged():
  cfg = attention_probe.recordable(tiny(remat="full"))
  assert cfg.remat == "none" and cfg.attention_impl == "xla"
  params = transformer.init_params(cfg, jax.random.PRNGKey(1), std=0.3)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, ENCODED_LEN), 3, cfg.vocab_size)
  canvas = jax.random.randint(jax.random.PRNGKey(3), (2, cfg.canvas_length), 0, cfg.vocab_size)
  _, cache = transformer.encode(params, cfg, tokens, transformer.init_cache(cfg, 2, ENCODED_LEN))
  decode = jax.jit(lambda p, c: transformer.decode(p, cfg, c, cache))
  original_attend = layers.attend
  plain = decode(params, canvas)

  @jax.jit
  def recorded(p, c):
    with attention_probe.record_attention() as probs:
      logits = transformer.decode(p, cfg, c, cache)
    return logits, probs

  logits, probs = recorded(params, canvas)
  # Same computation; the extra outputs only change XLA's fusion (float32 rounding, ~1e-5).
  np.testing.assert_allclose(logits, plain, rtol=1e-4, atol=1e-4)
  assert layers.attend is original_attend  # restored after the block
  assert len(probs) == cfg.num_layers
  for i, p in enumerate(probs):
    # Keys: the cache slots then the canvas; sliding layers see only the last window - 1
    # cache slots.
    assert p.shape == (2, cfg.num_heads, cfg.canvas_length, ENCODED_LEN + cfg.canvas_length)
    np.testing.assert_allclose(jnp.sum(p, -1), 1.0, atol=1e-5)
    if cfg.layer_types[i] == SLIDING:
      hidden_slots = ENCODED_LEN - (cfg.sliding_window - 1)
      assert float(jnp.max(p[..., :hidden_slots])) == 0.0
      assert float(jnp.min(jnp.sum(p[..., hidden_slots:ENCODED_LEN], -1))) > 0.0
