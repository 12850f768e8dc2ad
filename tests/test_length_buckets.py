"""Per-batch prompt widths (`base.prompt_widths`, `evaluation.generate_in_batches`): few compiled
shapes, only left padding cut, replies in the prompts' order and equal to the uncut ones."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from diffgemma.model import config, transformer
from diffgemma.sampling import sampler
from diffgemma.tasks.base import PROMPT_WIDTH_LEVELS, Prompts, prompt_width, prompt_widths
from diffgemma.training import evaluation


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4096), st.data())
def test_a_batch_takes_the_smallest_width_that_holds_its_longest_prompt(full, data):
  longest = data.draw(st.integers(0, full))
  widths = prompt_widths(full)
  assert len(widths) <= PROMPT_WIDTH_LEVELS and widths[-1] == full
  assert list(widths) == sorted(set(widths)) and all(w % 16 == 0 for w in widths[:-1])
  width = prompt_width(longest, full)
  assert width in widths and width >= longest
  assert all(w < longest for w in widths if w < width)  # brute force: none smaller holds it
  if width > widths[0]:  # the next smaller one is too short: the kept padding is under about
    assert width - longest < width // 2 + 16  # half the width (16-slot rounding aside)


def ragged_prompts(n: int, full: int, seed: int, vocab: int = 64) -> Prompts:
  """n left-padded prompts (pad 0) of random lengths 1..full, ids in [3, vocab)."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, full + 1, n)
  valid = np.arange(full)[None, :] >= full - lengths[:, None]
  tokens = np.where(valid, rng.integers(3, vocab, (n, full)), 0).astype(np.int32)
  return Prompts(tokens, valid, list(range(n)))


def test_batches_cut_only_left_padding_and_replies_come_back_in_order():
  """A stub sampler whose reply is the row's last prompt id and valid count: every call sees a
  width of `prompt_widths`, keeps all of each row's valid slots, and the rows come back in the
  prompts' order; Sudoku-like full prompts keep their order and width."""
  full, n, batch = 96, 37, 5
  prompts = ragged_prompts(n, full, seed=0)
  seen = []

  def stub(params, prompt_BxP, valid_BxP, rng):
    del params, rng
    seen.append(prompt_BxP.shape[1])
    valid = np.asarray(valid_BxP)
    reply = np.stack([np.asarray(prompt_BxP)[:, -1], valid.sum(1)], axis=1).astype(np.int32)
    ones = np.ones(len(valid))
    return sampler.GenerateOutput(tokens=reply, num_tokens=valid.sum(1).astype(np.int32),
                                  num_canvases=ones.astype(np.int32), tokens_per_forward=ones,
                                  steps_per_canvas=valid.sum(1).astype(np.float64),
                                  decoder_passes=ones.astype(np.int32),
                                  commit_passes=ones.astype(np.int32))

  tokens, stats, _ = evaluation.generate_in_batches(None, stub, prompts, batch, seed=0)
  lengths = prompts.valid_NxP.sum(1)
  np.testing.assert_array_equal(tokens[:, 0], prompts.prompt_NxP[:, -1])
  np.testing.assert_array_equal(tokens[:, 1], lengths)  # no valid slot was cut
  np.testing.assert_array_equal(stats["steps_per_canvas"], lengths)
  # By hand: P=96 gives widths 16, 32, 48, 96; batches of 5 take rows longest first.
  assert prompt_widths(full) == (16, 32, 48, 96)
  ordered = sorted(lengths, reverse=True)
  expected = [min(w for w in (16, 32, 48, 96) if w >= max(ordered[i:i + batch]))
              for i in range(0, n, batch)]
  assert seen == expected and len(set(seen)) > 1

  seen.clear()  # prompts that fill P: one width, the order and batches unchanged
  full_prompts = dataclasses.replace(prompts, valid_NxP=np.ones_like(prompts.valid_NxP))
  tokens, _, _ = evaluation.generate_in_batches(None, stub, full_prompts, batch, seed=0)
  assert set(seen) == {full}
  np.testing.assert_array_equal(tokens[:, 1], full)


def test_a_cut_batch_replies_as_the_padded_one_on_a_tiny_model():
  """The sampler on a tiny model: a batch of ragged prompts cut to its width replies (diffusion,
  the same key) with the same tokens as at the full width (positions are slot indices and the
  attention sees only relative ones); the encoder's hidden states agree to 1e-5; and
  evaluate() with buckets gives the same greedy (AR) replies as without."""
  cfg = config.tiny(num_layers=3, layer_types=("sliding_attention", "sliding_attention",
                                               "full_attention"))
  params = transformer.init_params(cfg, jax.random.key(0, impl="rbg"))
  full = 48
  prompts = ragged_prompts(6, full, seed=1, vocab=cfg.vocab_size)
  prompts = prompts.take(np.argsort(-prompts.needed_widths(), kind="stable"))
  batch = prompts.take(slice(3, 6))  # the three shortest
  width = prompt_width(int(batch.needed_widths().max()), full)
  assert width < full
  scfg = sampler.SamplerConfig(max_denoising_steps=4, max_new_tokens=2 * cfg.canvas_length)
  fn = sampler.make_generate_fn(cfg, scfg)
  key = jax.random.PRNGKey(3)
  padded = fn(params, batch.prompt_NxP, batch.valid_NxP, key)
  cut_batch = batch.cut_to(width)
  cut = fn(params, cut_batch.prompt_NxP, cut_batch.valid_NxP, key)
  np.testing.assert_array_equal(np.asarray(cut.tokens), np.asarray(padded.tokens))
  np.testing.assert_array_equal(np.asarray(cut.num_tokens), np.asarray(padded.num_tokens))
  with pytest.raises(ValueError, match="cannot cut prompts to 16 slots"):
    prompts.cut_to(16)

  def hidden(tokens, valid):
    cache = transformer.init_cache(cfg, len(tokens), tokens.shape[1])
    h, _ = transformer.encode(params, cfg, tokens, cache, valid)
    return np.asarray(h)

  valid = cut_batch.valid_NxP
  h_full = hidden(batch.prompt_NxP, batch.valid_NxP)[:, full - width:]
  h_cut = hidden(cut_batch.prompt_NxP, valid)
  np.testing.assert_allclose(h_cut[valid], h_full[valid], atol=1e-5, rtol=1e-5)

  class Task:
    def score(self, prompts, tokens, stats):
      return {"accuracy": 0.0}, [{"tokens": t.tolist()} for t in tokens]

  ar = dataclasses.replace(scfg, mode="ar")
  _, bucketed = evaluation.evaluate(Task(), params, cfg, ar, prompts, 3)
  _, padded_all = evaluation.evaluate(Task(), params, cfg, ar, prompts, 3, length_buckets=False)
  assert bucketed == padded_all
