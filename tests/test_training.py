"""Forward process, SFT loss, data pipeline and exact resume of the training loop."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffgemma.model import transformer
from diffgemma.model.config import FULL, SLIDING, tiny
from diffgemma.runs import provenance
from diffgemma.tasks import Layout
from diffgemma.tasks import sudoku
from diffgemma.training import diffusion, loop, losses
from tests.helpers import restore_run, tiny_sudoku_config

# The loss checks need both attention kinds, not depth: one sliding and one full layer compile
# in a third of the 7-layer test model's time.
LOSS_CFG = tiny(canvas_length=4, num_layers=2, layer_types=(SLIDING, FULL))


@pytest.mark.parametrize("schedule", diffusion.SCHEDULES)
def test_corruption_keeps_alpha_fraction_and_noise_is_uniform(schedule):
  rng = jax.random.PRNGKey(0)
  t = jnp.array([0.1, 0.5, 0.9])
  clean = jnp.full((3, 20000), 5, jnp.int32)
  noisy = diffusion.corrupt(rng, clean, t, 16, schedule)
  changed = np.asarray(noisy != clean).mean(1)
  # A replaced token equals the clean one with probability 1/V, so P(changed) = (1-a)(1-1/V).
  expected = (1 - np.asarray(diffusion.alpha(t, schedule))) * (1 - 1 / 16)
  np.testing.assert_allclose(changed, expected, atol=0.015)  # ~4 sigma at n=20000
  counts = np.bincount(np.asarray(noisy[2])[np.asarray(noisy[2] != 5)], minlength=16)
  assert counts[5] == 0 and counts.min(initial=10**9, where=np.arange(16) != 5) > 0.8 * counts.max()


def test_corruption_touches_only_corruptible_positions():
  clean = jnp.arange(10)[None].repeat(4, 0)
  mask = jnp.arange(10)[None] >= 5
  noisy = diffusion.corrupt(jax.random.PRNGKey(1), clean, jnp.full((4,), 0.999), 64, "linear",
                            mask.repeat(4, 0))
  np.testing.assert_array_equal(noisy[:, :5], clean[:, :5])
  assert (noisy[:, 5:] != clean[:, 5:]).mean() > 0.9


def test_always_corrupted_positions_are_replaced_at_any_t_and_the_rest_draw_the_same():
  """`always_BxC` (loss.fill_noise="always"): those positions take the noise token drawn for
  them even at t near 0; every other position is bitwise what the call without it gives."""
  rng, t = jax.random.PRNGKey(3), jnp.array([0.01, 0.5, 0.99])
  clean = jnp.full((3, 64), 7, jnp.int32)
  always = jnp.arange(64)[None].repeat(3, 0) >= 48
  plain = diffusion.corrupt(rng, clean, t, 32, "linear")
  forced = diffusion.corrupt(rng, clean, t, 32, "linear", None, always)
  np.testing.assert_array_equal(forced[:, :48], plain[:, :48])
  # The noise tokens are the same draws; a forced position shows its draw (brute force).
  keep_rng, noise_rng = jax.random.split(rng)
  noise = jax.random.randint(noise_rng, clean.shape, 0, 32, clean.dtype)
  np.testing.assert_array_equal(forced[:, 48:], noise[:, 48:])


def test_sqrt_noise_levels_are_the_square_roots_of_the_uniform_draws():
  rng = jax.random.PRNGKey(4)
  u = np.asarray(diffusion.sample_noise_level(rng, 20000, 1e-3))
  t = np.asarray(diffusion.sample_noise_level(rng, 20000, 1e-3, "sqrt"))
  np.testing.assert_allclose(t, np.sqrt(u), rtol=1e-6)
  assert abs(t.mean() - 2 / 3) < 0.01  # density 2t on (0, 1]: mean 2/3, ~5 sigma at n=20000
  with pytest.raises(ValueError, match="choose one of"):
    diffusion.sample_noise_level(rng, 2, 1e-3, "beta")


def test_fill_noise_always_corrupts_every_eos_fill_token_of_the_scored_canvas():
  """sample_draws with loss.fill_noise="always": the scored canvas's EOS fill is noise
  whatever t is; the reply's tokens are corrupted exactly as under "as_reply"."""
  cfg = LOSS_CFG
  layout = Layout(prompt_len=2, num_canvases=2, canvas_length=cfg.canvas_length)
  c = cfg.canvas_length
  reply = np.array([[5, 6, 7, cfg.eos_token_id, cfg.eos_token_id, cfg.eos_token_id,
                     cfg.eos_token_id, cfg.eos_token_id]] * 16, np.int32)
  tokens = np.concatenate([np.full((16, 2), 3, np.int32), reply], 1)
  batch = {"tokens": jnp.asarray(tokens), "valid": jnp.ones(tokens.shape, bool),
           "loss_mask": jnp.asarray(np.arange(tokens.shape[1])[None].repeat(16, 0) >= 2)}
  rng = jax.random.PRNGKey(5)
  base = losses.sample_draws(rng, cfg, losses.LossConfig(t_eps=0.5), layout, batch)
  always = losses.sample_draws(rng, cfg, losses.LossConfig(t_eps=0.5, fill_noise="always"),
                               layout, batch)
  np.testing.assert_array_equal(always.canvas_U, base.canvas_U)
  np.testing.assert_array_equal(always.t_U, base.t_U)
  clean_UxC = np.stack([reply[0, k * c:(k + 1) * c] for k in np.asarray(base.canvas_U)])
  fill = clean_UxC == cfg.eos_token_id
  noisy, plain = np.asarray(always.noisy_UxC), np.asarray(base.noisy_UxC)
  np.testing.assert_array_equal(noisy[~fill], plain[~fill])
  # A forced fill token is a uniform draw: it equals EOS with probability 1/V only.
  assert (noisy[fill] == cfg.eos_token_id).mean() < 0.2 and fill.sum() >= 16


