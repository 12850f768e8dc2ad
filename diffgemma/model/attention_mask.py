"""The model's one attention-mask rule, shared by the XLA path (layers.py) and the Pallas canvas
kernel (kernels/attention.py), which builds it block by block.

A leaf module: it imports nothing from the package, so the model and the kernels both import it
without importing each other.
"""

from __future__ import annotations


def attention_mask(q_anchor_BxT, q_limit_BxT, kv_pos_BxS, kv_valid_BxS, sliding_window):
  """The one attention mask of the model, [B, T, S] bool.

  Key j is visible to query t when it is valid, not after the query's limit, and (on sliding
  layers) after its window anchor minus the window:
    kv_valid[j] and kv_pos[j] <= q_limit[t] and kv_pos[j] > q_anchor[t] - window.
  Encoder (causal): anchor = limit = the query's own position.
  Decoder (a canvas starting at L): anchor = L, limit = the canvas's last position, so every
  canvas token sees the whole canvas and the last window-1 prefix tokens (the reference keeps
  exactly that many in its sliding-window cache).
  """
  visible = kv_valid_BxS[:, None, :] & (kv_pos_BxS[:, None, :] <= q_limit_BxT[:, :, None])
  if sliding_window is not None:
    visible &= kv_pos_BxS[:, None, :] > q_anchor_BxT[:, :, None] - sliding_window
  return visible
