"""Packed SFT rows (diffgemma/tasks/packing.py): the chat pipeline's rows hold exactly the
examples of the unpacked order, each its prompt then its canvases with positions from 0; the
rows of a step are a pure function of the step; a bad configuration or an example longer than a
row is one line. The objective on packed rows (losses.packed_sft_loss) equals the unpacked
batch's, loss and gradients."""

import collections
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffgemma.model import config, transformer
from diffgemma.model.config import FULL, SLIDING
from diffgemma.tasks import chat_data, make_task, packing
from diffgemma.tasks.base import Layout, PackedLayout
from diffgemma.tasks.chat_data import ChatDataError
from diffgemma.training import losses
from tests.helpers import chat, make_config, write_jsonl

ROW, PER_ROW = 64, 3


def packed_task(tmp_path, n=40, **data):
  # Replies of 1 to 3 canvases of 4 and prompts of various lengths.
  records = [chat("q" * (1 + i % 7), "a" * (1 + (5 * i) % 11)) for i in range(n)]
  path = write_jsonl(tmp_path / "d.jsonl", records)
  config = make_config(path, prompt_len=24, num_canvases=3, num_threads=0,
                       **{"max_row_tokens": ROW, "max_row_examples": PER_ROW, **data})
  return make_task(config)


def slots_key(example_slots):
  return (tuple(example_slots["tokens"].tolist()), tuple(example_slots["loss_mask"].tolist()))


def test_packed_rows_hold_the_examples_of_the_order(tmp_path):
  task = packed_task(tmp_path)
  rows = task.packing
  assert (rows.row_tokens, rows.row_examples, rows.canvas_length) == (ROW, PER_ROW, 4)
  batches = list(task.train_batches(4, 5))
  seen = []
  for batch in batches:
    assert batch["tokens"].shape == (4, ROW) and batch["canvas_start"].shape == (4, PER_ROW)
    for b in range(4):
      seg, pos = batch["segment_ids"][b], batch["positions"][b]
      np.testing.assert_array_equal(batch["valid"][b], seg > 0)
      count = int(seg.max())
      assert 1 <= count <= PER_ROW and (batch["num_canvases"][b, count:] == 0).all()
      # Examples lie back to back from slot 0, then padding.
      assert (np.diff(seg[seg > 0]) >= 0).all() and not seg[int((seg > 0).sum()):].any()
      for j in range(count):
        slots = np.flatnonzero(seg == j + 1)
        np.testing.assert_array_equal(pos[slots], np.arange(len(slots)))
        mask = batch["loss_mask"][b, slots]
        start, n = batch["canvas_start"][b, j], batch["num_canvases"][b, j]
        assert start == slots[0] + np.argmax(mask) and n * 4 == mask.sum() and mask[-1]
        seen.append(slots_key({"tokens": batch["tokens"][b, slots], "loss_mask": mask}))
  # A flush of the packer is one step's rows: the examples of the first 5 steps are the first
  # len(seen) examples of the order, each once.
  expected = [slots_key(packing.example_slots(task.layout_example(e), 4))
              for e in task.train_examples(0, len(seen))]
  assert collections.Counter(seen) == collections.Counter(expected)
  assert len(seen) > 4 * 5 * 1.5  # rows hold more than one example on average


def test_packed_batches_resume_exactly_and_split_over_processes(tmp_path):
  task = packed_task(tmp_path)
  full = list(task.train_batches(4, 6))
  resumed = list(task.train_batches(4, 6, 2))
  halves = [list(task.train_batches(4, 6, 0, process_index=i, process_count=2)) for i in (0, 1)]
  assert len(full) == 6 and len(resumed) == 4
  for step, batch in enumerate(full):
    for key, value in batch.items():
      if step >= 2:
        np.testing.assert_array_equal(resumed[step - 2][key], value)
      np.testing.assert_array_equal(
          np.concatenate([halves[0][step][key], halves[1][step][key]]), value)


def test_an_example_longer_than_a_row_names_its_line(tmp_path):
  records = [chat("q", "short"), chat("q", "x" * 40)]
  path = write_jsonl(tmp_path / "d.jsonl", records)
  config = make_config(path, prompt_len=24, num_canvases=12, max_row_tokens=40,
                       max_row_examples=2)
  with pytest.raises(ChatDataError) as e:
    make_task(config)
  message = str(e.value)
  assert "\n" not in message and f"{path}:2" in message
  assert "data.max_row_tokens=40" in message and "at least 72" in message


def test_packing_needs_the_examples_per_row(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [chat("q", "a")])
  with pytest.raises(ValueError, match="set data.max_row_examples"):
    make_task(make_config(path, prompt_len=24, num_canvases=1, max_row_tokens=64,
                          max_row_examples=0))


