"""The one mapping between transformers' checkpoint names/layouts and our parameter pytree.

Both directions live here: import (`params_from_hf`) and export (`hf_tensor_specs`) walk the same
table (`_layer_table`), so a tensor cannot be renamed on one side only.

transformers stores linear weights as [out, in]. A DiffusionGemma checkpoint holds the shared
backbone once, under the encoder or the decoder prefix (the other copy is tied; `save_pretrained`
writes the decoder's), plus the decoder-only self-conditioning block. A Gemma 4 checkpoint holds
the same backbone under `model.language_model.` (multimodal) or `model.` (text only).

A checkpoint with a vision tower holds it under `model.encoder.vision_tower.` and the multimodal
embedder under `model.encoder.embed_vision.` (Gemma 4: `model.vision_tower.`,
`model.embed_vision.`); they map to our `vision_tower` and `embed_vision` subtrees, every
tensor both ways, buffers included (the clippable linears' bounds, std_bias, std_scale).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator, Mapping

import jax
import numpy as np

from diffgemma import errors
from diffgemma.model.config import FULL, SLIDING, ModelConfig, VisionConfig

ENCODER = "model.encoder.language_model."
DECODER = "model.decoder."
SELF_CONDITIONING = DECODER + "self_conditioning."
GEMMA4_PREFIXES = ("model.language_model.", "model.")
DIFFUSION_GEMMA = "diffusion_gemma"
GEMMA4 = "gemma4"
# Where the vision tower and the multimodal embedder live, per checkpoint kind.
VISION_PREFIX = {DIFFUSION_GEMMA: "model.encoder.", GEMMA4: "model."}
# Gemma 4's audio tower: not part of DiffusionGemma, skipped with a note.
AUDIO_PREFIXES = ("model.audio_tower.", "model.embed_audio.")
# transformers requires these config keys; our model does not use them (RoPE needs no table).
HF_MAX_POSITION_EMBEDDINGS = 131_072
HF_ACTIVATION = "gelu_pytorch_tanh"
VISION_ROPE_TYPE = "axial"
# What each entry of `tensor_table` belongs to.
BACKBONE, SELF_CONDITIONING_BLOCK, VISION = "backbone", "self_conditioning", "vision"

_LAYER_NORMS = {
    "input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
    "pre_ffw_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
}


class WeightMappingError(errors.InputError, KeyError):
  """A tensor is missing, unexpected or has the wrong shape. One-line message."""

  def __str__(self):
    return str(self.args[0])


# ----------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one tensor changes between transformers' layout and ours (both directions)."""
  to_ours: Callable[[np.ndarray, tuple], np.ndarray]
  to_hf: Callable[[np.ndarray], np.ndarray]


SAME = Layout(lambda w, shape: w.reshape(shape), lambda w: w)
LINEAR = Layout(lambda w, shape: w.T, lambda w: w.T)  # [out, in] <-> [in, out]
HEADS_IN = Layout(lambda w, shape: w.T.reshape(shape),  # [H*hd, D] <-> [D, H, hd]
                  lambda w: w.reshape(w.shape[0], -1).T)
HEADS_OUT = Layout(lambda w, shape: w.T.reshape(shape),  # [D, H*hd] <-> [H, hd, D]
                   lambda w: w.reshape(-1, w.shape[-1]).T)
EXPERTS = Layout(lambda w, shape: np.swapaxes(w, -1, -2),  # [E, out, in] <-> [E, in, out]
                 lambda w: np.swapaxes(w, -1, -2))
SCALAR = Layout(lambda w, shape: w.reshape(shape), lambda w: w.reshape(1))  # [1] <-> []


