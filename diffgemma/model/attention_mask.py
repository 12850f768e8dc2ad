"""The model's one attention-mask rule, shared by the XLA path (layers.py) and the Pallas canvas
kernel (kernels/attention.py), which builds it block by block.

A leaf module: it imports nothing from the package, so the model and the kernels both import it
without importing each other.
"""

from __future__ import annotations

import jax.numpy as jnp


def attention_mask(q_anchor_BxT, q_limit_BxT, kv_pos_BxS, kv_valid_BxS, sliding_window,
                   q_segment_BxT=None, kv_segment_BxS=None, q_block_BxT=None, kv_block_BxS=None):
  """The one attention mask of the model, [B, T, S] bool.

  Key j is visible to query t when it is valid, not after the query's limit, (on sliding
  layers) after its window anchor minus the window, and (packed rows) of the query's segment:
    kv_valid[j] and kv_pos[j] <= q_limit[t] and kv_pos[j] > q_anchor[t] - window
    and kv_segment[j] == q_segment[t].
  Encoder (causal): anchor = limit = the query's own position.
  Decoder (a canvas starting at L): anchor = L, limit = the canvas's last position, so every
  canvas token sees the whole canvas and the last window-1 prefix tokens (the reference keeps
  exactly that many in its sliding-window cache).
  With block ids (`image_blocks`: >= 0 the image a token belongs to, -1 text), a valid key of
  the query's own block is visible too, past the limit and the window: the encoder attends
  bidirectionally inside each image (use_bidirectional_attention="vision"), on every layer, as
  transformers' DiffusionGemma masks do (causal-or-block, then the window's cut, then padding).
  Packed rows (several examples in one row): segments are the example of each query and key, and
  positions restart at 0 in each example, so every example sees exactly what it sees alone.
  Segments None (one example per row) test nothing. Segments cut the block rule too: a key is
  visible iff of the query's segment and (by the causal/window rule or in the query's block).
  """
  visible = kv_valid_BxS[:, None, :] & (kv_pos_BxS[:, None, :] <= q_limit_BxT[:, :, None])
  if sliding_window is not None:
    visible &= kv_pos_BxS[:, None, :] > q_anchor_BxT[:, :, None] - sliding_window
  if q_block_BxT is not None:
    same_block = q_block_BxT[:, :, None] == kv_block_BxS[:, None, :]
    visible |= same_block & (q_block_BxT[:, :, None] >= 0) & kv_valid_BxS[:, None, :]
  if q_segment_BxT is not None:
    visible &= kv_segment_BxS[:, None, :] == q_segment_BxT[:, :, None]
  return visible


def image_blocks(is_image_BxT):
  """Block ids [B, T] int32 for `attention_mask`: each run of consecutive image tokens gets its
  own id (0, 1, ... from the left), every other token -1 (transformers'
  `get_block_sequence_ids_for_mask` over the processor's mm_token_type_ids)."""
  previous = jnp.pad(is_image_BxT[:, :-1], ((0, 0), (1, 0)))
  starts = is_image_BxT & ~previous
  ids = jnp.cumsum(starts.astype(jnp.int32), axis=1) - 1
  return jnp.where(is_image_BxT, ids, -1).astype(jnp.int32)
