"""Infilling (sampler.generate with fixed tokens): the supplied prefix and suffix come back
unchanged whatever the sampler draws, and the denoising from a pure-noise canvas matches a
brute-force per-row numpy reference of the reference sampler with the fixed slots clamped."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffgemma.model import config, transformer
from diffgemma.sampling import sampler

CFG = config.tiny(num_layers=2, layer_types=())  # canvas 8, vocab 64
C, V, PAD = CFG.canvas_length, CFG.vocab_size, CFG.pad_token_id
PROMPT = np.array([[0, 0, 5, 6, 7], [9, 4, 5, 6, 7], [0, 10, 11, 12, 13]], np.int32)
VALID = PROMPT != PAD


@pytest.fixture(scope="module")
def params():
  return transformer.init_params(CFG, jax.random.key(0, impl="rbg"))


def test_infill_never_changes_prefix_or_suffix(params):
  """Two canvases; the suffix straddles them. Half the vocabulary are stop ids, so the middle
  surely draws some: a stop before the suffix must not end the row (nor pad the suffix away)."""
  prefix, suffix, middle = [20, 21], [30, 31, 32, 33], 4  # slots 0-1, 2-5, 6-9
  cfg = sampler.SamplerConfig(max_denoising_steps=4, max_new_tokens=2 * C,
                              stop_token_ids=tuple(range(3, V, 2)))
  for seed in range(3):
    out = jax.tree_util.tree_map(np.asarray, sampler.infill(
        params, CFG, cfg, PROMPT, VALID, prefix, suffix, middle, jax.random.PRNGKey(seed)))
    tokens = out.tokens
    np.testing.assert_array_equal(tokens[:, :2], np.broadcast_to(prefix, (3, 2)))
    np.testing.assert_array_equal(tokens[:, 6:10], np.broadcast_to(suffix, (3, 4)))
    assert (out.num_canvases == 2).all()  # the suffix reaches into canvas 2
    middle_tokens = tokens[:, 2:6]
    assert (middle_tokens != PAD).all()
  stops = np.isin(middle_tokens, cfg.stop_token_ids)
  assert stops.any()  # the case the rule is for did occur
  # With the AR fallback on every canvas (it never converges at threshold 0), the AR decoding
  # emits the fixed tokens at their slots.
  ar = jax.tree_util.tree_map(np.asarray, sampler.infill(
      params, CFG, cfg.replace(confidence_threshold=0.0, ar_fallback="unconverged"), PROMPT,
      VALID, prefix, suffix, middle, jax.random.PRNGKey(0)))
  assert (ar.ar_canvases == 2).all()
  np.testing.assert_array_equal(ar.tokens[:, :2], np.broadcast_to(prefix, (3, 2)))
  np.testing.assert_array_equal(ar.tokens[:, 6:10], np.broadcast_to(suffix, (3, 4)))


def test_infill_slots_checks():
  tokens, mask = sampler.infill_slots([5], [7, 8], 2, 8, PAD)
  np.testing.assert_array_equal(tokens, [5, PAD, PAD, 7, 8, PAD, PAD, PAD])
  np.testing.assert_array_equal(mask, [1, 0, 0, 1, 1, 0, 0, 0])
  with pytest.raises(ValueError, match="exceed the 8 reply slots"):
    sampler.infill_slots([5], [7, 8], 6, 8, PAD)
  with pytest.raises(ValueError, match="needs a suffix"):
    sampler.infill_slots([5], [], 2, 8, PAD)


def brute_force_canvas(params, cfg, rng, fixed, mask):
  """One canvas of the reference sampler (no prefix canvas before it), row by row in numpy,
  with the fixed slots clamped: at a fixed slot the draw and argmax are the fixed token and
  the entropy 0. The decoder and the temperature schedule are the model's and the sampler's
  (checked against transformers elsewhere); the keys are derived as generate derives them."""
  b = PROMPT.shape[0]
  cache = transformer.init_cache(CFG, b, PROMPT.shape[1] + C)
  _, cache = transformer.encode(params, CFG, jnp.asarray(PROMPT), cache, jnp.asarray(VALID))
  decode = jax.jit(lambda x, sc, m: transformer.decode(params, CFG, x, cache, None, sc, m))
  init_key, loop_key = jax.random.split(jax.random.fold_in(rng, 0))
  canvas = np.where(mask, fixed, np.asarray(jax.random.randint(init_key, (b, C), 0, V)))
  argmax = canvas.copy()
  self_cond = np.zeros((b, C, V), np.float32)
  history = np.full((b, C), -1)
  finished = np.zeros(b, bool)
  steps = np.zeros(b, int)
  for step in range(cfg.max_denoising_steps):
    if finished.all():
      break
    sample_key, noise_key = jax.random.split(jax.random.fold_in(loop_key, step))
    logits = np.asarray(decode(canvas, self_cond, np.full((b,), step > 0)))
    tempered = logits / np.asarray(sampler.temperature(cfg.max_denoising_steps - step, cfg))
    u = np.asarray(jax.random.uniform(sample_key, (b, C, 1), jnp.float32))
    noise = np.asarray(jax.random.randint(noise_key, (b, C), 0, V))
    for r in range(b):
      if finished[r]:
        continue
      steps[r] += 1
      logp = tempered[r] - tempered[r].max(-1, keepdims=True)
      logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
      ent = -(np.exp(logp) * logp).sum(-1)
      cdf = np.cumsum(np.exp(logp), -1)
      draw = np.minimum((cdf <= u[r] * cdf[:, -1:]).sum(-1), V - 1)
      top = tempered[r].argmax(-1)
      draw, top = np.where(mask[r], fixed[r], draw), np.where(mask[r], fixed[r], top)
      ent = np.where(mask[r], 0.0, ent)
      order = sorted(range(C), key=lambda j: (ent[j], j))
      accepted, total = np.zeros(C, bool), 0.0
      for j in order:  # the longest prefix whose sum without its own entry is <= bound
        if total <= cfg.entropy_bound:
          accepted[j] = True
        total += ent[j]
      canvas[r] = np.where(accepted, draw, noise[r])
      argmax[r] = top
      stable = (history[r] == top).all()
      history[r] = top
      self_cond[r] = tempered[r]
      finished[r] = stable and ent.mean() < cfg.confidence_threshold
  return argmax, steps


def test_infill_matches_brute_force_reference(params):
  """Tiny model, one canvas from pure noise, a prefix and a suffix fixed; the stop test can
  fire (threshold above log V), so rows end at different steps."""
  cfg = sampler.SamplerConfig(max_denoising_steps=5, max_new_tokens=C, confidence_threshold=5.0)
  prefix, suffix = [20], [30, 31]
  tokens_L, mask_L = sampler.infill_slots(prefix, suffix, 3, C, PAD)
  fixed, mask = np.repeat(tokens_L[None], 3, 0), np.repeat(mask_L[None], 3, 0)
  rng = jax.random.PRNGKey(4)
  want, want_steps = brute_force_canvas(params, cfg, rng, fixed, mask)
  out = jax.tree_util.tree_map(np.asarray, sampler.make_generate_fn(CFG, cfg)(
      params, PROMPT, VALID, rng, fixed, mask))
  # Stop ids in the reply (none forced here) would pad what follows: compare up to them.
  got = out.tokens
  for r in range(3):
    eos = np.flatnonzero((want[r] == CFG.eos_token_id) & (np.arange(C) > 3))
    n = eos[0] + 1 if eos.size else C
    np.testing.assert_array_equal(got[r, :n], want[r, :n], err_msg=f"row {r}")
  np.testing.assert_array_equal(out.decoder_passes, want_steps)
