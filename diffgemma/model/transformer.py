"""The DiffusionGemma network: the flax.linen `Model` (its parts, which own the parameters and
call pure functions for the math, are in diffgemma/model/layers.py and diffgemma/model/moe.py);
`encode`, `decode` and `init_params` are thin wrappers of `Model.apply` / `Model.init` over the
parameter pytree.

One set of weights, two entry points:
  * `encode`: causal (sliding-window causal on sliding layers) over new tokens; writes their K/V
    into a static-shape cache and returns hidden states.
  * `decode`: a canvas of C tokens attends bidirectionally to itself and to the valid cached
    prefix; it reads the cache and never writes it. Only the decoder has the self-conditioning
    block.
`lm_head` turns hidden states into float32 soft-capped logits with the tied embedding.
With a vision tower (cfg.vision), `encode` also takes images (`vision.Images`): their soft tokens
replace the prompt's image placeholder tokens before the first layer, and the decoder reads them
through the cache as it reads text.

Parameter layout (linear weights are [in, out]):
  embedding [V, D], final_norm [D],
  self_conditioning: pre_norm [D], gate [D, F], up [D, F], down [F, D]
  layers[i]: input_norm, post_attn_norm, pre_ffw_norm, post_ffw_norm, post_ffw_norm_1,
             pre_ffw_norm_2, post_ffw_norm_2 [D]; layer_scalar [];
             attn: q [D, H, hd], k [D, K, hd], v [D, K, hd] (sliding layers only; full layers
                   take values from k), o [H, hd, D], q_norm [hd], k_norm [hd];
             mlp: gate [D, F], up [D, F], down [F, D];
             router: proj [D, E], scale [D], per_expert_scale [E];
             experts: gate_up [E, D, 2I], down [E, I, D];
  with cfg.vision: vision_tower and embed_vision (diffgemma/model/vision.py).
Shape suffixes: B batch, T new tokens, S cache slots, C canvas, D hidden, H heads, K kv heads,
V vocab, E experts, N tokens (flattened), M token-expert assignments.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffgemma.model import attention_mask as mask_lib
from diffgemma.model import sharding, vision
from diffgemma.model.config import FULL, SLIDING, ModelConfig
from diffgemma.model.initializers import (draw_keys, layer_draw_offsets, normal_init, num_draws,
                                          ones_init)
from diffgemma.model.layers import (MLP, Attention, Module, Params, SelfConditioning,
                                    attention, layer_mask_specs, rms_norm, rms_norms,
                                    share_scopes)
from diffgemma.model.moe import Experts, Router

Cache = dict[str, Any]


# ----------------------------------------------------------------------------- embeddings & head


@jax.named_scope("embedding")
def embed(params: Params, tokens_BxT, cfg: ModelConfig):
  """Scaled embedding lookup; the reference rounds sqrt(D) to the weight dtype."""
  table = params["embedding"]
  scale = jnp.asarray(cfg.hidden_size ** 0.5, table.dtype)
  return sharding.constrain((table[tokens_BxT] * scale).astype(cfg.compute_dtype), sharding.HIDDEN)


@jax.named_scope("lm_head")
def lm_head(params: Params, h_BxTxD, cfg: ModelConfig):
  """Tied-embedding logits in float32, soft-capped: cap * tanh(logits / cap)."""
  logits = (h_BxTxD @ params["embedding"].astype(h_BxTxD.dtype).T).astype(jnp.float32)
  cap = cfg.final_logit_softcap
  return sharding.constrain(cap * jnp.tanh(logits / cap), sharding.LOGITS)


@jax.named_scope("self_conditioning")
def self_conditioning_embedding(params: Params, logits_BxCxV, cfg: ModelConfig):
  """softmax(previous logits) @ embedding * sqrt(D): the decoder's soft input."""
  return soft_embedding(params, jax.nn.softmax(logits_BxCxV.astype(jnp.float32), axis=-1), cfg)


