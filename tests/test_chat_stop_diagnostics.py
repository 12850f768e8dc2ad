"""scripts/chat_stop_diagnostics.py: the stop canvas and the end-of-turn position of each example,
and the probe's shares against a brute-force count over the same decoder pass."""

import jax
import jax.numpy as jnp
import numpy as np

from diffgemma.model import transformer
from diffgemma.model.config import ModelConfig
from diffgemma.tasks import make_task
from diffgemma.training import diffusion
from tests.helpers import chat, make_config, write_jsonl
from tests.helpers import load_script

diag = load_script("chat_stop_diagnostics")


def test_stop_canvas_and_position_by_hand(tmp_path):
  # Canvases of 4 byte tokens; each reply is followed by <turn|> then EOS fill.
  path = write_jsonl(tmp_path / "d.jsonl", [chat("a", "xyz"), chat("b", "wxyz"),
                                            chat("c", "uvwxyzab"), chat("d", "abcdefg")])
  task = make_task(make_config(path, canvas_length=4, prompt_len=24, num_canvases=3))
  tokens, valid, mask, stop_canvas, end = diag.stop_canvas_batch(task, path, num=10)
  # "xyz<turn|>" fills canvas 0; "wxyz<turn|>" ends at slot 4 = canvas 1, position 0;
  # 8 letters + <turn|>: canvas 2, position 0; 7 letters: canvas 1, position 3.
  np.testing.assert_array_equal(stop_canvas, [0, 1, 2, 1])
  np.testing.assert_array_equal(end, [3, 0, 0, 3])
  eot = task.tokenizer.eot_id
  for row, (k, e) in enumerate(zip(stop_canvas, end)):
    assert tokens[row, 24 + 4 * k + e] == eot
  assert mask.shape == tokens.shape == valid.shape == (4, 24 + 3 * 4)


def test_probe_shares_equal_a_brute_force_count(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [chat(f"q{i}", "ab" * i) for i in range(1, 9)])
  config = make_config(path, canvas_length=4, prompt_len=16, num_canvases=5)
  task = make_task(config)
  cfg = ModelConfig(**{**config.model.to_dict(), "hidden_size": 32, "intermediate_size": 32,
                       "num_layers": 2, "layer_types": (), "moe_intermediate_size": 16})
  params = transformer.init_params(cfg, jax.random.PRNGKey(1))
  batch = diag.stop_canvas_batch(task, path, num=8)
  probe = diag.make_probe(cfg, task.layout, task.stop_token_ids, "linear")
  rng = jax.random.PRNGKey(3)
  out = probe(params, *batch, 0.6, rng)

  # Brute force: the same corruption and decoder pass, counted per row in numpy.
  tokens, valid, mask, stop_canvas, end = batch
  p, c = 16, 4
  encode_len = p + 4 * c
  start = p + stop_canvas * c
  clean = np.stack([tokens[i, s:s + c] for i, s in enumerate(start)])
  canvas_mask = np.stack([mask[i, s:s + c] for i, s in enumerate(start)])

  @jax.jit
  def predict(params):
    _, cache = transformer.encode(params, cfg, tokens[:, :encode_len],
                                  transformer.init_cache(cfg, 8, encode_len),
                                  valid[:, :encode_len])
    noisy = diffusion.corrupt(rng, clean, jnp.full((8,), 0.6), cfg.vocab_size, "linear",
                              canvas_mask)
    return jnp.argmax(transformer.decode(params, cfg, noisy, cache, start), -1)

  predicted = np.asarray(predict(params))
  exact = early = late = correct = total = 0
  for i in range(8):
    stops = [j for j in range(c) if predicted[i, j] in task.stop_token_ids]
    first = stops[0] if stops else c
    exact += first == end[i]
    early += first < end[i]
    late += first > end[i]
    correct += sum(predicted[i, j] == clean[i, j] for j in range(end[i]))
    total += end[i]
  np.testing.assert_allclose(float(out["stop_exact"]), exact / 8, atol=1e-6)
  np.testing.assert_allclose(float(out["stop_early"]), early / 8, atol=1e-6)
  np.testing.assert_allclose(float(out["stop_late"]), late / 8, atol=1e-6)
  np.testing.assert_allclose(float(out["content_accuracy"]), correct / max(total, 1), atol=1e-6)


def test_encoder_probe_against_a_loop_over_designed_logits(tmp_path, monkeypatch):
  """The encoder head's figures on logits made by hand (random, with large stop logits planted
  at chosen slots), against a per-row loop over slot indices read off the tokens."""
  path = write_jsonl(tmp_path / "d.jsonl", [chat(f"q{i}", "ab" * i) for i in range(1, 9)])
  config = make_config(path, canvas_length=4, prompt_len=16, num_canvases=5)
  task = make_task(config)
  cfg = ModelConfig(**{**config.model.to_dict(), "hidden_size": 32, "intermediate_size": 32,
                       "num_layers": 1, "layer_types": (), "moe_intermediate_size": 16})
  params = transformer.init_params(cfg, jax.random.PRNGKey(1))
  tokens, valid, _, stop_canvas, end = diag.stop_canvas_batch(task, path, num=8)
  n, length = tokens.shape
  eot = task.tokenizer.eot_id
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(n, length, cfg.vocab_size)).astype(np.float32)
  ends = [int(np.flatnonzero(tokens[i, 16:] == eot)[0]) + 16 - 1 for i in range(n)]
  for i in range(n):  # a planted stop at the end (rows 0-3), one before it (rows 2, 4) or none
    if i < 4:
      logits[i, ends[i], eot] = 30.0
    if i in (2, 4):
      logits[i, ends[i] - 1, eot] = 20.0
  monkeypatch.setattr(transformer, "lm_head", lambda params, h, cfg: jnp.asarray(logits))
  out = diag.make_encoder_probe(cfg, task.layout, task.stop_token_ids)(params, tokens, valid,
                                                                          stop_canvas, end)
  jax.clear_caches()

  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  stop = probs[..., list(task.stop_token_ids)].sum(-1)
  argmax_stop = np.isin(logits.argmax(-1), task.stop_token_ids)
  exact = top = 0
  at_end, rest = [], []
  for i in range(n):
    reply = range(16 - 1, ends[i] + 1)  # the positions that predict the reply's tokens
    firsts = [q for q in reply if argmax_stop[i, q]]
    exact += bool(firsts) and firsts[0] == ends[i]
    top += max(reply, key=lambda q: stop[i, q]) == ends[i]
    at_end.append(stop[i, ends[i]])
    rest += [stop[i, q] for q in reply if q != ends[i]]
  assert exact == 3 and top == 4  # rows 0, 1, 3 stop at the end; rows 2, 4 one before it
  np.testing.assert_allclose(float(out["ar_stop_exact"]), exact / n, atol=1e-6)
  np.testing.assert_allclose(float(out["ar_stop_top"]), top / n, atol=1e-6)
  np.testing.assert_allclose(float(out["ar_stop_prob_end"]), np.mean(at_end), rtol=1e-5)
  np.testing.assert_allclose(float(out["ar_stop_prob_rest"]), np.mean(rest), rtol=1e-5)