def test_sft_loss_matches_hand_computation():
  """Decoder CE recomputed from the model's pieces with the same random draws."""
  cfg = LOSS_CFG
  params = transformer.init_params(cfg, jax.random.PRNGKey(0), std=0.3)
  p, k, b = 3, 2, 4
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (b, p + k * 4)), jnp.int32)
  loss_mask = jnp.asarray(np.arange(p + k * 4) >= p)[None].repeat(b, 0)
  loss_mask = loss_mask.at[1, p:p + 4].set(False)  # row 1: canvas 0 unsupervised -> k must be 1
  batch = {"tokens": tokens, "valid": jnp.ones_like(loss_mask), "loss_mask": loss_mask}
  loss_cfg = losses.LossConfig(encoder_weight=0.5, self_conditioning_prob=0.5)
  layout = Layout(p, k, 4)
  # Jitted: op-by-op dispatch of the model is ~5x slower than one compile.
  sft_loss = jax.jit(losses.sft_loss, static_argnums=(1, 2, 3))
  encode = jax.jit(transformer.encode, static_argnums=1)
  decode = jax.jit(transformer.decode, static_argnums=1)
  total, metrics = sft_loss(params, cfg, loss_cfg, layout, batch, jax.random.PRNGKey(3))

  # Encoder CE by hand: next-token over supervised targets.
  cache = transformer.init_cache(cfg, b, p + k * 4)
  hidden, cache = encode(params, cfg, tokens, cache)
  logp = jax.nn.log_softmax(transformer.lm_head(params, hidden, cfg)[:, :-1])
  nll = -np.take_along_axis(np.asarray(logp), np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  m = np.asarray(loss_mask)[:, 1:]
  np.testing.assert_allclose(metrics["encoder_loss"], (nll * m).sum() / m.sum(), rtol=1e-5)

  # Decoder CE by hand with the same draws (the rng split order of sft_loss).
  canvas_rng, t_rng, noise_rng = jax.random.split(jax.random.PRNGKey(3), 3)
  has = np.asarray(loss_mask[:, p:]).reshape(b, k, 4).any(-1)
  k_b = np.asarray(jax.random.categorical(canvas_rng, jnp.where(has, 0.0, -jnp.inf)))
  assert k_b[1] == 1
  start = p + 4 * k_b
  clean = np.stack([np.asarray(tokens)[i, s:s + 4] for i, s in enumerate(start)])
  t = diffusion.sample_noise_level(t_rng, b, loss_cfg.t_eps)
  target = np.stack([np.asarray(loss_mask)[i, s:s + 4] for i, s in enumerate(start)])
  noisy = diffusion.corrupt(noise_rng, jnp.asarray(clean), t, cfg.vocab_size, "linear",
                            jnp.asarray(target))
  first = decode(params, cfg, noisy, cache, jnp.asarray(start))
  sc_mask = jnp.arange(b) % 2 == 0  # prob 0.5: the first row of every pair
  logits = decode(params, cfg, noisy, cache, jnp.asarray(start), first, sc_mask)
  nll = -np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), clean[..., None], -1)[..., 0]
  expected_dec = (nll * target).sum() / target.sum()
  np.testing.assert_allclose(metrics["decoder_loss"], expected_dec, rtol=1e-5)
  np.testing.assert_allclose(total, 0.5 * metrics["encoder_loss"] + expected_dec, rtol=1e-5)