def test_example_slots_drop_the_padding():
  layout = {"tokens": np.array([0, 0, 7, 8, 9, 1, 1, 1, 0, 0, 0, 0]),
            "valid": np.array([0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0], bool),
            "loss_mask": np.array([0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0], bool)}
  slots = packing.example_slots(layout, 2)
  np.testing.assert_array_equal(slots["tokens"], [7, 8, 9, 1, 1, 1])
  np.testing.assert_array_equal(slots["loss_mask"], [0, 0, 1, 1, 1, 1])
  with pytest.raises(ValueError, match="whole supervised canvases"):
    packing.example_slots(layout, 3)


# ----------------------------------------------------------------------------- the objective

C, K, P = 4, 3, 8
# (prompt length, reply length) of four examples: 2, 1, 3 and exactly 1 canvas (no EOS fill);
# every example is longer than the sliding window.
EXAMPLES = ((5, 6), (8, 3), (3, 11), (6, 4))
# Packed rows: examples 0 and 2, then 1 and 3. Self-conditioning at prob 0.5 takes the first of
# every 2 decoder rows, so packed and unpacked self-condition the same examples.
ROWS = ((0, 2), (1, 3))
PACKED_ROW = 30
MODEL = config.tiny(num_layers=2, layer_types=(SLIDING, FULL), sliding_window=6, canvas_length=C,
                    hidden_size=16, intermediate_size=24, num_heads=2, num_kv_heads=1,
                    head_dim=8, global_head_dim=8, moe_intermediate_size=8)


def objective_batches():
  """The examples in the unpacked layout [4, P + K*C] and packed into ROWS [2, PACKED_ROW]."""
  rng = np.random.default_rng(0)
  layout = Layout(P, K, C)
  unpacked = []
  for prompt_len, reply_len in EXAMPLES:
    prompt = [MODEL.bos_token_id] + rng.integers(3, 60, prompt_len - 1).tolist()
    reply = rng.integers(3, 60, reply_len - 1).tolist() + [60]  # 60: the end-of-turn
    unpacked.append(chat_data.layout_example(prompt, reply, layout, MODEL.pad_token_id,
                                             MODEL.eos_token_id))
  packed = {k: [] for k in ("tokens", "valid", "loss_mask", "segment_ids", "positions",
                            "canvas_start", "num_canvases")}
  for row in ROWS:
    slots = [packing.example_slots(unpacked[i], C) for i in row]
    pad = PACKED_ROW - sum(len(s["tokens"]) for s in slots)
    cat = lambda parts, fill: np.concatenate(parts + [np.full(pad, fill)])
    packed["tokens"].append(cat([s["tokens"] for s in slots], 0).astype(np.int32))
    packed["loss_mask"].append(cat([s["loss_mask"] for s in slots], False).astype(bool))
    segments = cat([np.full(len(s["tokens"]), j + 1) for j, s in enumerate(slots)], 0)
    packed["segment_ids"].append(segments.astype(np.int32))
    packed["valid"].append(segments > 0)
    packed["positions"].append(cat([np.arange(len(s["tokens"])) for s in slots], 0)
                               .astype(np.int32))
    start, count = packing.row_metadata(segments, packed["loss_mask"][-1], len(row), C)
    packed["canvas_start"].append(start)
    packed["num_canvases"].append(count)
  stack = lambda rows: {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}
  return (layout, stack(unpacked)), (PackedLayout(PACKED_ROW, 2, C, K),
                                     {k: jnp.asarray(np.stack(v)) for k, v in packed.items()})


def packed_draws(draws, loss_cfg):
  """The unpacked batch's draws in the packed layout: example ROWS[b][j]'s at slot (u, j)."""
  if loss_cfg.canvas_selection == "one":
    rows = [[(i, 0) for i in row] for row in ROWS]  # (example, its decoder row offset)
    source = lambda i, k: i
  else:
    rows = [[(i, k) for i in row] for row in ROWS for k in range(K)]
    source = lambda i, k: i * K + k
  pick = lambda x: jnp.asarray([[x[source(i, k)] for i, k in row] for row in rows])
  noisy = pick(np.asarray(draws.noisy_UxC))
  return losses.Draws(pick(np.asarray(draws.canvas_U)), pick(np.asarray(draws.t_U)),
                      noisy.reshape(noisy.shape[0], -1))


