"""Recording the model's attention probabilities, for diagnostics; the model itself is untouched.

Inside `record_attention()`, every call of `layers.attend` (the XLA attention path) also appends
its softmax probabilities to a list, in call order: one entry per layer of each `encode` or
`decode` traced or run inside the block. The model's outputs still come from the original
`attend`, so nothing in layers.py changes and its hot path pays nothing outside the block.

    cfg = attention_probe.recordable(cfg)
    with attention_probe.record_attention() as probs:
      logits = transformer.decode(params, cfg, canvas_BxC, cache)
    # probs[i]: layer i's probabilities [B, H, C, S + C] over the keys the decoder sees
    # (the S cache slots, then the canvas).

Works eagerly and inside a `jax.jit`-traced function (return the recorded arrays, or values
computed from them, as its outputs). The patch is read when `layers.attention` runs, so a
function jitted and traced before the block keeps its recording-free program.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from diffgemma.model import layers
from diffgemma.model.config import ModelConfig


def recordable(cfg: ModelConfig) -> ModelConfig:
  """`cfg` with the XLA attention path (the Pallas kernel never forms the probabilities; the
  XLA path is its reference) and no rematerialisation (values recorded inside a
  `jax.checkpoint` could not leave it). Neither changes the forward pass's numbers."""
  return cfg.replace(attention_impl="xla", remat="none")


def attention_probs(q_BxTxHxd, k_BxSxKxd, mask_BxTxS):
  """Softmax probabilities [B, H, T, S] float32 of `layers.attend`: the same grouped layout
  (query head h reads kv head h // (H / K)), scaling 1.0 and masking, so the numbers are the
  ones `attend` multiplies the values by (before its cast to the values' dtype)."""
  b, t, h, d = q_BxTxHxd.shape
  kv_heads = k_BxSxKxd.shape[2]
  group = h // kv_heads
  q = q_BxTxHxd.reshape(b, t, kv_heads, group, d).transpose(0, 2, 3, 1, 4)
  k = k_BxSxKxd.transpose(0, 2, 1, 3)
  scores = jnp.einsum("bkgtd,bksd->bkgts", q, k).astype(jnp.float32)
  scores = jnp.where(mask_BxTxS[:, None, None], scores, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(scores, axis=-1)
  return probs.reshape(b, h, t, probs.shape[-1])


@contextlib.contextmanager
def record_attention():
  """Within the block, `layers.attend` also records its probabilities [B, H, T, S] per call
  into the yielded list. Use a config from `recordable` (with the Pallas kernel or remat the
  list stays empty or cannot be used outside the block)."""
  records = []
  original = layers.attend

  def recording_attend(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, mask_BxTxS):
    records.append(attention_probs(q_BxTxHxd, k_BxSxKxd, mask_BxTxS))
    return original(q_BxTxHxd, k_BxSxKxd, v_BxSxKxd, mask_BxTxS)

  layers.attend = recording_attend
  try:
    yield records
  finally:
    layers.attend = original
