"""The model's one attention-mask rule, shared by the XLA path (layers.py) and the Pallas canvas
kernel (kernels/attention.py), which builds it block by block.

A leaf module: it imports nothing from the package, so the model and the kernels both import it
without importing each other.
"""

from __future__ import annotations


def attention_mask(q_anchor_BxT, q_limit_BxT, kv_pos_BxS, kv_valid_BxS, sliding_window,
                   q_segment_BxT=None, kv_segment_BxS=None):
  """The one attention mask of the model, [B, T, S] bool.

  Key j is visible to query t when it is valid, not after the query's limit, (on sliding
  layers) after its window anchor minus the window, and (packed rows) of the query's segment:
    kv_valid[j] and kv_pos[j] <= q_limit[t] and kv_pos[j] > q_anchor[t] - window
    and kv_segment[j] == q_segment[t].
  Encoder (causal): anchor = limit = the query's own position.
  Decoder (a canvas starting at L): anchor = L, limit = the canvas's last position, so every
  canvas token sees the whole canvas and the last window-1 prefix tokens (the reference keeps
  exactly that many in its sliding-window cache).
  Packed rows (several examples in one row): segments are the example of each query and key, and
  positions restart at 0 in each example, so every example sees exactly what it sees alone.
  Segments None (one example per row) test nothing.
  """
  visible = kv_valid_BxS[:, None, :] & (kv_pos_BxS[:, None, :] <= q_limit_BxT[:, :, None])
  if sliding_window is not None:
    visible &= kv_pos_BxS[:, None, :] > q_anchor_BxT[:, :, None] - sliding_window
  if q_segment_BxT is not None:
    visible &= kv_segment_BxS[:, None, :] == q_segment_BxT[:, :, None]
  return visible