def _layer_table(cfg: ModelConfig, i: int) -> dict[tuple, tuple[str, Layout]]:
  """Our leaf path under layers[i] -> (transformers name under the backbone prefix, layout)."""
  p = f"layers.{i}."
  table = {
      ("attn", "q"): (p + "self_attn.q_proj.weight", HEADS_IN),
      ("attn", "k"): (p + "self_attn.k_proj.weight", HEADS_IN),
      ("attn", "o"): (p + "self_attn.o_proj.weight", HEADS_OUT),
      ("attn", "q_norm"): (p + "self_attn.q_norm.weight", SAME),
      ("attn", "k_norm"): (p + "self_attn.k_norm.weight", SAME),
      ("mlp", "gate"): (p + "mlp.gate_proj.weight", LINEAR),
      ("mlp", "up"): (p + "mlp.up_proj.weight", LINEAR),
      ("mlp", "down"): (p + "mlp.down_proj.weight", LINEAR),
      ("router", "proj"): (p + "router.proj.weight", LINEAR),
      ("router", "scale"): (p + "router.scale", SAME),
      ("router", "per_expert_scale"): (p + "router.per_expert_scale", SAME),
      ("experts", "gate_up"): (p + "experts.gate_up_proj", EXPERTS),
      ("experts", "down"): (p + "experts.down_proj", EXPERTS),
      ("layer_scalar",): (p + "layer_scalar", SCALAR),
  }
  if cfg.layer_types[i] == SLIDING:  # full layers have k_eq_v: no v projection
    table[("attn", "v")] = (p + "self_attn.v_proj.weight", HEADS_IN)
  for ours, theirs in _LAYER_NORMS.items():
    table[(ours,)] = (p + theirs + ".weight", SAME)
  return table