def test_end_weight_weights_each_reply_end_in_both_terms():
  """loss.end_weight: the encoder and decoder CE are weighted means (float64 numpy) in which
  each row's last supervised non-EOS token weighs end_weight and every other scored token 1."""
  cfg, eos = LOSS_CFG, LOSS_CFG.eos_token_id
  params = transformer.init_params(cfg, jax.random.PRNGKey(0), std=0.3)
  p, k, c = 3, 2, cfg.canvas_length
  rng = np.random.default_rng(1)
  reply_lens = (3, 5, 8, 2)  # the end in canvas 0, in canvas 1, at the very last slot, canvas 0
  tokens = rng.integers(3, cfg.vocab_size, (len(reply_lens), p + k * c)).astype(np.int32)
  loss_mask = np.zeros(tokens.shape, bool)
  for row, n in enumerate(reply_lens):
    filled = -(-n // c) * c
    tokens[row, p + n:p + filled] = eos
    loss_mask[row, p:p + filled] = True
  end = np.zeros(tokens.shape, bool)
  end[np.arange(len(reply_lens)), p + np.array(reply_lens) - 1] = True
  np.testing.assert_array_equal(losses.reply_end_mask(jnp.asarray(tokens), jnp.asarray(loss_mask),
                                                      eos), end)
  batch = {"tokens": jnp.asarray(tokens), "valid": jnp.ones(tokens.shape, bool),
           "loss_mask": jnp.asarray(loss_mask)}
  layout, weight = Layout(p, k, c), 6.0
  loss_cfg = losses.LossConfig(encoder_weight=0.5, self_conditioning_prob=0.0, end_weight=weight)
  draws = losses.sample_draws(jax.random.PRNGKey(2), cfg, loss_cfg, layout, batch)
  _, metrics = jax.jit(losses.sft_loss, static_argnums=(1, 2, 3))(
      params, cfg, loss_cfg, layout, batch, jax.random.PRNGKey(3), draws)

  w = np.where(end, weight, 1.0)
  cache = transformer.init_cache(cfg, len(reply_lens), p + k * c)
  hidden, cache = jax.jit(transformer.encode, static_argnums=1)(params, cfg, batch["tokens"], cache)
  logp = np.asarray(jax.nn.log_softmax(transformer.lm_head(params, hidden, cfg)[:, :-1]),
                    np.float64)
  nll = -np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
  m = loss_mask[:, 1:] * w[:, 1:]
  np.testing.assert_allclose(metrics["encoder_loss"], (nll * m).sum() / m.sum(), rtol=1e-5)

  start = p + c * np.asarray(draws.canvas_U)
  rows = np.arange(len(reply_lens))[:, None]
  window = start[:, None] + np.arange(c)
  logits = jax.jit(transformer.decode, static_argnums=1)(params, cfg, draws.noisy_UxC, cache,
                                                         jnp.asarray(start))
  logp = np.asarray(jax.nn.log_softmax(logits), np.float64)
  nll = -np.take_along_axis(logp, tokens[rows, window][..., None], -1)[..., 0]
  m = loss_mask[rows, window] * w[rows, window]
  assert (w[rows, window] == weight).any()  # some scored canvas holds its reply's end
  np.testing.assert_allclose(metrics["decoder_loss"], (nll * m).sum() / m.sum(), rtol=1e-5)


@pytest.mark.parametrize("batch, prob, expected", [
    (8, 0.5, (1, 2)), (6, 1 / 3, (1, 3)), (8, 0.75, (3, 4)), (4, 0.0, (0, 1)), (4, 1.0, (1, 1)),
    (5, 0.5, (2, 5)), (6, 0.3, (1, 3))])
def test_self_conditioning_rows_are_spread_evenly(batch, prob, expected):
  """k of every g rows: each half of the batch (a device's shard) holds its own share."""
  k, g = losses.self_conditioning_rows(batch, prob)
  assert (k, g) == expected and batch % g == 0
  mask = np.arange(batch) % g < k
  assert mask.sum() == round(batch * prob) or g == batch


def test_sudoku_examples_and_resumed_data_stream():
  config = tiny_sudoku_config()
  config.data.prompt_format = "cell_tokens"
  first = sudoku.train_batches(config.data, 4, 10, 0)
  batches = [next(first) for _ in range(4)]
  resumed = next(sudoku.train_batches(config.data, 4, 10, 3))
  for key in batches[3]:
    np.testing.assert_array_equal(resumed[key], batches[3][key])
  tokens = batches[0]["tokens"]
  assert tokens.shape == (4, 162) and batches[0]["loss_mask"][:, 81:].all()
  assert not batches[0]["loss_mask"][:, :81].any()
  # cell_tokens: prompt cell i holds 16 + 10 * i + content; canvas holds digit tokens.
  cells = (tokens[:, :81] - sudoku.CELL_TOKEN_OFFSET) // sudoku.CELL_CONTENTS
  np.testing.assert_array_equal(cells, np.broadcast_to(np.arange(81), (4, 81)))
  digits = sudoku.tokens_to_digits(tokens[:, 81:])
  content = (tokens[:, :81] - sudoku.CELL_TOKEN_OFFSET) % sudoku.CELL_CONTENTS
  assert ((content == 0) | (content == digits)).all() and (digits > 0).all()


def test_training_resumes_exactly(tmp_path):
  config = tiny_sudoku_config(workdir_steps=4)
  straight = str(tmp_path / "straight")
  resumed = str(tmp_path / "resumed")
  # The straight run also evaluates at its end: evaluation must not perturb training.
  with_eval = config.copy_and_resolve_references()
  with_eval.eval.update(dict(every_steps=4, num_puzzles=2, batch_size=2))
  with_eval.sampler.max_denoising_steps = 2
  straight_last = loop.train(with_eval, straight)
  assert 0.0 <= straight_last["eval/cell_accuracy"] <= 1.0
  loop.train(config, resumed, stop_at=2)
  last = loop.train(config, resumed)
  invocations = provenance.load_run_info(resumed)["invocations"]  # run_info.json
  assert [(i["start_step"], i["end_step"], i["stop_reason"]) for i in invocations] == [
      (0, 2, provenance.STOP_AT), (2, 4, provenance.NUM_TRAIN_STEPS)]
  assert np.isfinite(last["loss"])
  *_, a, _, step_a = restore_run(straight)
  *_, b, _, step_b = restore_run(resumed)
  assert step_a == step_b == 4
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
  assert json.load(open(os.path.join(straight, "config.json")))["batch_size"] == 4
  assert os.listdir(os.path.join(straight, "tensorboard"))


def test_periodic_eval_in_ar_mode_draws_no_denoising_traces(tmp_path):
  """sampler.mode="ar" in a run's config: the periodic eval decodes left to right, and the
  denoising traces it would draw (eval.trace_examples) are skipped (AR records no trajectory)."""
  config = tiny_sudoku_config(workdir_steps=2)
  config.eval.update(dict(every_steps=2, num_puzzles=2, batch_size=2, trace_examples=1))
  config.sampler.mode = "ar"
  last = loop.train(config, str(tmp_path / "run"))
  assert 0.0 <= last["eval/cell_accuracy"] <= 1.0


def test_multi_canvas_loss_with_earlier_canvases_in_the_cache_equals_encoding_the_history():
  """The decoder CE of canvas k, computed as sft_loss does (one encoder pass over the whole
  clean sequence, the decoder limited to the prefix before canvas k), equals the CE of the same
  corrupted canvas decoded after encoding only the clean history (prompt + canvases < k), with
  padding in the prompt and in later canvases. Both selections ("one", "all") are checked."""
  cfg = LOSS_CFG
  params = transformer.init_params(cfg, jax.random.PRNGKey(0), std=0.3)
  p, k, c, b = 5, 3, 4, 3
  rng = np.random.default_rng(1)
  tokens = rng.integers(3, cfg.vocab_size, (b, p + k * c)).astype(np.int32)
  valid = np.ones_like(tokens, bool)
  valid[0, :2] = False  # a left-padded prompt
  loss_mask = np.zeros_like(valid)
  loss_mask[:, p:] = True
  loss_mask[1, p + 2 * c:] = False  # row 1: two canvases, the third is padding
  valid[1, p + 2 * c:] = False
  batch = {k_: jnp.asarray(v) for k_, v in
           {"tokens": tokens, "valid": valid, "loss_mask": loss_mask}.items()}
  layout = Layout(p, k, c)
  decode = jax.jit(transformer.decode, static_argnums=1)
  encode = jax.jit(transformer.encode, static_argnums=1)

  def by_history(canvas_B, t_rng, noise_rng, u_rows):
    """Decoder CE of each (row, canvas) after encoding just its clean history, no self-cond."""
    t = diffusion.sample_noise_level(t_rng, len(u_rows), 1e-3)
    starts = [p + canvas_B[i] * c for i in range(len(u_rows))]
    clean = np.stack([tokens[r, s:s + c] for r, s in zip(u_rows, starts)])
    target = np.stack([loss_mask[r, s:s + c] for r, s in zip(u_rows, starts)])
    noisy = diffusion.corrupt(noise_rng, jnp.asarray(clean), t, cfg.vocab_size, "linear",
                              jnp.asarray(target))
    total, count = 0.0, 0.0
    for i, (r, s) in enumerate(zip(u_rows, starts)):
      cache = transformer.init_cache(cfg, 1, s + c)
      _, cache = encode(params, cfg, jnp.asarray(tokens[r:r + 1, :s]), cache,
                        jnp.asarray(valid[r:r + 1, :s]))
      logits = decode(params, cfg, noisy[i:i + 1], cache)
      logp = np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32)), np.float64)
      nll = -logp[np.arange(c), clean[i]]
      total += (nll * target[i]).sum()
      count += target[i].sum()
    return total / count

  loss = jax.jit(losses.sft_loss, static_argnums=(1, 2, 3))
  rng_key = jax.random.PRNGKey(7)
  canvas_rng, t_rng, noise_rng = jax.random.split(rng_key, 3)
  for selection in ("one", "all"):
    loss_cfg = losses.LossConfig(encoder_weight=0.0, encoder_scope="off",
                                 self_conditioning_prob=0.0, canvas_selection=selection)
    _, metrics = loss(params, cfg, loss_cfg, layout, batch, rng_key)
    if selection == "one":
      has = loss_mask[:, p:].reshape(b, k, c).any(-1)
      chosen = np.asarray(jax.random.categorical(canvas_rng, jnp.where(has, 0.0, -jnp.inf)))
      assert chosen[1] < 2  # the padding canvas is never chosen
      expected = by_history(chosen, t_rng, noise_rng, list(range(b)))
    else:
      u_rows = [r for r in range(b) for _ in range(k)]
      expected = by_history(np.tile(np.arange(k), b), t_rng, noise_rng, u_rows)
    np.testing.assert_allclose(metrics["decoder_loss"], expected, rtol=2e-5)


def test_a_run_from_a_sudoku_run_keeps_its_prompt_format(tmp_path, capsys):
  """The starting run's embeddings were trained on its token mapping: --init_from adopts
  sudoku.prompt_format (with a notice), and an override that contradicts it is a one-line error."""
  from diffgemma import errors
  from diffgemma.runs import checkpointing
  from diffgemma.training import loop

  source = tiny_sudoku_config()
  source.data.prompt_format = "cell_tokens"
  source.model.vocab_size = 832
  os.makedirs(tmp_path / "checkpoints")
  checkpointing.save_config(str(tmp_path), source)
  config, _, task, _, _ = loop.prepare_config(tiny_sudoku_config(), None, str(tmp_path))
  assert config.data.prompt_format == "cell_tokens" and task.prompt_format == "cell_tokens"
  assert "data.prompt_format: 'digits' -> 'cell_tokens'" in capsys.readouterr().out
  with pytest.raises(errors.ConfigError, match="drop the override"):
    loop.prepare_config(tiny_sudoku_config(), None, str(tmp_path),
                              overridden={"data.prompt_format"})
