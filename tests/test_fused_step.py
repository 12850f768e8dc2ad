"""The fused sampling step (sampler.fused_step, sampler.top_k) against the unfused step and a
float64 numpy computation of the truncated distribution."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

from diffgemma.model import transformer
from diffgemma.model.config import FULL, SLIDING, tiny
from diffgemma.sampling import sampler

# The sampler's step is the same whatever the depth: one sliding and one full layer (both
# attention kinds) compile in a third of the 7-layer test model's time.
DEPTH = dict(num_layers=2, layer_types=(SLIDING, FULL))


def test_fused_step_equals_the_unfused_step_along_a_trajectory():
  """Step by step on the unfused trajectory: the fused step, given the same state (its
  self-conditioning embedding made from the unfused step's logits), takes the same decisions.

  (Whole generations are not compared: self-conditioning feeds each step's logits into the
  next, so float rounding differences grow about 3x per step with random weights.)
  """
  model_cfg = tiny(canvas_length=8, moe_impl="tiled", **DEPTH)
  params = transformer.init_params(model_cfg, jax.random.PRNGKey(1), 0.3)
  cache = transformer.init_cache(model_cfg, 3, 5 + 8)
  prompt = jax.random.randint(jax.random.PRNGKey(2), (3, 5), 3, model_cfg.vocab_size)
  _, cache = transformer.encode(params, model_cfg, prompt, cache)
  # A loose confidence threshold, so rows stop at different steps and frozen rows are tested.
  plain_cfg = sampler.SamplerConfig(max_new_tokens=8, max_denoising_steps=10,
                                    confidence_threshold=3.0, stability_threshold=0)
  fused_cfg = plain_cfg.replace(fused_step=True)
  step = jax.jit(lambda state, rng, cfg: sampler.denoising_step(params, model_cfg, cfg, cache,
                                                                  state, rng), static_argnums=2)
  state = sampler.init_denoise_state(params, model_cfg, plain_cfg, jax.random.PRNGKey(0), 3)
  for n in range(plain_cfg.max_denoising_steps):
    rng = jax.random.PRNGKey(100 + n)
    embedding = jnp.where(state.step > 0, transformer.self_conditioning_embedding(
        params, state.self_cond_BxCxV, model_cfg), 0.0)
    fused_state = state._replace(self_cond_BxCxV=state.self_cond_BxCxV[..., :0],
                                 self_cond_embedding_BxCxD=embedding)
    new_plain, out_plain = step(state, rng, plain_cfg)
    new_fused, out_fused = step(fused_state, rng, fused_cfg)
    np.testing.assert_allclose(out_fused.tempered_logits_BxCxV, out_plain.tempered_logits_BxCxV,
                               atol=1e-5, err_msg=f"step {n}")
    for name in ("canvas_BxC", "argmax_BxC", "history_SxBxC", "finished_B", "step"):
      np.testing.assert_array_equal(getattr(new_fused, name), getattr(new_plain, name),
                                    err_msg=f"step {n}: {name}")
    np.testing.assert_array_equal(out_fused.accepted_BxC, out_plain.accepted_BxC)
    state = new_plain
  assert bool(jnp.any(state.finished_B))  # the stopping rule was exercised


def test_fused_generate_equals_the_unfused_generate_and_top_k_runs():
  """Whole generations on a tame model (the default small init, where float rounding does not
  flip decisions within 6 steps): the fused step without truncation returns exactly the
  unfused step's tokens and statistics (same draws, same stopping), and so does top_k >=
  vocab_size (it truncates nothing). With top_k < V the draws differ by design; the run keeps
  the same shapes and bookkeeping invariants."""
  model_cfg = tiny(canvas_length=8, moe_impl="tiled", **DEPTH)
  params = transformer.init_params(model_cfg, jax.random.PRNGKey(1))
  prompt = jax.random.randint(jax.random.PRNGKey(2), (2, 5), 3, model_cfg.vocab_size)

  def generate(**kw):
    cfg = sampler.SamplerConfig(max_new_tokens=16, max_denoising_steps=6, **kw)
    out = jax.jit(lambda p, x, r: sampler.generate(p, model_cfg, cfg, x, None, r))(
        params, prompt, jax.random.PRNGKey(3))
    return jax.tree_util.tree_map(np.asarray, out)

  plain, fused = generate(), generate(fused_step=True)
  chex.assert_trees_all_equal(fused, plain)  # the same fields filled, every array equal
  assert plain.tokens.shape == (2, 16) and np.all(plain.decoder_passes > 0)
  for top_k in (model_cfg.vocab_size, model_cfg.vocab_size + 7):
    untruncated = generate(fused_step=True, top_k=top_k)
    chex.assert_trees_all_equal(untruncated, fused, custom_message=f"top_k={top_k}")
  truncated = generate(fused_step=True, top_k=4)
  chex.assert_trees_all_equal_shapes(truncated, plain)
  assert np.all((truncated.tokens >= 0) & (truncated.tokens < model_cfg.vocab_size))
  assert np.all(truncated.decoder_passes > 0)
  assert np.all((truncated.steps_per_canvas >= 1)
                & (truncated.steps_per_canvas <= 6)), truncated.steps_per_canvas


def test_top_k_truncation_matches_float64():
  model_cfg = tiny()
  params = transformer.init_params(model_cfg, jax.random.PRNGKey(2), 0.5)
  top_k = 5
  tempered = jax.random.normal(jax.random.PRNGKey(3), (3, 4, model_cfg.vocab_size)) * 3.0
  sampled, argmax, entropy, embedding = jax.jit(
      lambda t, r: sampler.fused_sample(params, model_cfg, t, r, top_k))(tempered,
                                                                         jax.random.PRNGKey(4))
  t = np.asarray(tempered, np.float64)
  ids = np.argsort(-t, axis=-1)[..., :top_k]
  logits = np.take_along_axis(t, ids, -1)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  np.testing.assert_allclose(entropy, -(probs * np.log(probs)).sum(-1), rtol=1e-5, atol=1e-6)
  table = np.asarray(params["embedding"], np.float64)
  expected = np.einsum("bck,bckd->bcd", probs, table[ids]) * model_cfg.hidden_size ** 0.5
  np.testing.assert_allclose(embedding, expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(argmax, ids[..., 0])
  assert (np.asarray(sampled)[..., None] == ids).any(-1).all()  # every draw is in the top k
  # top_k >= V truncates nothing: every output equals top_k = 0's, bit for bit.
  plain = jax.jit(lambda t, r, k: sampler.fused_sample(params, model_cfg, t, r, k),
                  static_argnums=2)
  for top_k_all in (model_cfg.vocab_size, model_cfg.vocab_size + 1):
    for a, b in zip(plain(tempered, jax.random.PRNGKey(4), top_k_all),
                    plain(tempered, jax.random.PRNGKey(4), 0)):
      np.testing.assert_array_equal(a, b, err_msg=f"top_k={top_k_all}")
  # Draws follow the truncated distribution: 4000 draws at one position, chi-square-free check
  # of each frequency within 5 standard errors.
  draws = jax.vmap(lambda r: sampler.fused_sample(params, model_cfg, tempered[:1, :1], r,
                                                  top_k)[0])(jax.random.split(
                                                      jax.random.PRNGKey(5), 4000))
  freq = np.array([(np.asarray(draws).ravel() == i).mean() for i in ids[0, 0]])
  stderr = np.sqrt(probs[0, 0] * (1 - probs[0, 0]) / 4000)
  assert (np.abs(freq - probs[0, 0]) < 5 * stderr + 1e-3).all(), (freq, probs[0, 0])