def soft_embedding(params: Params, probs_BxCxV, cfg: ModelConfig, token_ids_BxCxK=None):
  """probs @ embedding * sqrt(D), [B, C, D] in the compute dtype.

  With `token_ids_BxCxK`, probs_BxCxK is a distribution over those K tokens only (a top-k
  truncation): K embedding rows are gathered instead of a [V, D] matmul.
  """
  table = params["embedding"]
  probs = probs_BxCxV.astype(table.dtype)
  if token_ids_BxCxK is None:
    # Batch-sharded probabilities and a hidden-layout output: otherwise the partitioner may
    # gather the [B, C, V] probabilities onto every device rather than reduce the [B, C, D]
    # product.
    soft = sharding.constrain(probs, sharding.LOGITS) @ table
  else:
    soft = jnp.einsum("bck,bckd->bcd", probs, table[token_ids_BxCxK])
  soft = (soft * jnp.asarray(cfg.hidden_size ** 0.5, table.dtype)).astype(cfg.compute_dtype)
  return sharding.constrain(soft, sharding.HIDDEN)


# ----------------------------------------------------------------------------- cache


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> Cache:
  """An empty static-shape KV cache of `max_len` slots; slot index = token position."""
  dt = jnp.dtype(cfg.compute_dtype)
  layers = []
  for i in range(cfg.num_layers):
    shape = (batch, max_len, cfg.layer_kv_heads(i), cfg.layer_head_dim(i))
    layers.append({"k": jnp.zeros(shape, dt), "v": jnp.zeros(shape, dt)})
  return {"layers": layers, "valid": jnp.zeros((batch, max_len), bool),
          "end": jnp.zeros((), jnp.int32)}


# ----------------------------------------------------------------------------- entry points


def encode(params: Params, cfg: ModelConfig, tokens_BxT, cache: Cache, valid_BxT=None,
           images: vision.Images | None = None, positions_BxT=None, segment_ids_BxT=None):
  """Causal pass over T new tokens written at cache slots [end, end+T).

  Args:
    tokens_BxT: int tokens; `valid_BxT` marks real tokens (False = padding, never attended).
    cache: from `init_cache` or a previous `encode`; positions are cache slot indices.
    images: the images of these tokens (a model with a vision tower): pixel values and patch
      positions as transformers' Gemma 4 image processor makes them, one row per image in
      the order their placeholders (cfg.image_token_id) appear, row-major over [B, T] (rows
      of all padding, unused slots, add nothing); the placeholders must number the images'
      soft tokens (`vision.check_image_tokens`).
    positions_BxT, segment_ids_BxT: packed rows (both or neither): each token's position in its
      example (RoPE; from 0) and its example's id; a token sees earlier tokens of its own
      example only. The cache then also holds each slot's "positions" and "segments", which
      `decode` reads.
  With cfg.use_bidirectional_attention == "vision", each run of placeholders attends
  bidirectionally within itself (images given or not; within its segment in packed rows).
  Returns:
    (hidden_BxTxD after the final norm, updated cache with end += T).
  A thin wrapper: `Model.encode` is the network.
  """
  return Model(cfg).apply(to_variables(params), tokens_BxT, cache, valid_BxT, images,
                          positions_BxT, segment_ids_BxT, method=Model.encode)


def decode(params: Params, cfg: ModelConfig, canvas_BxC, cache: Cache, prefix_len_B=None,
           self_cond_logits_BxCxV=None, self_cond_mask_B=None, self_cond_embedding_BxCxD=None,
           canvas_segments_BxE=None):
  """Bidirectional denoiser over a canvas; returns float32 logits [B, C, V].

  The canvas occupies positions prefix_len .. prefix_len + C - 1 and sees cached slots
  j < prefix_len that are valid (sliding layers: only the last window-1 of them). Self-
  conditioning logits are optional; examples with `self_cond_mask_B` False get zeros. A
  precomputed `self_cond_embedding_BxCxD` (`soft_embedding` of the previous probabilities, as
  the fused sampling step makes it) replaces the logits.
  `prefix_len_B` defaults to the cache end (sampling); training passes a per-example value.
  Packed rows (a cache `encode` filled with segment ids): the row holds E = C / canvas_length
  canvases side by side, canvas e of example `canvas_segments_BxE[:, e]` (0: none) at its
  example's positions prefix_len_BxE[:, e] ..; each sees its own canvas and the valid cached
  slots of its example before it, as that example alone would.
  A thin wrapper: `Model.decode` is the network.
  """
  return Model(cfg).apply(to_variables(params), canvas_BxC, cache, prefix_len_B,
                          self_cond_logits_BxCxV, self_cond_mask_B, self_cond_embedding_BxCxD,
                          canvas_segments_BxE, method=Model.decode)


