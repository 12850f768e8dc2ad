"""Our model against transformers' DiffusionGemmaForBlockDiffusion in float32 (max abs < 1e-4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffgemma.io import hf_weights
from diffgemma.model import transformer
from tests import reference

TOL = 1e-4
# Passes on top of committed canvases read K/V that each side rounded on its own in earlier
# passes; in this deliberately ill-conditioned random model (weights 0.2·N(0,1)) float32 rounding
# then compounds to ~1e-4 by the third canvas, as the reference's own float32-vs-float64 gap
# does. A real mismatch shows as >1e-2.
TOL_CHAINED = 2e-4

# (name, text overrides, batch, prompt length, left-padding per row, canvases in sequence)
CASES = [
    # 7 layers: 5 sliding, 1 full, and the forced-full last layer; one global KV head.
    ("short_prompt", dict(num_hidden_layers=7), 2, 6, [0, 0], 2),
    # 8 layers: the 5:1 pattern wraps (S S S S S F S F); two global KV heads; prompt > window;
    # left padding of different lengths per row.
    ("long_prompt_padded", dict(num_hidden_layers=8, num_global_key_value_heads=2), 3, 13,
     [0, 2, 5], 3),
    # Global KV heads equal to all heads, GQA on sliding layers only, a canvas wider than the window.
    ("wide_canvas", dict(num_hidden_layers=6, num_global_key_value_heads=4, sliding_window=5), 2,
     9, [3, 0], 2),
]


@pytest.mark.parametrize("name,overrides,batch,prompt_len,pads,num_canvases", CASES,
                         ids=[c[0] for c in CASES])
def test_encoder_and_decoder_logits_match_reference(name, overrides, batch, prompt_len, pads,
                                                    num_canvases):
  canvas_len = 8
  ref_model = reference.tiny_reference(seed=len(name), canvas_length=canvas_len, **overrides)
  cfg = hf_weights.config_from_hf(ref_model.config.to_dict())
  params = jax.tree_util.tree_map(jnp.asarray, hf_weights.params_from_hf(
      reference.state_dict_numpy(ref_model), cfg))

  rng = np.random.default_rng(0)
  prompt = rng.integers(3, cfg.vocab_size, (batch, prompt_len))
  valid = np.arange(prompt_len)[None, :] >= np.asarray(pads)[:, None]
  prompt = np.where(valid, prompt, cfg.pad_token_id)
  session = reference.ReferenceSession(ref_model, valid)
  cache = transformer.init_cache(cfg, batch, prompt_len + num_canvases * canvas_len)
  encode = jax.jit(lambda p, t, c, v: transformer.encode(p, cfg, t, c, v))
  decode = jax.jit(lambda p, x, c, sc, m: transformer.decode(p, cfg, x, c, None, sc, m))

  theirs = session.encode(prompt)
  hidden, cache = encode(params, jnp.asarray(prompt), cache, jnp.asarray(valid))
  ours = np.asarray(transformer.lm_head(params, hidden, cfg))
  # Padding rows attend to nothing real; only real positions are compared.
  np.testing.assert_array_less(np.abs(ours - theirs)[valid].max(), TOL)

  for k in range(num_canvases):
    tol = TOL if k == 0 else TOL_CHAINED
    canvas = rng.integers(0, cfg.vocab_size, (batch, canvas_len))
    theirs = session.decode(canvas)
    ours = np.asarray(decode(params, jnp.asarray(canvas), cache, None, None))
    np.testing.assert_array_less(np.abs(ours - theirs).max(), tol, err_msg=f"canvas {k} no SC")

    self_cond = rng.normal(0.0, 3.0, (batch, canvas_len, cfg.vocab_size)).astype(np.float32)
    sc_mask = np.arange(batch) % 2 == 0
    theirs = session.decode(canvas, self_cond, sc_mask)
    ours = np.asarray(decode(params, jnp.asarray(canvas), cache, jnp.asarray(self_cond),
                             jnp.asarray(sc_mask)))
    np.testing.assert_array_less(np.abs(ours - theirs).max(), tol, err_msg=f"canvas {k} SC")

    # Commit the argmax canvas to both caches, as the sampler does.
    committed = ours.argmax(-1)
    theirs = session.encode(committed)
    hidden, cache = encode(params, jnp.asarray(committed), cache, None)
    ours = np.asarray(transformer.lm_head(params, hidden, cfg))
    np.testing.assert_array_less(np.abs(ours - theirs).max(), TOL_CHAINED,
                                  err_msg=f"commit {k}")
