"""AR fallback per canvas (SamplerConfig.ar_fallback): off keeps today's generation bitwise; a
canvas that falls back is decoded exactly as sampler.mode="ar" decodes, token for token (greedy);
the statistics count the AR forwards."""

import jax
import numpy as np
import pytest

from diffgemma.model import config, transformer
from diffgemma.sampling import sampler

CFG = config.tiny(num_layers=2, layer_types=())  # canvas 8, vocab 64
PAD = CFG.pad_token_id
PROMPT = np.array([[0, 0, 5, 6, 7], [9, 4, 5, 6, 7], [0, 10, 11, 12, 13]], np.int32)
VALID = PROMPT != PAD
MAX_NEW = 3 * CFG.canvas_length


@pytest.fixture(scope="module")
def params():
  return transformer.init_params(CFG, jax.random.key(0, impl="rbg"))


@pytest.fixture(scope="module")
def ar(params):
  """mode="ar" (greedy) on the same prompts and budget."""
  return generate(params, sampler.SamplerConfig(mode="ar", max_new_tokens=MAX_NEW))


def generate(params, sampler_cfg, seed=1, model_cfg=CFG):
  fn = sampler.make_generate_fn(model_cfg, sampler_cfg)
  return jax.tree_util.tree_map(np.asarray, fn(params, PROMPT, VALID, jax.random.PRNGKey(seed)))


def test_a_rule_that_never_fires_is_bitwise_the_plain_sampler(params):
  """The entropy rule with an unreachable threshold runs the fallback program (logits carried,
  the AR branch compiled) yet gives exactly the plain sampler's tokens and statistics."""
  base = sampler.SamplerConfig(max_denoising_steps=6, max_new_tokens=MAX_NEW)
  plain = generate(params, base)
  never = generate(params, base.replace(ar_fallback="entropy", ar_fallback_entropy=1e9,
                                        ar_fallback_after_steps=2))
  for key, value in plain.to_dict().items():
    np.testing.assert_array_equal(getattr(never, key), value, err_msg=key)
  np.testing.assert_array_equal(never.ar_canvases, 0)
  np.testing.assert_array_equal(never.ar_passes, 0)
  assert sorted(never.to_dict().keys() - plain.to_dict().keys()) == [
      "ar_canvases", "ar_passes", "canvas_ar"]


@pytest.mark.parametrize("rule", ["unconverged", "entropy"])
def test_fallback_on_every_canvas_equals_ar_mode(params, ar, rule):
  """Every canvas falls back ("unconverged": the adaptive stop can never fire with
  confidence_threshold 0; "entropy": threshold 0 after 2 steps), so the reply is AR decoding
  canvas by canvas: the first canvas equals mode="ar" token for token (the same program on the
  same cache), and so does the whole reply (later canvases start from the commit pass's last
  logits). Forwards: the denoising steps spent plus one per AR token, as mode="ar" counts."""
  cfg = sampler.SamplerConfig(max_denoising_steps=4, max_new_tokens=MAX_NEW,
                              confidence_threshold=0.0, ar_fallback=rule,
                              ar_fallback_entropy=0.0, ar_fallback_after_steps=2)
  out = generate(params, cfg)
  c = CFG.canvas_length
  np.testing.assert_array_equal(out.tokens[:, :c], ar.tokens[:, :c])
  np.testing.assert_array_equal(out.tokens, ar.tokens)
  np.testing.assert_array_equal(out.ar_canvases, out.num_canvases)
  np.testing.assert_array_equal(out.ar_passes, ar.decoder_passes)
  steps = 4 if rule == "unconverged" else 2
  ran = np.arange(out.canvas_steps.shape[1])[None] < out.num_canvases[:, None]
  np.testing.assert_array_equal(out.canvas_steps, np.where(ran, steps, 0))
  np.testing.assert_array_equal(out.canvas_ar, ran)
  np.testing.assert_array_equal(out.decoder_passes,
                                out.canvas_steps.sum(-1) + out.ar_passes)
  np.testing.assert_allclose(out.tokens_per_forward,
                             out.num_tokens / out.decoder_passes, rtol=1e-6)
  assert (out.tokens_per_forward < ar.tokens_per_forward).all()


def test_ar_canvas_leaves_other_rows_alone(params, ar):
  """Rows outside `rows_B` keep their canvas; a decoded row equals mode="ar"'s first canvas,
  whatever the other rows do; pads follow a stop id."""
  b, p = PROMPT.shape
  canvas = np.full((b, CFG.canvas_length), 7, np.int32)
  rows = np.array([False, True, False])
  cfg = sampler.SamplerConfig(max_new_tokens=CFG.canvas_length)

  @jax.jit
  def decode(params):
    cache = transformer.init_cache(CFG, b, p + CFG.canvas_length)
    hidden, cache = transformer.encode(params, CFG, PROMPT, cache, VALID)
    logits = transformer.lm_head(params, hidden[:, -1], CFG)
    return sampler.ar_canvas(params, CFG, cfg, cache, logits, rows, canvas,
                             jax.random.PRNGKey(0))

  out, passes = decode(params)
  np.testing.assert_array_equal(np.asarray(out)[~rows], canvas[~rows])
  np.testing.assert_array_equal(np.asarray(out)[1], ar.tokens[1, :CFG.canvas_length])
  stopped = np.isin(ar.tokens[1, :CFG.canvas_length], (CFG.eos_token_id,))
  first = np.flatnonzero(stopped)
  np.testing.assert_array_equal(np.asarray(passes),
                                [0, first[0] + 1 if first.size else CFG.canvas_length, 0])


def test_fallback_config_checks():
  with pytest.raises(ValueError, match="unknown ar_fallback"):
    sampler.SamplerConfig(ar_fallback="sometimes")
  with pytest.raises(ValueError, match="mode='diffusion'"):
    sampler.SamplerConfig(mode="ar", ar_fallback="entropy")
  with pytest.raises(ValueError, match="ar_fallback_after_steps"):
    sampler.SamplerConfig(max_denoising_steps=4, ar_fallback="entropy",
                          ar_fallback_after_steps=5)


def test_ar_on_a_run_that_never_trained_the_encoder_head_warns(tmp_path):
  """eval.py and sample.py print one warning line when AR decoding (or AR fallback) would read
  an encoder next-token head the run never trained; a trained head or plain diffusion: none."""
  from diffgemma.training import loaded
  from tests.helpers import save_sft_run, tiny_sudoku_config

  config = tiny_sudoku_config()
  assert config.loss.encoder_weight == 0  # the Sudoku default trains the decoder only
  save_sft_run(config, str(tmp_path / "decoder_only"))
  config.loss.encoder_weight = 1.0
  save_sft_run(config, str(tmp_path / "both"))
  untrained = str(tmp_path / "decoder_only")
  for overrides in ({"mode": "ar"}, {"ar_fallback": "unconverged"}):
    line = loaded.open_run(untrained, **overrides).untrained_ar_head()
    assert line.startswith(f"warning: {untrained} never trained the encoder's next-token head")
    assert "\n" not in line
  assert loaded.open_run(untrained).untrained_ar_head() is None
  assert loaded.open_run(str(tmp_path / "both"), mode="ar").untrained_ar_head() is None