# ----------------------------------------------------------------------------- init


def init_params(cfg: ModelConfig, rng, std: float | None = None) -> Params:
  """Random parameters: `Model(cfg).init` as a `Params` tree (normal(std) linears and
  embedding, std defaulting to cfg.initializer_range; unit norms and scales; q/k norms at
  cfg.qk_norm_init).

  The normal draws take the keys this function has always used (one split of `rng`, layer by
  layer, then the embedding, then the self-conditioning block), so a seed gives the same weights
  as before the  Each leaf is drawn by a small jitted program per distinct shape (a few
  compiles, reused across layers and models): one program holding every leaf's draw took
  XLA:CPU ~20 s to compile for the 7-layer test model, far more than the draws.
  """
  return from_variables(init_variables(cfg, rng, std))


@functools.partial(jax.jit, static_argnums=(0, 2))
def init_self_conditioning(cfg: ModelConfig, rng, std: float | None = None) -> Params:
  """A fresh self-conditioning block, initialised as `init_params` does (for a decoder built
  from a Gemma 4 AR backbone, which has none)."""
  std = cfg.initializer_range if std is None else std
  with draw_keys(jax.random.split(rng, 3)):
    variables = SelfConditioning(cfg, std, 0).init(
        rng, method=SelfConditioning.declare)
  return dict(nn.unbox(variables)["params"])


def abstract_params(cfg: ModelConfig) -> Params:
  """Shapes and dtypes of the parameters (of `Model(cfg).init`), without allocating."""
  return jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0)))


def param_counts(cfg: ModelConfig) -> dict[str, int]:
  """Total and per-token active parameter counts of a config (no weights allocated).

  "Active" counts what one token's forward pass touches: the embedding (tied with the LM head),
  every attention, dense-MLP, router and norm weight, and top_k of num_experts experts per layer.
  The self-conditioning block is decoder-only and the vision tower (with its embedder) reads
  only images; both are reported separately, and `total` and `active` exclude them, as the
  backbone counts of Gemma 4 do.
  """
  shapes = abstract_params(cfg)
  size = lambda tree: int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(tree)))
  self_cond = size(shapes["self_conditioning"])
  vision_size = size([shapes.get(k, {}) for k in VISION_SUBTREES])
  backbone = size(shapes) - self_cond - vision_size
  experts = sum(size(layer["experts"]) for layer in shapes["layers"])
  active_experts = experts * cfg.top_k_experts // cfg.num_experts
  return {"total": backbone, "active": backbone - experts + active_experts,
          "embedding": size(shapes["embedding"]), "experts": experts,
          "self_conditioning": self_cond, "vision": vision_size}


def count_params(params: Params) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))


# ============================================================================= flax.linen modules
#
# Module tree (the `params` collection it owns; linear weights are [in, out]):
#
#     Model                              encode / decode / lm_head via apply(..., method=...)
#     ├── Embedder        embedding [V, D]                (shares Model's scope)
#     ├── RMSNorm         final_norm [D]                  (shares Model's scope)
#     ├── layers_{i}: Layer
#     │   ├── attn: Attention     q [D,H,hd], k [D,K,hd], v [D,K,hd] (sliding layers only),
#     │   │                       o [H,hd,D], q_norm [hd], k_norm [hd]; the Pallas kernel or XLA
#     │   │                       attention as cfg.attention_impl says
#     │   ├── mlp: MLP            gate [D,F], up [D,F], down [F,D]
#     │   ├── router: Router      proj [D,E], scale [D], per_expert_scale [E]
#     │   ├── experts: Experts    gate_up [E,D,2I], down [E,I,D]; cfg.moe_impl's grouped matmul
#     │   ├── RMSNorm x 7         input_norm, post_attn_norm, pre_ffw_norm, post_ffw_norm,
#     │   │                       post_ffw_norm_1, pre_ffw_norm_2, post_ffw_norm_2 [D] (shared scope)
#     │   └── layer_scalar []
#     ├── self_conditioning: SelfConditioning
#     │   ├── RMSNorm pre_norm [D]          (shared scope)
#     │   └── MLP gate, up, down            (shared scope)
#     ├── vision_tower: vision.VisionTower  (cfg.vision only; its layers are layers_{i} too)
#     └── embed_vision: vision.MultimodalEmbedder
#
# The modules own the parameters and call pure functions for the math (`rms_norm`,
# `project_qkv`, `attention` in layers.py, `route`, `moe` in moe.py, ...), so XLA sees the program
# the function form built. `nn.share_scope` keeps each norm's weight (and the self-conditioning
# MLP's) a leaf of its parent, as the parameter tree has always had it.
#
# The one difference between the linen `params` collection and `Params` (the tree every
# checkpoint, the HF converter, LoRA, QLoRA, sharding and the memory plans use) is the layers:
# a Python list `params["layers"]` (and `params["vision_tower"]["layers"]`) there, submodules
# `layers_0`, `layers_1`, ... here.
# `to_variables` and `from_variables` map one to the other (no array is touched); `encode`,
# `decode` and `init_params` call them, so nothing outside this file sees linen's names.


