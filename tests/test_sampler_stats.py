"""Our sampler and the reference's `generate` agree in distribution on the same weights.

tests/test_sampler.py checks the per-step pieces (temperature, acceptance mask, stopping rule,
EOS handling) exactly against the reference on identical logits; this checks the whole loop:
the mean steps per canvas and tokens per forward pass (TPF) of both implementations, over the
same prompt rows with fixed seeds, must pass Welch's two-sided t-test at ALPHA. The seeds are
fixed, so the outcome is deterministic; a control shows that the test tells apart a sampler
that stops about a third later. The sampler's inverse-CDF draw is checked against softmax by
chi-square.
"""

import jax
import numpy as np
import pytest
import scipy.stats
import torch

from diffgemma.sampling import sampler
from tests import reference_sampling as rs

# Under equal means a fixed-seed run fails with probability ALPHA per statistic.
ALPHA = 1e-3
ROWS, SEEDS = 96, (0, 1)
CANVAS, CANVASES = 16, 2
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
            num_global_key_value_heads=1, sliding_window=64, num_experts=4, top_k_experts=2,
            moe_intermediate_size=24, max_position_embeddings=256)
WEIGHT_STD, BRANCH_SCALE, TOKEN_NORM_SPREAD = 0.2, 0.2, 1.0
PROMPT_LEN = 8


@pytest.fixture(scope="module")
def setup():
  # One torch thread: as fast here, and immune to the stalls of spinning threads on a busy CPU.
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  ref = rs.reference_model(0, CANVAS, WEIGHT_STD, "sdpa", **TEXT)
  rs.bias_to_copy_(ref, BRANCH_SCALE, TOKEN_NORM_SPREAD, seed=1)
  cfg, params = rs.load_ours(ref, moe_impl="tiled", moe_tile_size=16)
  prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, (ROWS, PROMPT_LEN), np.int32)
  sampler_cfg = sampler.SamplerConfig(max_new_tokens=CANVASES * CANVAS)  # report defaults
  stats = {"ours": rs.ours_stats(params, cfg, sampler_cfg, prompt, SEEDS),
           "theirs": rs.reference_stats(ref, cfg, sampler_cfg, prompt, SEEDS)}
  yield ref, cfg, prompt, sampler_cfg, stats
  torch.set_num_threads(threads)


def test_steps_and_tpf_agree_with_reference(setup):
  *_, sampler_cfg, stats = setup
  steps = stats["theirs"]["steps_per_canvas"]
  # The statistics are informative: canvases stop early, after a number of steps that varies.
  assert steps.mean() < 0.5 * sampler_cfg.max_denoising_steps and steps.std() > 1.0
  for stat in rs.STATS:
    result = rs.compare_means(stats["ours"][stat], stats["theirs"][stat], stat, ALPHA)
    assert result.agree, str(result)


def test_comparison_detects_slower_stopping(setup):
  """Power: a reference that needs four stable steps instead of one (here 10.1 instead of 7.4
  steps per canvas) must be told apart from ours by the same test on the same rows."""
  ref, cfg, prompt, sampler_cfg, stats = setup
  slower = sampler_cfg.replace(stability_threshold=sampler_cfg.stability_threshold + 3)
  other = rs.reference_stats(ref, cfg, slower, prompt, SEEDS)
  result = rs.compare_means(stats["ours"]["steps_per_canvas"], other["steps_per_canvas"],
                            "steps_per_canvas", ALPHA)
  assert not result.agree, str(result)


def test_sample_categorical_follows_softmax():
  """Chi-square goodness of fit of 20000 draws per row; zero-probability tokens never drawn."""
  draws, vocab = 20000, 16
  rng = np.random.default_rng(0)
  logits = np.stack([np.zeros(vocab), 2.0 * rng.normal(size=vocab),
                     np.where(np.arange(vocab) % 3 == 0, -np.inf, rng.normal(size=vocab)),
                     8.0 * rng.normal(size=vocab)]).astype(np.float32)
  log_probs = jax.nn.log_softmax(np.broadcast_to(logits, (draws,) + logits.shape), axis=-1)
  samples = np.asarray(sampler.sample_categorical(jax.random.PRNGKey(0), log_probs))
  probs = np.asarray(jax.nn.softmax(logits, axis=-1), np.float64)
  for row in range(len(logits)):
    counts = np.bincount(samples[:, row], minlength=vocab)
    # Categories expected fewer than 5 times are pooled, as the chi-square test requires.
    big = probs[row] * draws >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(probs[row, big], probs[row, ~big].sum())
    keep = expected > 0
    expected = expected[keep] / expected[keep].sum() * draws
    p_value = scipy.stats.chisquare(observed[keep], expected).pvalue
    assert p_value >= ALPHA, f"row {row}: p = {p_value}"
    assert counts[probs[row] == 0].sum() == 0