def packed_and_unpacked(loss_cfg, with_grads: bool):
  """(unpacked, packed) of sft_loss's (loss, metrics) and, `with_grads`, the gradient."""
  (layout, batch), (packed_layout, packed_batch) = objective_batches()
  params = transformer.init_params(MODEL, jax.random.PRNGKey(0), std=0.3)
  draws = losses.sample_draws(jax.random.PRNGKey(1), MODEL, loss_cfg, layout, batch)
  fn = jax.value_and_grad(losses.sft_loss, has_aux=True) if with_grads else losses.sft_loss
  fn = jax.jit(fn, static_argnums=(1, 2, 3))
  return (fn(params, MODEL, loss_cfg, layout, batch, None, draws),
          fn(params, MODEL, loss_cfg, packed_layout, packed_batch, None,
             packed_draws(draws, loss_cfg)))


def assert_same_metrics(packed_metrics, metrics):
  for key in ("loss", "encoder_loss", "decoder_loss", "decoder_token_accuracy"):
    np.testing.assert_allclose(packed_metrics[key], metrics[key], rtol=LOSS_RTOL, err_msg=key)
  assert float(metrics["encoder_loss"]) > 0 and float(metrics["decoder_loss"]) > 0


# Float32 rounding only: RoPE sees other absolute positions (the unpacked prompts are
# left-padded), as the unpacked batch does against itself with 4 more padding slots. Measured:
# losses within 2e-7 relative, gradients within 2.8e-5 of each tensor's largest entry (1.7e-5
# for the shifted unpacked batch); examples that see each other are off by > 1 (relative).
LOSS_RTOL, GRAD_TOL = 1e-5, 1e-4


def test_packed_loss_and_gradients_equal_the_unpacked_batch():
  """THE packing test: on a tiny model (a sliding and a full layer, window 6 shorter than every
  example), a packed batch's loss, its terms and its gradient equal those of the unpacked batch
  of the same examples under the same draws (canvas, noise level, corruption, self-
  conditioning): one canvas per example, token normalisation, a reply-end weight and 1/t
  weighting, the encoder's loss on the reply."""
  loss_cfg = losses.LossConfig(self_conditioning_prob=0.5, encoder_weight=1.0, end_weight=3.0,
                               decoder_weighting="inverse_t")
  ((loss, metrics), grads), ((packed_loss, packed_metrics), packed_grads) = packed_and_unpacked(
      loss_cfg, with_grads=True)
  assert_same_metrics(packed_metrics, metrics)
  np.testing.assert_allclose(packed_loss, loss, rtol=LOSS_RTOL)
  theirs_by_path = dict(jax.tree_util.tree_flatten_with_path(grads)[0])
  for path, ours in jax.tree_util.tree_flatten_with_path(packed_grads)[0]:
    ours, theirs = np.asarray(ours), np.asarray(theirs_by_path[path])
    err = np.abs(ours - theirs).max()
    assert err <= GRAD_TOL * np.abs(theirs).max(), (jax.tree_util.keystr(path), err)


def test_packed_loss_equals_the_unpacked_batch_on_every_canvas_per_example():
  """canvas_selection "all" (K decoder rows per packed row), example normalisation, the
  encoder's loss on prompt and reply: the same loss and terms packed and unpacked."""
  loss_cfg = losses.LossConfig(self_conditioning_prob=0.5, encoder_weight=0.5,
                               encoder_scope="prompt_and_target", canvas_selection="all",
                               normalization="example")
  (loss, metrics), (packed_loss, packed_metrics) = packed_and_unpacked(loss_cfg, False)
  assert_same_metrics(packed_metrics, metrics)
  np.testing.assert_allclose(packed_loss, loss, rtol=LOSS_RTOL)


@pytest.mark.slow
def test_packed_loss_through_the_pallas_kernel_equals_the_xla_path():
  """attention_impl="pallas" (interpret mode here) takes the segment ids through the model: the
  packed loss equals the XLA path's (two model compiles, one in interpret mode: slow tier)."""
  loss_cfg = losses.LossConfig(self_conditioning_prob=0.5, encoder_weight=1.0)
  (layout, batch), (packed_layout, packed_batch) = objective_batches()
  params = transformer.init_params(MODEL, jax.random.PRNGKey(0), std=0.3)
  draws = packed_draws(losses.sample_draws(jax.random.PRNGKey(1), MODEL, loss_cfg, layout,
                                           batch), loss_cfg)
  loss_fn = jax.jit(losses.sft_loss, static_argnums=(1, 2, 3))
  xla, pallas = (loss_fn(params, model, loss_cfg, packed_layout, packed_batch, None, draws)[1]
                 for model in (MODEL, dataclasses.replace(MODEL, attention_impl="pallas")))
  assert_same_metrics(pallas, xla)