class Embedder(Module):
  """The tied embedding: token lookup, soft embedding (self-conditioning) and the LM head."""
  cfg: ModelConfig
  std: float
  draw: int

  def setup(self):
    cfg = self.cfg
    self.embedding = self.weight("embedding", normal_init(self.std, self.draw),
                                 (cfg.vocab_size, cfg.hidden_size), cfg.param_dtype,
                                 ("vocab", "embed"))

  def _params(self):
    return {"embedding": self.embedding}

  def encode(self, tokens_BxT):
    chex.assert_rank(tokens_BxT, 2)
    return embed(self._params(), tokens_BxT, self.cfg)

  def decode(self, h_BxTxD):
    chex.assert_axis_dimension(h_BxTxD, -1, self.cfg.hidden_size)
    return lm_head(self._params(), h_BxTxD, self.cfg)

  def self_conditioning(self, logits_BxCxV):
    chex.assert_axis_dimension(logits_BxCxV, -1, self.cfg.vocab_size)
    return self_conditioning_embedding(self._params(), logits_BxCxV, self.cfg)



LAYER_NORMS = ("input_norm", "post_attn_norm", "pre_ffw_norm", "post_ffw_norm", "post_ffw_norm_1",
               "pre_ffw_norm_2", "post_ffw_norm_2")


class Layer(Module):
  """Pre/post-normed attention, then the parallel dense + MoE block, then the layer scalar."""
  cfg: ModelConfig
  index: int
  std: float

  def setup(self):
    cfg, i = self.cfg, self.index
    draw = layer_draw_offsets(cfg)[i]
    layer_type = cfg.layer_types[i]
    self.attn = Attention(cfg, layer_type, cfg.layer_head_dim(i), cfg.layer_kv_heads(i), self.std,
                          draw)
    after_attn = draw + 3 + (layer_type == SLIDING)
    self.mlp = MLP(cfg, self.std, after_attn)
    self.router = Router(cfg, self.std, after_attn + 3)
    self.experts = Experts(cfg, self.std, after_attn + 4)
    self.norms = rms_norms(LAYER_NORMS, cfg.hidden_size, cfg)
    share_scopes(self, self.norms)
    self.layer_scalar = self.weight("layer_scalar", ones_init(), (), cfg.param_dtype)

  def declare(self):
    """Creates every parameter (`Model.declare`)."""
    for sub in (self.attn, self.mlp, self.router, self.experts, *self.norms.values()):
      sub.declare()

  def __call__(self, h_BxTxD, positions_BxT, attend: Callable):
    """`attend(q, k, v) -> (out_BxTxHxd, extra)` is the encoder's or decoder's attention."""
    chex.assert_rank(h_BxTxD, 3)
    norm = self.norms
    # Named scopes label the compiled operations (benchmarks/step_profile.py reads them).
    with jax.named_scope("attention"):
      q, k, v = self.attn.project(norm["input_norm"](h_BxTxD), positions_BxT)
      attn_out, extra = attend(q, k, v)
      h = h_BxTxD + norm["post_attn_norm"](self.attn.out(attn_out))
    h = h + self.feed_forward(h)
    # layer_scalar is a fixed buffer in the reference, never trained.
    h = h * jax.lax.stop_gradient(self.layer_scalar).astype(h.dtype)
    chex.assert_equal_shape([h, h_BxTxD])
    return sharding.constrain(h, sharding.HIDDEN), extra

  def feed_forward(self, h_BxTxD):
    """Dense MLP and MoE in parallel from the residual stream h (the router reads h itself)."""
    norm = self.norms
    with jax.named_scope("dense_mlp"):
      dense = norm["post_ffw_norm_1"](self.mlp(norm["pre_ffw_norm"](h_BxTxD)))
    with jax.named_scope("moe"):
      b, t, d = h_BxTxD.shape
      h_NxD = h_BxTxD.reshape(-1, d)
      weights, index = self.router(h_NxD)
      sparse = self.experts(norm["pre_ffw_norm_2"](h_NxD), weights, index, b, t)
      sparse = norm["post_ffw_norm_2"](sparse.reshape(h_BxTxD.shape))
    return norm["post_ffw_norm"](dense + sparse)