_VISION_LAYER_NORMS = {
    "input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
    "pre_ffw_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
_VISION_LINEARS = {("attn", "q_proj"): ("self_attn.q_proj", HEADS_IN),
                   ("attn", "k_proj"): ("self_attn.k_proj", HEADS_IN),
                   ("attn", "v_proj"): ("self_attn.v_proj", HEADS_IN),
                   ("attn", "o_proj"): ("self_attn.o_proj", HEADS_OUT),
                   ("mlp", "gate_proj"): ("mlp.gate_proj", LINEAR),
                   ("mlp", "up_proj"): ("mlp.up_proj", LINEAR),
                   ("mlp", "down_proj"): ("mlp.down_proj", LINEAR)}
_CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")


def _vision_table(cfg: ModelConfig) -> Iterator[tuple[tuple, str, Layout]]:
  """The vision tower and the multimodal embedder: (our path, name under the vision prefix,
  layout)."""
  v = cfg.vision
  tower = ("vision_tower",)
  yield tower + ("patch_embedder", "input_proj"), "vision_tower.patch_embedder.input_proj.weight", \
      LINEAR
  yield (tower + ("patch_embedder", "position_embedding_table"),
         "vision_tower.patch_embedder.position_embedding_table", SAME)
  for i in range(v.num_hidden_layers):
    ours, theirs = tower + ("layers", i), f"vision_tower.encoder.layers.{i}."
    for (module, name), (linear, layout) in _VISION_LINEARS.items():
      yield ours + (module, name), theirs + linear + ".linear.weight", layout
      if v.use_clipped_linears:
        for bound in _CLIP_BOUNDS:
          yield ours + (module, name + "_clip", bound), theirs + f"{linear}.{bound}", SAME
    for norm in ("q_norm", "k_norm"):
      yield ours + ("attn", norm), theirs + f"self_attn.{norm}.weight", SAME
    for norm, hf_norm in _VISION_LAYER_NORMS.items():
      yield ours + (norm,), theirs + hf_norm + ".weight", SAME
  if v.standardize:
    for name in ("std_bias", "std_scale"):
      yield tower + (name,), f"vision_tower.{name}", SAME
  yield ("embed_vision", "projection"), "embed_vision.embedding_projection.weight", LINEAR


def tensor_table(cfg: ModelConfig) -> Iterator[tuple[tuple, str, Layout, str]]:
  """Every parameter: (our path, transformers name, layout, group).

  group BACKBONE: the name is relative to the backbone prefix; VISION: relative to the
  checkpoint kind's VISION_PREFIX (only with cfg.vision); SELF_CONDITIONING_BLOCK: absolute.
  """
  yield ("embedding",), "embed_tokens.weight", SAME, BACKBONE
  yield ("final_norm",), "norm.weight", SAME, BACKBONE
  for i in range(cfg.num_layers):
    for path, (name, layout) in _layer_table(cfg, i).items():
      yield ("layers", i) + path, name, layout, BACKBONE
  sc = {"pre_norm": SAME, "gate": LINEAR, "up": LINEAR, "down": LINEAR}
  for ours, layout in sc.items():
    theirs = "pre_norm.weight" if ours == "pre_norm" else f"{ours}_proj.weight"
    yield ("self_conditioning", ours), SELF_CONDITIONING + theirs, layout, SELF_CONDITIONING_BLOCK
  if cfg.vision is not None:
    for path, name, layout in _vision_table(cfg):
      yield path, name, layout, VISION


# ----------------------------------------------------------------------------- config


def checkpoint_kind(hf_config: Mapping[str, Any]) -> str:
  """DIFFUSION_GEMMA or GEMMA4 from a config.json dict; a one-line error otherwise."""
  model_type = hf_config.get("model_type", "")
  if model_type.startswith("diffusion_gemma"):
    return DIFFUSION_GEMMA
  if model_type.startswith("gemma4") and "assistant" not in model_type:
    return GEMMA4
  raise WeightMappingError(
      f"config.json has model_type {model_type!r}; expected a DiffusionGemma or Gemma 4 model")


def config_from_hf(hf_config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
  """Our ModelConfig from a DiffusionGemma or Gemma 4 `config.json` dict."""
  text = dict(hf_config.get("text_config") or hf_config)
  if checkpoint_kind(hf_config) == GEMMA4:
    _check_gemma4_backbone(text)
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
  try:
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
        pad_token_id=text.get("pad_token_id", 0),
        eos_token_id=_first(text.get("eos_token_id", 1)), bos_token_id=text.get("bos_token_id", 2),
        canvas_length=hf_config.get("canvas_length", 256),
        use_bidirectional_attention=text.get("use_bidirectional_attention"))
  except KeyError as e:
    raise WeightMappingError(f"config.json lacks the key {e.args[0]!r}") from None
  if hf_config.get("vision_config"):
    kwargs["vision"] = vision_config_from_hf(hf_config["vision_config"])
  for name in ("image_token_id", "boi_token_id", "eoi_token_id"):
    if hf_config.get(name) is not None:
      kwargs[name] = hf_config[name]
  kwargs.update(overrides)
  return ModelConfig(**kwargs)


def vision_config_from_hf(vision: Mapping[str, Any]) -> VisionConfig:
  """Our VisionConfig from a `vision_config` dict (Gemma 4's vision tower)."""
  problems = []
  if vision.get("model_type", "gemma4_vision") != "gemma4_vision":
    problems.append(f"model_type {vision.get('model_type')!r}")
  if vision.get("hidden_activation", HF_ACTIVATION) != HF_ACTIVATION:
    problems.append(f"hidden_activation {vision.get('hidden_activation')!r}")
  if vision.get("attention_bias"):
    problems.append("attention biases")
  rope = vision.get("rope_parameters") or {}
  if rope.get("rope_type", VISION_ROPE_TYPE) != VISION_ROPE_TYPE:
    problems.append(f"rope_type {rope.get('rope_type')!r}")
  if problems:
    raise WeightMappingError("config.json's vision_config is not Gemma 4's vision tower: " +
                             "; ".join(problems))
  names = [f.name for f in dataclasses.fields(VisionConfig) if f.name != "rope_theta"]
  kwargs = {name: vision[name] for name in names if vision.get(name) is not None}
  if "rope_theta" in rope:
    kwargs["rope_theta"] = rope["rope_theta"]
  return VisionConfig(**kwargs)


def vision_config_to_hf(vision: VisionConfig) -> dict[str, Any]:
  """transformers' `Gemma4VisionConfig` dict for our VisionConfig."""
  out = {"model_type": "gemma4_vision"}
  out.update({f.name: getattr(vision, f.name) for f in dataclasses.fields(VisionConfig)
              if f.name != "rope_theta" and getattr(vision, f.name) is not None})
  out.update({"rope_parameters": {"rope_type": VISION_ROPE_TYPE, "rope_theta": vision.rope_theta},
              "hidden_activation": HF_ACTIVATION, "attention_bias": False,
              "attention_dropout": 0.0, "max_position_embeddings": HF_MAX_POSITION_EMBEDDINGS})
  return out


def _check_gemma4_backbone(text: Mapping[str, Any]) -> None:
  """DiffusionGemma's backbone is the MoE Gemma 4 with k_eq_v and no per-layer inputs."""
  problems = []
  if not text.get("enable_moe_block"):
    problems.append("no MoE block (enable_moe_block is false)")
  if text.get("hidden_size_per_layer_input"):
    problems.append("per-layer input embeddings")
  if text.get("num_kv_shared_layers"):
    problems.append("KV-shared layers")
  if text.get("attention_k_eq_v") is False:
    problems.append("separate values on full layers (attention_k_eq_v is false)")
  if problems:
    raise WeightMappingError(
        "this Gemma 4 variant is not a DiffusionGemma backbone: " + "; ".join(problems) +
        " (use a 26B-A4B-style MoE checkpoint)")


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict[str, Any]:
  """transformers' DiffusionGemma `config.json` dict for our config (with its vision tower's
  `vision_config`, or None for a text-only model)."""
  text = {
      "model_type": "diffusion_gemma_text", "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "global_head_dim": cfg.global_head_dim,
      "num_global_key_value_heads": cfg.num_global_kv_heads, "attention_k_eq_v": True,
      "sliding_window": cfg.sliding_window, "layer_types": list(cfg.layer_types),
      "num_experts": cfg.num_experts, "top_k_experts": cfg.top_k_experts,
      "moe_intermediate_size": cfg.moe_intermediate_size, "enable_moe_block": True,
      "rms_norm_eps": cfg.rms_norm_eps, "final_logit_softcapping": cfg.final_logit_softcap,
      "rope_parameters": {
          SLIDING: {"rope_type": "default", "rope_theta": cfg.sliding_rope_theta},
          FULL: {"rope_type": "proportional", "rope_theta": cfg.full_rope_theta,
                 "partial_rotary_factor": cfg.full_rope_partial_factor}},
      "hidden_activation": HF_ACTIVATION, "initializer_range": cfg.initializer_range,
      "max_position_embeddings": HF_MAX_POSITION_EMBEDDINGS, "tie_word_embeddings": True,
      "pad_token_id": cfg.pad_token_id, "eos_token_id": cfg.eos_token_id,
      "bos_token_id": cfg.bos_token_id, "attention_bias": False, "attention_dropout": 0.0,
      "use_bidirectional_attention": cfg.use_bidirectional_attention,
  }
  return {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": DIFFUSION_GEMMA,
          "canvas_length": cfg.canvas_length, "tie_word_embeddings": True, "dtype": dtype,
          "image_token_id": cfg.image_token_id, "boi_token_id": cfg.boi_token_id,
          "eoi_token_id": cfg.eoi_token_id, "text_config": text,
          "vision_config": None if cfg.vision is None else vision_config_to_hf(cfg.vision)}


def _first(x):
  return x[0] if isinstance(x, (list, tuple)) else x


# ----------------------------------------------------------------------------- import


def backbone_prefix(names, kind: str) -> str:
  """Where the backbone lives in a checkpoint with tensor `names`."""
  candidates = (ENCODER, DECODER) if kind == DIFFUSION_GEMMA else GEMMA4_PREFIXES
  for prefix in candidates:
    if prefix + "embed_tokens.weight" in names:
      return prefix
  raise WeightMappingError(
      f"missing tensor {candidates[0] + 'embed_tokens.weight'!r} in the checkpoint "
      f"(no {kind} backbone found under {' or '.join(map(repr, candidates))})")


def params_from_hf(tensors: Mapping[str, Any], cfg: ModelConfig, abstract_params=None,
                   kind: str = DIFFUSION_GEMMA, dtype=None, place=None, strict: bool = True,
                   self_conditioning=None):
  """Our parameter pytree from a transformers state dict, one tensor at a time.

  Args:
    tensors: name -> array (numpy, memory-mapped, or anything np.asarray accepts).
    abstract_params: the expected pytree of shapes (default `transformer.abstract_params(cfg)`);
      every tensor is checked against it and a mismatch names the tensor.
    kind: DIFFUSION_GEMMA, or GEMMA4 (no self-conditioning block: pass `self_conditioning`).
      With cfg.vision, the vision tower and the multimodal embedder are read too.
    dtype: cast every tensor to this dtype (None keeps the checkpoint's).
    place: optional (path, numpy array) -> leaf, e.g. a device_put onto the leaf's sharding, so
      only one tensor at a time is held in host memory.
    strict: every tensor of the checkpoint but the audio tower's must be used; an unknown name
      raises.
  """
  place = place or (lambda path, arr: arr)
  if abstract_params is None:
    # local: model does not depend on the checkpoint mapping
    from diffgemma.model import transformer

    abstract_params = transformer.abstract_params(cfg)
  prefix = backbone_prefix(tensors, kind)
  used = set()
  params: dict[str, Any] = {"layers": [{} for _ in range(cfg.num_layers)]}
  if cfg.vision is not None:
    params["vision_tower"] = {"layers": [{} for _ in range(cfg.vision.num_hidden_layers)]}
  for path, name, layout, group in tensor_table(cfg):
    if group == SELF_CONDITIONING_BLOCK and kind == GEMMA4:
      continue
    full_name = {BACKBONE: prefix, VISION: VISION_PREFIX[kind]}.get(group, "") + name
    if full_name not in tensors:
      raise WeightMappingError(f"missing tensor {full_name!r} in the checkpoint")
    used.add(full_name)
    expected = _leaf(abstract_params, path).shape
    w = np.asarray(tensors[full_name])
    try:
      ours = layout.to_ours(w, expected)
    except ValueError:
      ours = None
    if ours is None or ours.shape != tuple(expected):
      raise WeightMappingError(
          f"tensor {full_name!r} has shape {tuple(w.shape)}, but the config expects "
          f"{_hf_shape(layout, expected)} "
          "(does config.json match the weights?)")
    if dtype is not None:
      ours = ours.astype(dtype)
    # (np.ascontiguousarray would turn a 0-d layer_scalar into shape [1].)
    _put(params, path, place(path, np.require(ours, requirements="C")))
    if path[-1] == "layer_scalar":
      _check_tied_scalar(tensors, name, prefix, kind, w, used)
  if kind == GEMMA4:
    if self_conditioning is None:
      raise ValueError("a Gemma 4 import needs freshly initialised self_conditioning params")
    params["self_conditioning"] = self_conditioning
    tied = ["lm_head.weight"]
  else:
    other = DECODER if prefix == ENCODER else ENCODER
    tied = ["lm_head.weight"] + [other + n for _, n, _, g in tensor_table(cfg) if g == BACKBONE]
  if strict:
    tied = set(tied)
    unused = [n for n in tensors if n not in used and n not in tied and not is_audio(n)]
    if unused:
      raise WeightMappingError(f"unexpected tensor {unused[0]!r} in the checkpoint "
                               f"({len(unused)} unused in all)")
  return params


def _check_tied_scalar(tensors, name, prefix, kind, value, used) -> None:
  """layer_scalar is an untied buffer in transformers; we share one value, so copies must agree."""
  if kind != DIFFUSION_GEMMA:
    return
  other = (DECODER if prefix == ENCODER else ENCODER) + name
  if other in tensors:
    used.add(other)
    if not np.allclose(np.asarray(tensors[other]).astype(np.float32).reshape(()),
                       np.asarray(value).astype(np.float32).reshape(())):
      raise WeightMappingError(f"tensor {other!r} differs from {prefix + name!r}; the encoder and "
                               "decoder layer_scalar must be equal")


def is_audio(name: str) -> bool:
  return name.startswith(AUDIO_PREFIXES)


def _leaf(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def _put(tree, path, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {}) if isinstance(tree, dict) else tree[key]
  tree[path[-1]] = value


# ----------------------------------------------------------------------------- export


def _hf_shape(layout: Layout, shape) -> tuple:
  struct = jax.ShapeDtypeStruct(tuple(shape), np.float32)
  return tuple(jax.eval_shape(layout.to_hf, struct).shape)


def hf_tensor_specs(cfg: ModelConfig, params, dtype=None):
  """(transformers name, shape, dtype, thunk) for every tensor of an export.

  The layout is what `save_pretrained` writes: the backbone under the decoder prefix (the
  encoder's copy is tied), both copies of the untied layer_scalar buffers, and the
  self-conditioning block, and with cfg.vision the vision tower and the multimodal embedder.
  Each thunk fetches one leaf (device -> host) when called.
  """
  for path, name, layout, group in tensor_table(cfg):
    leaf = _leaf(params, path)
    out_dtype = np.dtype(dtype or leaf.dtype)

    def fetch(leaf=leaf, layout=layout, out_dtype=out_dtype):
      return np.asarray(layout.to_hf(np.asarray(leaf))).astype(out_dtype, copy=False)

    shape = _hf_shape(layout, leaf.shape)
    full_name = {BACKBONE: DECODER, VISION: VISION_PREFIX[DIFFUSION_GEMMA]}.get(group, "") + name
    yield full_name, shape, out_dtype, fetch
    if path[-1] == "layer_scalar":
      yield ENCODER + name, shape, out_dtype, fetch