def brute_force_encoder_mask(segment_R, position_R, window):
  """[R, R]: query t sees key s of its own example at or before it (sliding: within window)."""
  r = len(segment_R)
  mask = np.zeros((r, r), bool)
  for t in range(r):
    for s in range(r):
      if segment_R[t] and segment_R[s] == segment_R[t]:
        back = position_R[t] - position_R[s]
        mask[t, s] = 0 <= back and (window is None or back < window)
  return mask


def brute_force_decoder_mask(segment_R, position_R, starts_E, window):
  """[E*C, R + E*C]: canvas j (of example j + 1, from its position starts_E[j]) sees its
  example's slots before it (sliding: within window of its start) and its own canvas."""
  r, e = len(segment_R), len(starts_E)
  mask = np.zeros((e * C, r + e * C), bool)
  for j, start in enumerate(starts_E):
    rows = slice(j * C, (j + 1) * C)
    for s in range(r):
      if segment_R[s] == j + 1 and position_R[s] < start:
        mask[rows, s] = window is None or start - position_R[s] < window
    mask[rows, r + j * C:r + (j + 1) * C] = True
  return mask


def test_the_model_builds_per_example_masks_on_every_layer_type(monkeypatch):
  """The masks the model builds for packed rows (encoder and decoder, sliding and full layers,
  through the cache) equal masks built example by example from their definitions."""
  built = []
  original = transformer.layer_mask_specs

  def recording(*args, **kwargs):
    specs = original(*args, **kwargs)
    masks = {lt: mask for lt, (_, mask) in specs.items()}
    jax.debug.callback(lambda masks: built.append(jax.tree_util.tree_map(np.asarray, masks)),
                       masks)
    return specs

  monkeypatch.setattr(transformer, "layer_mask_specs", recording)
  _, (_, batch) = objective_batches()
  params = transformer.init_params(MODEL, jax.random.PRNGKey(0))
  canvas_E = np.array([[1, 2], [0, 0]])  # the canvas each example denoises (1 for example 3)
  prefix_BxE = (np.take_along_axis(np.asarray(batch["positions"]),
                                   np.asarray(batch["canvas_start"]), 1) + canvas_E * C)

  @jax.jit
  def encode_and_decode(params, batch):
    cache = transformer.init_cache(MODEL, 2, PACKED_ROW)
    _, cache = transformer.encode(params, MODEL, batch["tokens"], cache, batch["valid"],
                                  positions_BxT=batch["positions"],
                                  segment_ids_BxT=batch["segment_ids"])
    return transformer.decode(params, MODEL, jnp.zeros((2, 2 * C), jnp.int32), cache,
                              jnp.asarray(prefix_BxE),
                              canvas_segments_BxE=jnp.asarray([[1, 2], [1, 2]]))

  jax.block_until_ready(encode_and_decode(params, batch))
  jax.effects_barrier()
  encoder, decoder = built
  for layer_type, window in ((SLIDING, MODEL.sliding_window), (FULL, None)):
    for b in range(2):
      segment, position = np.asarray(batch["segment_ids"][b]), np.asarray(batch["positions"][b])
      np.testing.assert_array_equal(encoder[layer_type][b],
                                    brute_force_encoder_mask(segment, position, window))
      np.testing.assert_array_equal(decoder[layer_type][b], brute_force_decoder_mask(
          segment, position, prefix_BxE[b], window))


@pytest.mark.parametrize("max_row_tokens", [0, 48])
def test_step_benchmark_counts_the_examples_a_step_trains_on(tmp_path, max_row_tokens):
  """benchmarks/sft_step.py's examples per step (step_ab.py's ms per example), against a brute
  count over the same batches: the distinct segments of each packed row, or the rows that hold
  a valid token."""
  from diffgemma import cli
  from tests.helpers import tiny_chat_config

  sft_step = cli.load_module(os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "benchmarks", "sft_step.py"))
  records = [chat("q" * (1 + i % 7), "a" * (1 + (5 * i) % 11)) for i in range(40)]
  config = tiny_chat_config(write_jsonl(tmp_path / "d.jsonl", records), canvas_length=4,
                            num_canvases=3, max_row_tokens=max_row_tokens,
                            max_row_examples=3 if max_row_tokens else 0)
  config.batch_size = 4
  _, _, batches, mean_examples = sft_step.build_counted_step(config, 3, 3)
  if max_row_tokens:
    counts = [sum(len(set(row[row > 0].tolist())) for row in np.asarray(b["segment_ids"]))
              for b in batches]
    assert max(counts) > 4  # some rows hold several examples
  else:
    counts = [int(np.sum(np.any(np.asarray(b["valid"]), axis=1))) for b in batches]
  assert mean_examples == pytest.approx(np.mean(counts), rel=1e-12)