class Model(Module):
  """The DiffusionGemma network: `encode`, `decode` and `lm_head` (use them through
  `Model(cfg).apply({"params": to_variables(params)}, ..., method=Model.encode)`, or the
  `transformer` functions of the same names, which do exactly that)."""
  cfg: ModelConfig
  init_std: float | None = None  # None: cfg.initializer_range

  def setup(self):
    cfg = self.cfg
    std = cfg.initializer_range if self.init_std is None else self.init_std
    offsets = layer_draw_offsets(cfg)
    self.layers = [Layer(cfg, i, std) for i in range(cfg.num_layers)]
    self.embedder = Embedder(cfg, std, offsets[-1])
    nn.share_scope(self, self.embedder)
    self.norms = rms_norms(("final_norm",), cfg.hidden_size, cfg)
    share_scopes(self, self.norms)
    self.self_conditioning = SelfConditioning(cfg, std, offsets[-1] + 1)
    if cfg.vision is not None:
      self.vision_tower = vision.VisionTower(cfg)
      self.embed_vision = vision.MultimodalEmbedder(cfg)

  def declare(self):
    """Creates every parameter without running the network: `Model(cfg).init(rng,
    method=Model.declare)`."""
    for layer in self.layers:
      layer.declare()
    self.embedder.declare()
    self.norms["final_norm"].declare()
    self.self_conditioning.declare()
    if self.cfg.vision is not None:
      self.vision_tower.declare()
      self.embed_vision.declare()

  def embed_images(self, tokens_BxT, h_BxTxD, images: vision.Images):
    """The token embeddings with the images' soft tokens over their placeholders."""
    if self.cfg.vision is None:
      raise ValueError("images given to a model without a vision tower (model.vision is None)")
    with jax.named_scope("vision"):
      soft_NxLxDv, valid_NxL = self.vision_tower(images.pixel_values, images.position_ids)
      features_NxLxD = self.embed_vision(soft_NxLxDv)
      h = vision.scatter_image_features(h_BxTxD, tokens_BxT, features_NxLxD, valid_NxL,
                                        self.cfg.image_token_id)
    return sharding.constrain(h, sharding.HIDDEN)

  def lm_head(self, h_BxTxD):
    return self.embedder.decode(h_BxTxD)

  def _run_layer(self, i: int, h_BxTxD, positions_BxT, attend):
    """Layer i under the config's rematerialisation policy (cfg.remat).

    The layer runs as a pure function of its parameter subtree, which passes an optimization
    barrier with the layer's input first: a sharded weight's all-gather can then not be
    scheduled before the previous layer is done (else every layer's gathered weights may be
    live at once).
    """
    cfg = self.cfg
    layer_params = self.get_variable("params", f"layers_{i}")
    layer = Layer(cfg, i, self.layers[i].std, parent=None)

    def fn(h, params):
      h, params = jax.lax.optimization_barrier((h, params))
      # The q/k/v projections read the weights from outside the barrier (and, under remat,
      # from outside the checkpointed function): the program the function form always built.
      params = {**params, "attn": {**params["attn"], **{
          k: w for k, w in layer_params["attn"].items() if k != "o"}}}
      return layer.apply({"params": params}, h, positions_BxT, attend)

    if cfg.remat == "full":
      fn = jax.checkpoint(fn)
    elif cfg.remat == "dots":
      fn = jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return fn(h_BxTxD, layer_params)

  def encode(self, tokens_BxT, cache, valid_BxT=None, images: vision.Images | None = None,
             positions_BxT=None, segment_ids_BxT=None):
    """`transformer.encode`: causal pass over T new tokens written at cache slots [end, end+T)
    (images: over their placeholders; positions and segment ids: packed rows)."""
    cfg = self.cfg
    chex.assert_rank(tokens_BxT, 2)
    chex.assert_type(tokens_BxT, int)
    b, t = tokens_BxT.shape
    chex.assert_shape(cache["valid"], (b, None))
    start = cache["end"]
    if valid_BxT is None:
      valid_BxT = jnp.ones((b, t), bool)
    chex.assert_shape(valid_BxT, (b, t))
    kv_valid_BxS = jax.lax.dynamic_update_slice(cache["valid"], valid_BxT, (0, start))
    num_slots = kv_valid_BxS.shape[1]
    slot_BxS = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), (b, num_slots))
    packed = segment_ids_BxT is not None
    if packed != (positions_BxT is not None) or (not packed and "segments" in cache):
      raise ValueError("packed rows need positions_BxT and segment_ids_BxT, both, and a cache "
                       "of packed rows needs them on every encode")
    segments = {}
    if packed:
      chex.assert_shape([positions_BxT, segment_ids_BxT], (b, t))
      positions_BxT = positions_BxT.astype(jnp.int32)
      put = lambda slots_BxS, x_BxT: jax.lax.dynamic_update_slice(
          slots_BxS, x_BxT.astype(jnp.int32), (0, start))
      kv_pos_BxS = put(cache.get("positions", slot_BxS), positions_BxT)
      kv_segment_BxS = put(cache.get("segments", jnp.zeros_like(slot_BxS)), segment_ids_BxT)
      segments = dict(q_segment_BxT=segment_ids_BxT, kv_segment_BxS=kv_segment_BxS)
    else:
      positions_BxT = jnp.broadcast_to(start + jnp.arange(t, dtype=jnp.int32), (b, t))
      kv_pos_BxS = slot_BxS
    blocks = {}
    if cfg.use_bidirectional_attention == "vision":
      # Image runs of these tokens; cached slots belong to no block (a prompt's images are
      # encoded in the pass that holds them).
      q_block_BxT = mask_lib.image_blocks((tokens_BxT == cfg.image_token_id) & valid_BxT)
      kv_block_BxS = jax.lax.dynamic_update_slice(jnp.full((b, num_slots), -1, jnp.int32),
                                                  q_block_BxT, (0, start))
      blocks = dict(q_block_BxT=q_block_BxT, kv_block_BxS=kv_block_BxS)
    masks = layer_mask_specs(cfg, positions_BxT, positions_BxT, kv_pos_BxS, kv_valid_BxS,
                             **segments, **blocks)

    h = self.embedder.encode(tokens_BxT)
    if images is not None:
      h = self.embed_images(tokens_BxT, h, images)
    new_layers = []
    for i, layer_type in enumerate(cfg.layer_types):
      layer_cache = cache["layers"][i]

      def attend(q, k, v, layer_type=layer_type, layer_cache=layer_cache):
        k_all = jax.lax.dynamic_update_slice(layer_cache["k"], k.astype(layer_cache["k"].dtype),
                                             (0, start, 0, 0))
        v_all = jax.lax.dynamic_update_slice(layer_cache["v"], v.astype(layer_cache["v"].dtype),
                                             (0, start, 0, 0))
        out = attention(q, k_all.astype(q.dtype), v_all.astype(q.dtype), masks[layer_type],
                          cfg)
        return out, {"k": k_all, "v": v_all}

      h, new_cache = self._run_layer(i, h, positions_BxT, attend)
      new_layers.append(new_cache)
    h = self.norms["final_norm"](h)
    new_cache = {"layers": new_layers, "valid": kv_valid_BxS, "end": start + t}
    if packed:
      new_cache.update(positions=kv_pos_BxS, segments=kv_segment_BxS)
    return h, new_cache

  def decode(self, canvas_BxC, cache, prefix_len_B=None, self_cond_logits_BxCxV=None,
             self_cond_mask_B=None, self_cond_embedding_BxCxD=None, canvas_segments_BxE=None):
    """`transformer.decode`: the bidirectional denoiser over a canvas; float32 logits [B, C, V]."""
    cfg = self.cfg
    chex.assert_rank(canvas_BxC, 2)
    chex.assert_type(canvas_BxC, int)
    b, c = canvas_BxC.shape
    if (canvas_segments_BxE is None) == ("segments" in cache):
      raise ValueError("packed canvases (canvas_segments_BxE) read a cache of packed rows, and "
                       "only they do")
    if canvas_segments_BxE is not None:
      positions_BxC, masks = self._packed_canvas_masks(c, cache, prefix_len_B,
                                                       canvas_segments_BxE)
    else:
      if prefix_len_B is None:
        prefix_len_B = jnp.broadcast_to(cache["end"], (b,))
      chex.assert_shape(prefix_len_B, (b,))
      prefix_len_B = prefix_len_B.astype(jnp.int32)
      positions_BxC = prefix_len_B[:, None] + jnp.arange(c, dtype=jnp.int32)
      num_slots = cache["valid"].shape[1]
      slot_BxS = jnp.broadcast_to(jnp.arange(num_slots, dtype=jnp.int32), (b, num_slots))
      kv_pos = jnp.concatenate([slot_BxS, positions_BxC], axis=1)
      kv_valid = jnp.concatenate(
          [cache["valid"] & (slot_BxS < prefix_len_B[:, None]), jnp.ones((b, c), bool)], axis=1)
      anchor_BxC = jnp.broadcast_to(prefix_len_B[:, None], (b, c))
      limit_BxC = anchor_BxC + c - 1
      masks = layer_mask_specs(cfg, anchor_BxC, limit_BxC, kv_pos, kv_valid)

    x = self.embedder.encode(canvas_BxC)
    if self_cond_embedding_BxCxD is not None:
      chex.assert_shape(self_cond_embedding_BxCxD, (b, c, cfg.hidden_size))
      soft = self_cond_embedding_BxCxD.astype(x.dtype)
    elif self_cond_logits_BxCxV is not None:
      chex.assert_shape(self_cond_logits_BxCxV, (b, c, cfg.vocab_size))
      soft = self.embedder.self_conditioning(self_cond_logits_BxCxV)
    else:
      soft = jnp.zeros_like(x)
    if self_cond_mask_B is not None:
      chex.assert_shape(self_cond_mask_B, (b,))
      soft = soft * self_cond_mask_B.astype(soft.dtype)[:, None, None]
    h = rms_norm(x + self.self_conditioning(soft), None, cfg.rms_norm_eps)

    for i, layer_type in enumerate(cfg.layer_types):
      layer_cache = cache["layers"][i]

      def attend(q, k, v, layer_type=layer_type, layer_cache=layer_cache):
        k_all = jnp.concatenate([layer_cache["k"].astype(q.dtype), k], axis=1)
        v_all = jnp.concatenate([layer_cache["v"].astype(q.dtype), v], axis=1)
        return attention(q, k_all, v_all, masks[layer_type], cfg), None

      h, _ = self._run_layer(i, h, positions_BxC, attend)
    h = self.norms["final_norm"](h)
    logits = self.embedder.decode(h)
    chex.assert_shape(logits, (b, c, cfg.vocab_size))
    return logits

  def _packed_canvas_masks(self, c: int, cache, prefix_len_BxE, segments_BxE):
    """(positions_BxC, layer masks) of E = C / canvas_length packed canvases side by side
    (`transformer.decode`): canvas e's queries and keys are of segment segments_BxE[:, e], at
    positions prefix_len_BxE[:, e] ..; a cached slot is visible before the canvas of its own
    segment only (the slot's segment has one canvas in the row, so that is a per-slot rule)."""
    b, e = segments_BxE.shape
    width = self.cfg.canvas_length
    if c != e * width:
      raise ValueError(f"{e} packed canvases of {width} need {e * width} canvas tokens, got {c}")
    chex.assert_shape(prefix_len_BxE, (b, e))
    anchor_BxC = jnp.repeat(prefix_len_BxE.astype(jnp.int32), width, axis=1)
    positions_BxC = anchor_BxC + jnp.tile(jnp.arange(width, dtype=jnp.int32), e)
    q_segment_BxC = jnp.repeat(segments_BxE.astype(jnp.int32), width, axis=1)
    slot_pos_BxS, slot_segment_BxS = cache["positions"], cache["segments"]
    mine_BxSxE = slot_segment_BxS[:, :, None] == segments_BxE[:, None, :]
    cutoff_BxS = jnp.max(jnp.where(mine_BxSxE, prefix_len_BxE[:, None, :], 0), axis=2)
    kv_pos = jnp.concatenate([slot_pos_BxS, positions_BxC], axis=1)
    kv_valid = jnp.concatenate([cache["valid"] & (slot_pos_BxS < cutoff_BxS),
                                q_segment_BxC > 0], axis=1)
    kv_segment = jnp.concatenate([slot_segment_BxS, q_segment_BxC], axis=1)
    masks = layer_mask_specs(self.cfg, anchor_BxC, anchor_BxC + width - 1, kv_pos, kv_valid,
                             q_segment_BxC, kv_segment)
    return positions_BxC, masks


