"""Mapping between transformers' DiffusionGemma names/layouts and our parameter pytree.

transformers stores linear weights as [out, in] and duplicates the shared backbone under the
encoder and the decoder (tied); we read the encoder copy and the decoder-only self-conditioning
block. This is the core of the checkpoint importer.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from diffgemma.config import FULL, SLIDING, ModelConfig

ENCODER = "model.encoder.language_model."
DECODER = "model.decoder."

_LAYER_NORMS = {
    "input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
    "pre_ffw_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}


class WeightMappingError(KeyError):
  """A tensor is missing, unexpected or has the wrong shape."""

  def __str__(self):
    return str(self.args[0])


def config_from_hf(hf_config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
  """Our ModelConfig from a DiffusionGemma `config.json` dict (top level with text_config)."""
  text = dict(hf_config.get("text_config", hf_config))
  rope = text.get("rope_parameters") or {}
  sliding_rope = rope.get(SLIDING, {})
  full_rope = rope.get(FULL, {})
  layer_types = text.get("layer_types")
  per_layer = text.get("per_layer_config") or {}
  global_head_dim = text.get("global_head_dim")
  global_kv = text.get("num_global_key_value_heads")
  for idx, layer_cfg in per_layer.items():  # serialised per-layer overrides of full layers
    if layer_types and layer_types[int(idx)] == FULL:
      global_head_dim = layer_cfg.get("head_dim", global_head_dim)
      global_kv = layer_cfg.get("num_key_value_heads", global_kv)
  kwargs = dict(
      vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
      intermediate_size=text["intermediate_size"], num_layers=text["num_hidden_layers"],
      num_heads=text["num_attention_heads"], num_kv_heads=text["num_key_value_heads"],
      head_dim=text["head_dim"], global_head_dim=global_head_dim or 512,
      num_global_kv_heads=global_kv or text["num_key_value_heads"],
      sliding_window=text["sliding_window"], layer_types=tuple(layer_types or ()),
      num_experts=text["num_experts"], top_k_experts=text["top_k_experts"],
      moe_intermediate_size=text["moe_intermediate_size"], rms_norm_eps=text["rms_norm_eps"],
      initializer_range=text.get("initializer_range", 0.02),
      final_logit_softcap=text.get("final_logit_softcapping") or 30.0,
      sliding_rope_theta=sliding_rope.get("rope_theta", 10_000.0),
      full_rope_theta=full_rope.get("rope_theta", 1_000_000.0),
      full_rope_partial_factor=full_rope.get("partial_rotary_factor", 0.25),
      pad_token_id=text.get("pad_token_id", 0), eos_token_id=_first(text.get("eos_token_id", 1)),
      bos_token_id=text.get("bos_token_id", 2),
      canvas_length=hf_config.get("canvas_length", 256))
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


def _first(x):
  return x[0] if isinstance(x, (list, tuple)) else x


def hf_layer_names(cfg: ModelConfig, i: int) -> dict[str, tuple[str, Any]]:
  """Our leaf path -> (transformers name under the encoder prefix, layout converter)."""
  p = f"layers.{i}."
  hd, h, kv, d = cfg.layer_head_dim(i), cfg.num_heads, cfg.layer_kv_heads(i), cfg.hidden_size
  names = {
      "attn/q": (p + "self_attn.q_proj.weight", lambda w: w.T.reshape(d, h, hd)),
      "attn/k": (p + "self_attn.k_proj.weight", lambda w: w.T.reshape(d, kv, hd)),
      "attn/o": (p + "self_attn.o_proj.weight", lambda w: w.T.reshape(h, hd, d)),
      "attn/q_norm": (p + "self_attn.q_norm.weight", None),
      "attn/k_norm": (p + "self_attn.k_norm.weight", None),
      "mlp/gate": (p + "mlp.gate_proj.weight", _t), "mlp/up": (p + "mlp.up_proj.weight", _t),
      "mlp/down": (p + "mlp.down_proj.weight", _t),
      "router/proj": (p + "router.proj.weight", _t), "router/scale": (p + "router.scale", None),
      "router/per_expert_scale": (p + "router.per_expert_scale", None),
      "experts/gate_up": (p + "experts.gate_up_proj", _t_last),
      "experts/down": (p + "experts.down_proj", _t_last),
      "layer_scalar": (p + "layer_scalar", lambda w: w.reshape(())),
  }
  if cfg.layer_types[i] == SLIDING:
    names["attn/v"] = (p + "self_attn.v_proj.weight", lambda w: w.T.reshape(d, kv, hd))
  for ours, theirs in _LAYER_NORMS.items():
    names[ours] = (p + theirs + ".weight", None)
  return names


def _t(w):
  return w.T


def _t_last(w):
  return np.swapaxes(w, -1, -2)


def params_from_hf(state_dict: Mapping[str, Any], cfg: ModelConfig, dtype=None,
                   strict: bool = True):
  """Our parameter pytree (numpy arrays) from a transformers DiffusionGemma state dict.

  `state_dict` maps names to numpy arrays (or anything np.asarray accepts). With `strict`, every
  text tensor must be used: an unknown name raises, naming it.
  """
  used = set()

  def get(name):
    if name not in state_dict:
      raise WeightMappingError(f"missing tensor {name!r} in the checkpoint")
    used.add(name)
    arr = np.asarray(state_dict[name])
    return arr.astype(dtype) if dtype is not None else arr

  def put(tree, path, value):
    *parents, leaf = path.split("/")
    for key in parents:
      tree = tree.setdefault(key, {})
    tree[leaf] = value

  params = {"embedding": get(ENCODER + "embed_tokens.weight"),
            "final_norm": get(ENCODER + "norm.weight"), "layers": []}
  if params["embedding"].shape != (cfg.vocab_size, cfg.hidden_size):
    raise WeightMappingError(
        f"tensor {ENCODER}embed_tokens.weight has shape {params['embedding'].shape}, config "
        f"expects {(cfg.vocab_size, cfg.hidden_size)}")
  for i in range(cfg.num_layers):
    layer: dict[str, Any] = {}
    for ours, (theirs, convert) in hf_layer_names(cfg, i).items():
      w = get(ENCODER + theirs)
      try:
        put(layer, ours, convert(w) if convert else w)
      except ValueError as e:
        raise WeightMappingError(
            f"tensor {ENCODER + theirs} has shape {w.shape}, incompatible with the config") from e
    # layer_scalar is an untied buffer in transformers; we share one value, so both copies must agree.
    dec_scalar = DECODER + f"layers.{i}.layer_scalar"
    if dec_scalar in state_dict:
      used.add(dec_scalar)
      if not np.allclose(np.asarray(state_dict[dec_scalar]).reshape(()), layer["layer_scalar"]):
        raise WeightMappingError(f"tensor {dec_scalar!r} differs from the encoder's layer_scalar")
    params["layers"].append(layer)
  sc = DECODER + "self_conditioning."
  params["self_conditioning"] = {
      "pre_norm": get(sc + "pre_norm.weight"), "gate": get(sc + "gate_proj.weight").T,
      "up": get(sc + "up_proj.weight").T, "down": get(sc + "down_proj.weight").T}
  if strict:
    unused = [n for n in state_dict if n not in used and _is_text_tensor(n)]
    if unused:
      raise WeightMappingError(f"unexpected tensor {unused[0]!r} ({len(unused)} unused in all)")
  return params


def _is_text_tensor(name: str) -> bool:
  """Tensors that must be consumed: encoder backbone and decoder self-conditioning.

  The decoder's copy of the backbone and lm_head are tied duplicates; vision tensors are
  out of scope for the text model.
  """
  if name.startswith(ENCODER):
    return True
  if name.startswith(DECODER + "self_conditioning."):
    return True
  known_other = (DECODER, "lm_head.", "model.encoder.vision_tower.", "model.encoder.embed_vision.")
  return not name.startswith(known_other)
