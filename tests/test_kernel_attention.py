"""Pallas canvas attention (interpret mode) against model.attend + attention_mask.attention_mask.

Tolerances, forward and gradients w.r.t. q, k, v (max error relative to the largest entry):
  float32:  max |ours - ref| <= 1e-5 * max(1, max |ref|)  (observed <= 7.2e-7 absolute)
  bfloat16: max |ours - ref32| <= 1e-2 * max |ref32|, where ref32 is the reference run in float32
            on the same bf16-valued inputs (observed <= 6e-3; the bf16 reference itself is up to
            1e-2 off ref32), and max |ours - ref| <= 2e-2 * max |ref| against the bf16 reference
            (observed <= 8.4e-3).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffgemma.model import attention_mask, layers
from diffgemma.model.kernels.attention import canvas_attention

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
# Against the bf16 reference both sides carry bf16 rounding.
BF16_VS_BF16_REFERENCE = 2e-2


@dataclasses.dataclass(frozen=True)
class Case:
  """One attention problem. Decoder: `length` canvas queries against `slots` cache slots plus the
  canvas; encoder: `length` causal queries written at slots [start, start + length)."""
  decoder: bool
  dtype: type
  batch: int
  length: int
  heads: int
  kv_heads: int
  head_dim: int
  slots: int
  window: int | None
  prefix_len: tuple[int, ...] = ()  # decoder: per example
  left_pad: tuple[int, ...] = ()  # invalid leading slots/tokens per example
  start: int = 0  # encoder: cache end before this chunk
  block_q: int | None = None
  block_kv: int | None = None
  block_kv_bwd: int = 8


CASES = {
    # Prefix of 21 slots (not a multiple of 8), unfilled slots past prefix_len, left padding.
    "decoder_full_gqa": Case(True, jnp.float32, 2, 8, 4, 2, 16, 21, None, prefix_len=(13, 21),
                             left_pad=(2, 0), block_q=4, block_kv=8),
    # Prefix (27) longer than the window (6); one kv head for all query heads.
    "decoder_window_mqa": Case(True, jnp.float32, 2, 8, 4, 1, 16, 30, 6, prefix_len=(27, 12),
                               left_pad=(0, 3), block_q=4, block_kv=8),
    "decoder_window_bf16_hd64": Case(True, jnp.bfloat16, 2, 8, 4, 2, 64, 21, 10,
                                     prefix_len=(21, 9), left_pad=(1, 0), block_q=8, block_kv=8),
    # K == H, default tiles, a chunk after 5 cached tokens; 11 queries (not a multiple).
    "encoder_causal_mha": Case(False, jnp.float32, 2, 11, 2, 2, 16, 24, None, left_pad=(0, 2),
                               start=5),
    # Left padding at the very start: padding queries see no key at all. Head dim 24 is padded.
    "encoder_window_padded_hd24": Case(False, jnp.float32, 2, 13, 4, 2, 24, 16, 4,
                                       left_pad=(3, 0), block_q=8, block_kv=4),
    "encoder_window_bf16": Case(False, jnp.bfloat16, 1, 16, 4, 1, 32, 16, 5, left_pad=(2,),
                                block_q=8, block_kv=8),
}


def make_inputs(case: Case, seed: int = 0):
  """Random q, k, v and the mask ingredients, built the way model.encode / model.decode do."""
  rng = np.random.default_rng(seed)
  b, t = case.batch, case.length
  left_pad = np.asarray(case.left_pad or (0,) * b)[:, None]
  if case.decoder:
    prefix_len = np.asarray(case.prefix_len)[:, None]
    slot = np.broadcast_to(np.arange(case.slots), (b, case.slots))
    cache_valid = (slot >= left_pad) & (slot < prefix_len)
    canvas_pos = prefix_len + np.arange(t)
    kv_pos = np.concatenate([slot, canvas_pos], axis=1)
    kv_valid = np.concatenate([cache_valid, np.ones((b, t), bool)], axis=1)
    anchor = np.broadcast_to(prefix_len, (b, t))
    limit = anchor + t - 1
  else:
    positions = np.broadcast_to(case.start + np.arange(t), (b, t))
    token_valid = positions >= left_pad
    kv_pos = np.broadcast_to(np.arange(case.slots), (b, case.slots))
    kv_valid = np.zeros((b, case.slots), bool)
    kv_valid[:, :case.start] = True
    kv_valid[:, case.start:case.start + t] = token_valid
    anchor = limit = positions
  s = kv_pos.shape[1]
  # q and k at the scale of the model's RMS-normalised heads (scores ~ N(0, d / 4)).
  normal = lambda *shape: jnp.asarray(0.5 * rng.standard_normal(shape), case.dtype)
  q = normal(b, t, case.heads, case.head_dim)
  k = normal(b, s, case.kv_heads, case.head_dim)
  v = normal(b, s, case.kv_heads, case.head_dim) * 2
  cotangent = normal(b, t, case.heads, case.head_dim)
  ints = lambda x: jnp.asarray(x, jnp.int32)
  return (q, k, v), (ints(anchor), ints(limit), ints(kv_pos), jnp.asarray(kv_valid)), cotangent


def reference(q, k, v, anchor, limit, kv_pos, kv_valid, window, q_segment=None, kv_segment=None):
  return layers.attend(q, k, v, attention_mask.attention_mask(anchor, limit, kv_pos, kv_valid,
                                                              window, q_segment, kv_segment))


def output_and_grads(attention, qkv, cotangent):
  out, vjp = jax.vjp(attention, *qkv)
  return out, vjp(cotangent)


def assert_close(ours, ref, tolerance, what, min_scale=0.0):
  ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
  assert np.all(np.isfinite(ours)), what
  scale = max(min_scale, np.abs(ref).max())
  err = np.abs(ours - ref).max()
  assert err <= tolerance * scale, f"{what}: max err {err:.3g}, max |ref| {scale:.3g}"


def run_jitted(attention, qkv, cotangent):
  return jax.jit(output_and_grads, static_argnums=0)(attention, qkv, cotangent)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference_forward_and_grads(name):
  case = CASES[name]
  qkv, mask_args, cotangent = make_inputs(case)
  kernel = functools.partial(canvas_attention, sliding_window=case.window, block_q=case.block_q,
                             block_kv=case.block_kv, block_kv_bwd=case.block_kv_bwd)
  ours = run_jitted(lambda q, k, v: kernel(q, k, v, *mask_args), qkv, cotangent)
  ref_fn = lambda q, k, v: reference(q, k, v, *mask_args, case.window)
  ref = run_jitted(ref_fn, qkv, cotangent)
  if case.dtype == jnp.float32:
    checks = [(ref, TOLERANCE[jnp.float32], 1.0)]
  else:
    upcast = lambda x: x.astype(jnp.float32)
    ref32 = run_jitted(ref_fn, tuple(map(upcast, qkv)), upcast(cotangent))
    checks = [(ref32, TOLERANCE[jnp.bfloat16], 0.0), (ref, BF16_VS_BF16_REFERENCE, 0.0)]
  for expected, tolerance, min_scale in checks:
    for what, a, b in zip(("out", "dq", "dk", "dv"), (ours[0], *ours[1]),
                          (expected[0], *expected[1])):
      assert_close(a, b, tolerance, what, min_scale)


def test_skipped_kv_blocks_are_never_read():
  """NaN K/V in whole blocks no query sees (unfilled cache, slots before the window) stay out."""
  case = Case(True, jnp.float32, 1, 8, 4, 2, 16, 32, 6, prefix_len=(24,), block_q=4, block_kv=8)
  (q, k, v), mask_args, cotangent = make_inputs(case)
  # Visible prefix slots are 19..23; blocks 0-7, 8-15 (before the window) and 24-31 (unfilled).
  unseen = np.zeros(k.shape[1], bool)
  unseen[:16] = unseen[24:32] = True
  unseen = jnp.asarray(unseen)[None, :, None, None]
  poison = lambda x, fill: jnp.where(unseen, fill, x)
  kernel = functools.partial(canvas_attention, sliding_window=case.window, block_q=case.block_q,
                             block_kv=case.block_kv, block_kv_bwd=case.block_kv_bwd)
  ours = run_jitted(lambda q, k, v: kernel(q, k, v, *mask_args),
                    (q, poison(k, jnp.nan), poison(v, jnp.nan)), cotangent)
  ref = run_jitted(lambda q, k, v: reference(q, k, v, *mask_args, case.window),
                   (q, poison(k, 0.0), poison(v, 0.0)), cotangent)
  for what, a, b in zip(("out", "dq", "dk", "dv"), (ours[0], *ours[1]), (ref[0], *ref[1])):
    assert_close(a, b, TOLERANCE[jnp.float32], what, min_scale=1.0)


def numpy_attention(q, k, v, mask):
  """float64 softmax attention; a row with no visible key gets the uniform average of v over
  all S keys (what the reference's softmax of S equal finfo.min scores gives)."""
  q, k, v, mask = (np.asarray(x, np.float64) for x in (q, k, v, mask))
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # [B, S, H, d]
  scores = np.einsum("bthd,bshd->bhts", q, k)
  visible = np.broadcast_to(mask[:, None].astype(bool), scores.shape)
  scores = np.where(visible, scores, -np.inf)
  weights = np.exp(scores - scores.max(-1, keepdims=True, initial=-1e300))
  weights = np.where(visible, weights, 0.0)
  total = weights.sum(-1, keepdims=True)
  uniform = np.full_like(weights, 1.0 / weights.shape[-1])
  weights = np.where(total > 0, weights / np.where(total > 0, total, 1.0), uniform)
  return np.einsum("bhts,bshd->bthd", weights, v)


def test_padding_queries_with_no_visible_key_match_reference():
  """Left-padding queries see no key. On them the kernel returns what the reference defines, the
  uniform average of v over all S keys, and passes their cotangent to v as 1/S per key (to q and
  k nothing); on the valid rows it is the softmax over the visible keys. Checked against a
  float64 numpy computation and against model.attend."""
  case = CASES["encoder_window_padded_hd24"]
  (q, k, v), mask_args, cotangent = make_inputs(case)
  mask = np.asarray(attention_mask.attention_mask(*mask_args, case.window))
  sees_nothing_BxT = ~mask.any(-1)
  assert sees_nothing_BxT.sum() == case.left_pad[0]  # the case has padding rows, in example 0
  kernel = functools.partial(canvas_attention, sliding_window=case.window, block_q=case.block_q,
                             block_kv=case.block_kv, block_kv_bwd=case.block_kv_bwd)
  attention = lambda q, k, v: kernel(q, k, v, *mask_args)
  out = np.asarray(jax.jit(attention)(q, k, v), np.float64)
  expected = numpy_attention(q, k, v, mask)
  group = case.heads // case.kv_heads
  mean_v = np.repeat(np.asarray(v, np.float64).mean(1), group, axis=1)  # [B, H, d]
  np.testing.assert_allclose(expected[sees_nothing_BxT], np.broadcast_to(
      mean_v[:, None], expected.shape)[sees_nothing_BxT], rtol=0, atol=1e-12)
  tol = TOLERANCE[jnp.float32]
  for rows, what in ((sees_nothing_BxT, "padding rows"), (~sees_nothing_BxT, "valid rows")):
    np.testing.assert_allclose(out[rows], expected[rows], rtol=0, atol=tol, err_msg=what)
  ref = np.asarray(reference(q, k, v, *mask_args, case.window), np.float64)
  np.testing.assert_allclose(out, ref, rtol=0, atol=tol)
  # Gradients of the padding rows alone: d(mean of v)/dv = 1/S for every key of the kv head.
  padding_cotangent = jnp.where(jnp.asarray(sees_nothing_BxT)[:, :, None, None], cotangent, 0.0)
  _, (dq, dk, dv) = run_jitted(attention, (q, k, v), padding_cotangent)
  b, s = v.shape[:2]
  per_kv_head = np.asarray(padding_cotangent, np.float64).reshape(
      b, case.length, case.kv_heads, group, case.head_dim).sum((1, 3))
  expected_dv = np.broadcast_to(per_kv_head[:, None] / s, v.shape)
  np.testing.assert_allclose(np.asarray(dv, np.float64), expected_dv, rtol=0, atol=tol)
  assert not np.asarray(dq).any() and not np.asarray(dk).any()


def test_rejects_bad_shapes():
  q = jnp.zeros((1, 4, 3, 8))
  kv = jnp.zeros((1, 6, 2, 8))
  ints = jnp.zeros((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="multiple of kv heads"):
    canvas_attention(q, kv, kv, ints, ints, jnp.zeros((1, 6), jnp.int32), jnp.ones((1, 6), bool),
                     None)


# ----------------------------------------------------------------------------- packed rows

# Example lengths of two packed rows (the rest of each row is padding, segment 0); positions
# restart at 0 in each example, as the packed SFT rows have them.
PACKED_LENGTHS = ((7, 4, 9), (13, 5))
PACKED_SLOTS = 24


def packed_rows(lengths=PACKED_LENGTHS, slots=PACKED_SLOTS):
  """(segment_BxS, position_BxS) of rows packed with examples of `lengths`; segment j + 1 for
  the row's j-th example, 0 (position 0) on padding."""
  segment = np.zeros((len(lengths), slots), np.int32)
  position = np.zeros((len(lengths), slots), np.int32)
  for b, row in enumerate(lengths):
    start = 0
    for j, n in enumerate(row):
      segment[b, start:start + n] = j + 1
      position[b, start:start + n] = np.arange(n)
      start += n
  return segment, position


def make_packed_inputs(decoder: bool, canvas: int = 3, seed: int = 0):
  """Mask ingredients with segments, built the way a packed SFT row is: the encoder's causal
  pass over the row; or the decoder's canvases, one per example, each after its example's
  (cached) prefix: example j's canvas starts at position length_j - canvas (its last canvas)."""
  segment, position = packed_rows()
  valid = segment > 0
  b, s = segment.shape
  if decoder:
    num = max(len(row) for row in PACKED_LENGTHS)
    starts = np.array([[n - canvas for n in row] + [0] * (num - len(row))
                       for row in PACKED_LENGTHS])  # [B, E] canvas anchors
    q_segment = np.repeat(np.arange(1, num + 1)[None], b, 0)
    q_segment = np.where(np.array([[j < len(row) for j in range(num)]
                                   for row in PACKED_LENGTHS]), q_segment, 0)
    cutoff_BxS = np.take_along_axis(np.pad(starts, ((0, 0), (1, 0))), segment, axis=1)
    kv_valid = np.concatenate([valid & (position < cutoff_BxS),
                               np.repeat(q_segment > 0, canvas, 1)], axis=1)
    anchor = np.repeat(starts, canvas, 1)
    q_pos = anchor + np.tile(np.arange(canvas), num)
    kv_pos = np.concatenate([position, q_pos], axis=1)
    q_segment = np.repeat(q_segment, canvas, 1)
    kv_segment = np.concatenate([segment, q_segment], axis=1)
    limit = anchor + canvas - 1
  else:
    anchor = limit = position
    q_segment = kv_segment = segment
    kv_pos, kv_valid = position, valid
  t, s = anchor.shape[1], kv_pos.shape[1]
  rng = np.random.default_rng(seed)
  normal = lambda *shape: jnp.asarray(0.5 * rng.standard_normal(shape), jnp.float32)
  q, k, v = normal(b, t, 4, 16), normal(b, s, 2, 16), 2 * normal(b, s, 2, 16)
  ints = lambda x: jnp.asarray(x, jnp.int32)
  mask_args = (ints(anchor), ints(limit), ints(kv_pos), jnp.asarray(kv_valid))
  return (q, k, v), mask_args, (ints(q_segment), ints(kv_segment)), normal(b, t, 4, 16)


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("window", [None, 4], ids=["full", "sliding"])
def test_packed_segments_match_reference(decoder, window):
  """With segment ids the kernel (interpret mode) equals the XLA path on the same mask, forward
  and gradients, on sliding and full layers; no row sees a key of another example."""
  qkv, mask_args, segments, cotangent = make_packed_inputs(decoder)
  mask = np.asarray(attention_mask.attention_mask(*mask_args, window, *segments))
  q_seg, kv_seg = (np.asarray(x) for x in segments)
  assert not (mask & (q_seg[:, :, None] != kv_seg[:, None, :])).any()
  assert (mask.any(-1) == (q_seg > 0)).all()  # every example's query sees a key
  kernel = functools.partial(canvas_attention, sliding_window=window, block_q=4, block_kv=8,
                             block_kv_bwd=8)
  ours = run_jitted(lambda q, k, v: kernel(q, k, v, *mask_args, q_segment_BxT=segments[0],
                                           kv_segment_BxS=segments[1]), qkv, cotangent)
  ref = run_jitted(lambda q, k, v: reference(q, k, v, *mask_args, window, *segments), qkv,
                   cotangent)
  for what, a, b in zip(("out", "dq", "dk", "dv"), (ours[0], *ours[1]), (ref[0], *ref[1])):
    assert_close(a, b, TOLERANCE[jnp.float32], what, min_scale=1.0)