# ----------------------------------------------------------------------------- the params tree


# Subtrees of the vision tower and its embedder (absent from a text-only model's params).
VISION_SUBTREES = ("vision_tower", "embed_vision")


def to_variables(params: Params) -> dict:
  """`transformer.Params` -> linen variables: params["layers"][i] becomes params["layers_{i}"]
  (and so in the vision tower's subtree)."""
  return {"params": _linen_layers(params)}


def _linen_layers(tree: dict) -> dict:
  out = {k: v for k, v in tree.items() if k != "layers"}
  out.update({f"layers_{i}": layer for i, layer in enumerate(tree.get("layers", ()))})
  if "vision_tower" in out:
    out["vision_tower"] = _linen_layers(out["vision_tower"])
  return out


def from_variables(variables) -> Params:
  """Linen variables (or their "params" collection) -> `transformer.Params` (the inverse; the
  partitioning metadata is dropped)."""
  return _listed_layers(dict(nn.unbox(variables.get("params", variables))))


def _listed_layers(tree: dict) -> dict:
  layer_keys = sorted((k for k in tree if k.startswith("layers_")), key=lambda k: int(k[7:]))
  out = {k: v for k, v in tree.items() if not k.startswith("layers_")}
  out["layers"] = [tree[k] for k in layer_keys]
  if "vision_tower" in out:
    out["vision_tower"] = _listed_layers(dict(out["vision_tower"]))
  return out


