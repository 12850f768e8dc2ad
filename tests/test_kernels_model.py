"""The model with both Pallas kernels (interpret mode on CPU) against its XLA path, float32."""

import jax
import jax.numpy as jnp
import numpy as np

from diffgemma.model import transformer
from diffgemma.model.config import tiny

TOL = 1e-4  # logits are soft-capped at 30; both paths accumulate in float32


def test_encode_and_denoising_step_match_the_xla_path():
  xla_cfg = tiny(canvas_length=8, moe_impl="tiled")
  pallas_cfg = xla_cfg.replace(moe_impl="pallas", attention_impl="pallas")
  params = transformer.init_params(xla_cfg, jax.random.PRNGKey(0), 0.2)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(3, xla_cfg.vocab_size, (2, 13)))
  # Left padding, and a prompt longer than the sliding window (8).
  valid = jnp.asarray(np.arange(13)[None] >= np.array([[0], [4]]))
  canvas = jnp.asarray(rng.integers(0, xla_cfg.vocab_size, (2, 8)))
  self_cond = jnp.asarray(rng.normal(0, 3, (2, 8, xla_cfg.vocab_size)), jnp.float32)
  outputs = []
  for cfg in (xla_cfg, pallas_cfg):
    def run(params, cfg=cfg):
      cache = transformer.init_cache(cfg, 2, 13 + 8)
      hidden, cache = transformer.encode(params, cfg, prompt, cache, valid)
      logits = transformer.decode(params, cfg, canvas, cache, None, self_cond,
                                  jnp.array([True, False]))
      return transformer.lm_head(params, hidden, cfg), logits

    outputs.append(jax.jit(run)(params))
  (enc_x, dec_x), (enc_p, dec_p) = outputs
  assert float(jnp.max(jnp.abs(enc_x - enc_p)[valid])) < TOL
  assert float(jnp.max(jnp.abs(dec_x - dec_p))) < TOL