def init_variables(cfg: ModelConfig, rng, std: float | None = None, boxed: bool = False):
  """Model(cfg).init with the draw of `transformer.init_params` (same values for the same seed).
  With `boxed`, the leaves keep their `nn.LogicallyPartitioned` metadata."""
  with draw_keys(jax.random.split(rng, num_draws(cfg))):
    variables = Model(cfg, std).init(rng, method=Model.declare)
  return variables if boxed else nn.unbox(variables)


@functools.cache
def logical_axes_table() -> dict[str, tuple[str, ...]]:
  """{weight name: logical axes} from the modules' partitioning metadata ("embedding",
  "attn.q", "experts.gate_up", "self_conditioning.down", the vision tower's "attn.q_proj",
  "patch_embedder.input_proj", "embed_vision.projection", ...: the weight's module and name,
  the last two names of its path); weights without metadata (norms, scales, clip bounds) are
  absent. sharding.py reads this."""
  cfg = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=4, num_layers=2,
                    num_heads=2, num_kv_heads=1, head_dim=2, global_head_dim=2,
                    num_global_kv_heads=1, num_experts=2, top_k_experts=1,
                    moe_intermediate_size=2, layer_types=(SLIDING, FULL),
                    vision=vision.VisionConfig(hidden_size=4, intermediate_size=4,
                                               num_hidden_layers=1, num_attention_heads=1,
                                               num_key_value_heads=1, head_dim=4,
                                               position_embedding_size=2))
  boxed = jax.eval_shape(lambda: init_variables(cfg, jax.random.PRNGKey(0), boxed=True))
  table = {}
  leaves = jax.tree_util.tree_flatten_with_path(
      boxed["params"], is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]
  for path, leaf in leaves:
    if isinstance(leaf, nn.LogicallyPartitioned):
      names = [str(k.key) for k in path][-2:]
      if names[0].startswith("layers_"):  # the embedding: a weight of the model itself
        names = names[1:]
      table[".".join(names)] = tuple(leaf.names)
  return table


sharding.set_param_axes_source(logical_axes_table)
