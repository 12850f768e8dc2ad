"""Gemma 4's vision tower and the multimodal embedder, as flax.linen modules.

`VisionTower` turns an image's patches into soft tokens; `MultimodalEmbedder` maps them into the
text model's embedding space, where the encoder writes them over the prompt's image placeholder
tokens (`scatter_image_features`, transformers' `masked_scatter`). Both live in the text model's
parameter tree, under `vision_tower` and `embed_vision`.

Inputs are what transformers' Gemma 4 image processor returns, one row per image:
  pixel_values [N, P, 3 * patch_size**2] in [0, 1] (P patches, padded to the batch's longest);
  position_ids [N, P, 2] int, each patch's (x, y) column and row, (-1, -1) on padding.

Parameter layout (linear weights are [in, out]; Dv vision hidden, F its MLP width, H / K heads
and kv heads, hd head_dim, D the text hidden):
  vision_tower: patch_embedder: input_proj [3 p^2, Dv], position_embedding_table [2, pos, Dv];
                layers[i]: attn: q_proj [Dv, H, hd], k_proj [Dv, K, hd], v_proj [Dv, K, hd],
                                 o_proj [H, hd, Dv], q_norm [hd], k_norm [hd];
                           mlp: gate_proj [Dv, F], up_proj [Dv, F], down_proj [F, Dv];
                           input_norm, post_attn_norm, pre_ffw_norm, post_ffw_norm [Dv];
                           with use_clipped_linears, beside each linear W its bounds
                           W_clip: input_min, input_max, output_min, output_max [];
                std_bias [Dv], std_scale [Dv] (with standardize);
  embed_vision: projection [Dv, D].
Clip bounds, std_bias and std_scale are buffers in transformers: read here behind
stop_gradient, never trained.
Shape suffixes: N images, P patches, L soft tokens per image (P // pooling_kernel_size**2),
Dv vision hidden, B batch, T tokens, D text hidden.
"""

from __future__ import annotations

from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np

from diffgemma import errors
from diffgemma.model import initializers, layers
from diffgemma.model.config import CLIP_BOUNDS, CLIP_SUFFIX, ModelConfig, VisionConfig

# The linears of a vision layer's attention and MLP, named as transformers names them
# (`q_proj`, ...), not as the text layers' (`q`, ...), so that the default LoRA and
# quantization targets (`attn\.(q|k|v|o)$`, ...) leave the tower alone.
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
LAYER_NORMS = ("input_norm", "post_attn_norm", "pre_ffw_norm", "post_ffw_norm")


class Images(NamedTuple):
  """A prompt batch's images, one row each, in the order their placeholders appear (row-major
  over the token batch): what transformers' Gemma 4 image processor returns as
  `pixel_values` and `image_position_ids`. Rows of all padding (a batch's unused image slots,
  e.g. [B, I, ...] reshaped to [B * I, ...]) add nothing. A pytree: jit and device_put take it
  whole."""
  pixel_values: jnp.ndarray  # [N, P, 3 * patch_size**2] float, pixels in [0, 1]
  position_ids: jnp.ndarray  # [N, P, 2] int, (x, y) per patch, (-1, -1) on padding


def batch_images(pixel_values_BxIxMxD, position_ids_BxIxMx2) -> Images:
  """The `Images` of a batch's image slots (a training batch's `pixel_values` and
  `image_position_ids`, a held-out set's rows): [B, I, ...] flattened to one row per slot,
  row-major, which is the order of the rows' placeholders; unused slots are all padding and
  make no soft token."""
  pixels, positions = pixel_values_BxIxMxD, position_ids_BxIxMx2
  chex.assert_rank([pixels, positions], 4)
  chex.assert_equal_shape_prefix([pixels, positions], 3)
  return Images(pixels.reshape((-1,) + pixels.shape[2:]),
                positions.reshape((-1,) + positions.shape[2:]))


class ImageTokenError(errors.InputError):
  """A prompt's images cannot go in: its placeholders do not match the images' soft tokens, or
  the model has no vision tower. One-line message."""


def check_image_tokens(tokens_BxT, images: Images | None, cfg: ModelConfig) -> None:
  """ImageTokenError (one line) unless the placeholders of concrete (host) tokens number the
  images' soft tokens, and images come only with a vision tower; what `encode` relies on and
  cannot check under jit."""
  placeholders = int(np.sum(np.asarray(tokens_BxT) == cfg.image_token_id))
  if images is None:
    if placeholders and cfg.vision is not None:
      raise ImageTokenError(f"the prompt holds {placeholders} image placeholder tokens "
                            f"(id {cfg.image_token_id}) but no images were given")
    return
  if cfg.vision is None:
    raise ImageTokenError("images given to a model without a vision tower (its config.json "
                          "has no vision_config); use a checkpoint that has one")
  if cfg.image_token_id >= cfg.vocab_size:
    raise ImageTokenError(f"the model's image_token_id {cfg.image_token_id} lies outside its "
                          f"vocabulary of {cfg.vocab_size}: it cannot take images")
  soft = int(soft_token_counts(images.position_ids, cfg.vision.pooling_kernel_size).sum())
  if placeholders != soft:
    raise ImageTokenError(
        f"the prompt holds {placeholders} image placeholder tokens (id {cfg.image_token_id}) "
        f"but its {len(np.asarray(images.position_ids))} images make {soft} soft tokens; "
        "write the prompt with the image processor's placeholders")


# ----------------------------------------------------------------------------- the math


def clipped_linear(x, w, clip, num_in_axes: int = 1):
  """Gemma 4's clippable linear: x clamped to [input_min, input_max], times w, the result
  clamped to [output_min, output_max] (`clip` a dict of the four scalars); clip None is a plain
  `layers.linear`."""
  if clip is None:
    return layers.linear(x, w, num_in_axes)
  bound = {k: jax.lax.stop_gradient(v).astype(x.dtype) for k, v in clip.items()}
  y = layers.linear(jnp.clip(x, bound["input_min"], bound["input_max"]), w, num_in_axes)
  return jnp.clip(y, bound["output_min"], bound["output_max"])


def axial_inv_freq(cfg: VisionConfig) -> jnp.ndarray:
  """Inverse frequencies [head_dim / 4] of the 2-D RoPE, shared by the x and y halves."""
  spatial = cfg.head_dim // 2
  return 1.0 / (cfg.rope_theta ** (jnp.arange(0, spatial, 2, dtype=jnp.float32) / spatial))


def apply_axial_rope(x_NxPxHxd, position_ids_NxPx2, inv_freq):
  """2-D RoPE: the first half of each head rotated by the patch's x, the second half by its y
  (transformers' `apply_multidimensional_rope` with rotate-half inside each half)."""
  half = x_NxPxHxd.shape[-1] // 2
  parts = [layers.apply_rope(x_NxPxHxd[..., i * half:(i + 1) * half],
                             position_ids_NxPx2[..., i], inv_freq) for i in range(2)]
  return jnp.concatenate(parts, axis=-1)


def patch_position_embedding(table_2xSxD, position_ids_NxPx2, padding_NxP):
  """table[0][x] + table[1][y] per patch [N, P, Dv]; zero on padding patches."""
  clamped = jnp.maximum(position_ids_NxPx2, 0)
  emb = table_2xSxD[0][clamped[..., 0]] + table_2xSxD[1][clamped[..., 1]]
  return jnp.where(padding_NxP[..., None], jnp.zeros((), emb.dtype), emb)


def pool_by_position(h_NxPxD, position_ids_NxPx2, kernel: int, length: int):
  """Average over kernel x kernel patches by their positions: (soft tokens [N, L, Dv] float32,
  valid [N, L] bool). Patch (x, y) goes to soft token `soft_token_index`; padding patches
  (hidden zeroed by the caller) add nothing. A soft token is valid when a real patch went to it
  (transformers counts padding patches too, which land on token 0, always real in an image;
  an empty image slot, all padding, so gets no soft token here)."""
  index_NxP = soft_token_index(position_ids_NxPx2, kernel)
  weights_NxPxL = jax.nn.one_hot(index_NxP, length, dtype=jnp.float32) / kernel ** 2
  pooled = jnp.einsum("npl,npd->nld", weights_NxPxL, h_NxPxD.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
  real_NxP = ~jnp.all(position_ids_NxPx2 == -1, axis=-1)
  return pooled, jnp.any((weights_NxPxL != 0) & real_NxP[..., None], axis=1)


def soft_token_index(position_ids_NxPx2, kernel: int, xp=jnp):
  """Each patch's soft token [N, P]: x // k + (width // k) * (y // k), width the image's widest
  x + 1 (padding patches count as (0, 0)); `xp` numpy for the host."""
  clamped = xp.maximum(position_ids_NxPx2, 0)
  width_Nx1 = xp.max(clamped[..., 0], axis=-1, keepdims=True) + 1
  return clamped[..., 0] // kernel + (width_Nx1 // kernel) * (clamped[..., 1] // kernel)


def scatter_image_features(embeds_BxTxD, tokens_BxT, features_NxLxD, valid_NxL,
                           image_token_id: int):
  """The embeddings with image placeholders replaced, as torch's `masked_scatter`: the k-th
  placeholder of the batch (row-major over [B, T]) takes the k-th valid soft token (row-major
  over [N, L]). The counts must agree (the processor writes one placeholder per soft token);
  placeholders beyond the valid soft tokens would take zeros, so callers check the counts
  (`check_image_tokens`) where the inputs are concrete."""
  b, t, d = embeds_BxTxD.shape
  chex.assert_equal_shape_prefix([features_NxLxD, valid_NxL], 2)
  chex.assert_axis_dimension(features_NxLxD, -1, d)
  is_image_BxT = tokens_BxT == image_token_id
  rank_BxT = jnp.cumsum(is_image_BxT.reshape(-1)).reshape(b, t) - 1
  valid_M = valid_NxL.reshape(-1)
  # Valid soft tokens first, in order: source row of the k-th placeholder.
  order_M = jnp.argsort(~valid_M, stable=True)
  features_MxD = jnp.concatenate([features_NxLxD.reshape(-1, d)[order_M],
                                  jnp.zeros((1, d), features_NxLxD.dtype)])
  source_BxT = jnp.where(is_image_BxT & (rank_BxT < jnp.sum(valid_M)), rank_BxT,
                         valid_M.shape[0])
  picked = features_MxD[source_BxT].astype(embeds_BxTxD.dtype)
  return jnp.where(is_image_BxT[..., None], picked, embeds_BxTxD)


def soft_token_counts(position_ids_NxPx2, pooling_kernel_size: int):
  """Soft tokens per image [N], on the host: the pooling cells its patches fill, which is what
  `VisionTower` keeps of its L outputs (as `pool_by_position` assigns them) and what the
  processor writes placeholders for."""
  pos = np.asarray(position_ids_NxPx2)
  index_NxP = soft_token_index(pos, pooling_kernel_size, xp=np)
  real_NxP = ~np.all(pos == -1, axis=-1)
  length = pos.shape[1] // pooling_kernel_size ** 2
  return np.asarray([len(np.unique(index[real & (index < length)]))
                     for index, real in zip(index_NxP, real_NxP)], np.int64)


# ----------------------------------------------------------------------------- modules


def _normal(std: float):
  """normal(0, std) from linen's per-path key (the text model's seed-compatible draw order is
  not extended: the vision tower's weights never shift the text weights of a seed)."""
  def init(key, shape, dtype):
    return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
  return init


def _constant(value: float):
  def init(key, shape, dtype):
    del key
    return jnp.full(shape, value, dtype)
  return init


class ClipBounds(layers.Module):
  """The four scalar bounds of one clippable linear (unbounded at init, as transformers)."""
  param_dtype: str

  def setup(self):
    self.bounds = {name: self.weight(name, _constant(value), (), self.param_dtype)
                   for name, value in CLIP_BOUNDS.items()}

  def __call__(self):
    return self.bounds


class _ClippedLinears(layers.Module):
  """Shared: declares linear weights and, with use_clipped_linears, their `NAME_clip` bounds
  (a `ClipBounds` assigned as attribute NAME_clip)."""

  def linear_weight(self, name: str, shape, axes):
    v = self.cfg.vision
    return self.weight(name, _normal(v.initializer_range), shape, self.cfg.param_dtype, axes)

  def clip_bounds(self):
    return ClipBounds(self.cfg.param_dtype) if self.cfg.vision.use_clipped_linears else None

  def linear(self, x, name: str, num_in_axes: int = 1):
    bounds = getattr(self, name + CLIP_SUFFIX)
    return clipped_linear(x, getattr(self, name), None if bounds is None else bounds(),
                          num_in_axes)

  def declare(self):
    for name in self.LINEARS:
      bounds = getattr(self, name + CLIP_SUFFIX)
      if bounds is not None:
        bounds.declare()


class VisionAttention(_ClippedLinears):
  """Bidirectional attention over an image's patches: q/k RMSNorm with weights, v RMSNorm
  without, 2-D RoPE on q and k, scaling 1.0, padding patches masked as keys."""
  cfg: ModelConfig
  LINEARS = ATTENTION_LINEARS

  def setup(self):
    v, dt = self.cfg.vision, self.cfg.param_dtype
    d, h, kv, hd = v.hidden_size, v.num_attention_heads, v.num_key_value_heads, v.head_dim
    self.q_proj = self.linear_weight("q_proj", (d, h, hd), ("embed", "heads", "head_dim"))
    self.k_proj = self.linear_weight("k_proj", (d, kv, hd), ("embed", "kv_heads", "head_dim"))
    self.v_proj = self.linear_weight("v_proj", (d, kv, hd), ("embed", "kv_heads", "head_dim"))
    self.o_proj = self.linear_weight("o_proj", (h, hd, d), ("heads", "head_dim", "embed"))
    self.q_norm = self.weight("q_norm", initializers.ones_init(), (hd,), dt)
    self.k_norm = self.weight("k_norm", initializers.ones_init(), (hd,), dt)
    self.q_proj_clip, self.k_proj_clip, self.v_proj_clip, self.o_proj_clip = (
        self.clip_bounds() for _ in range(4))

  def __call__(self, x_NxPxD, position_ids_NxPx2, valid_NxP):
    """Attention output [N, P, Dv] for inputs x [N, P, Dv]; valid [N, P] marks real patches."""
    v = self.cfg.vision
    n, p, _ = x_NxPxD.shape
    inv_freq = axial_inv_freq(v)
    q = layers.rms_norm(self.linear(x_NxPxD, "q_proj"), self.q_norm, v.rms_norm_eps)
    k = layers.rms_norm(self.linear(x_NxPxD, "k_proj"), self.k_norm, v.rms_norm_eps)
    values = layers.rms_norm(self.linear(x_NxPxD, "v_proj"), None, v.rms_norm_eps)
    q = apply_axial_rope(q, position_ids_NxPx2, inv_freq)
    k = apply_axial_rope(k, position_ids_NxPx2, inv_freq)
    chex.assert_shape(q, (n, p, v.num_attention_heads, v.head_dim))
    chex.assert_shape([k, values], (n, p, v.num_key_value_heads, v.head_dim))
    mask_NxPxP = jnp.broadcast_to(valid_NxP[:, None, :], (n, p, p))
    return self.linear(layers.attend(q, k, values, mask_NxPxP), "o_proj", num_in_axes=2)


class VisionMLP(_ClippedLinears):
  """Gated GELU-tanh MLP with clippable linears."""
  cfg: ModelConfig
  LINEARS = MLP_LINEARS

  def setup(self):
    v = self.cfg.vision
    d, f = v.hidden_size, v.intermediate_size
    self.gate_proj = self.linear_weight("gate_proj", (d, f), ("embed", "mlp"))
    self.up_proj = self.linear_weight("up_proj", (d, f), ("embed", "mlp"))
    self.down_proj = self.linear_weight("down_proj", (f, d), ("mlp", "embed"))
    self.gate_proj_clip, self.up_proj_clip, self.down_proj_clip = (
        self.clip_bounds() for _ in range(3))

  def __call__(self, x_NxPxD):
    hidden = (layers.gelu_tanh(self.linear(x_NxPxD, "gate_proj"))
              * self.linear(x_NxPxD, "up_proj"))
    return self.linear(hidden, "down_proj")


class VisionLayer(layers.Module):
  """Pre/post-normed attention, then a pre/post-normed MLP, each added to the residual."""
  cfg: ModelConfig

  def setup(self):
    v = self.cfg.vision
    self.attn = VisionAttention(self.cfg)
    self.mlp = VisionMLP(self.cfg)
    self.norms = {name: layers.RMSNorm(name, v.hidden_size, v.rms_norm_eps,
                                       self.cfg.param_dtype) for name in LAYER_NORMS}
    layers.share_scopes(self, self.norms)

  def declare(self):
    for sub in (self.attn, self.mlp, *self.norms.values()):
      sub.declare()

  def __call__(self, h_NxPxD, position_ids_NxPx2, valid_NxP):
    norm = self.norms
    attn = self.attn(norm["input_norm"](h_NxPxD), position_ids_NxPx2, valid_NxP)
    h = h_NxPxD + norm["post_attn_norm"](attn)
    return h + norm["post_ffw_norm"](self.mlp(norm["pre_ffw_norm"](h)))


class PatchEmbedder(layers.Module):
  """Patches to hidden states: pixels rescaled to [-1, 1], a linear map, plus the learned x and
  y position embeddings."""
  cfg: ModelConfig

  def setup(self):
    v, dt = self.cfg.vision, self.cfg.param_dtype
    self.input_proj = self.weight("input_proj", _normal(v.initializer_range),
                                  (v.patch_dim, v.hidden_size), dt, (None, "embed"))
    # normal(initializer_range), where transformers starts the table at ones: a pretrained
    # tower overwrites it, but a tower trained from scratch would start every patch from the
    # same large vector (the pooled soft tokens of any two pictures at cosine 0.998) and, over
    # a 30-minute CPU run, barely learn to see past it.
    self.position_embedding_table = self.weight(
        "position_embedding_table", _normal(v.initializer_range),
        (2, v.position_embedding_size, v.hidden_size), dt, (None, None, "embed"))

  def __call__(self, pixel_values_NxPxC, position_ids_NxPx2, padding_NxP):
    pixels = (2 * (pixel_values_NxPxC - 0.5)).astype(self.cfg.compute_dtype)
    h = layers.linear(pixels, self.input_proj)
    return h + patch_position_embedding(self.position_embedding_table, position_ids_NxPx2,
                                        padding_NxP).astype(h.dtype)


class VisionTower(layers.Module):
  """Gemma 4's vision encoder (transformers' `Gemma4VisionModel`): patches -> soft tokens."""
  cfg: ModelConfig

  def setup(self):
    v, dt = self.cfg.vision, self.cfg.param_dtype
    self.patch_embedder = PatchEmbedder(self.cfg)
    self.layers = [VisionLayer(self.cfg) for _ in range(v.num_hidden_layers)]
    if v.standardize:
      self.std_bias = self.weight("std_bias", _constant(0.0), (v.hidden_size,), dt)
      self.std_scale = self.weight("std_scale", _constant(1.0), (v.hidden_size,), dt)

  def declare(self):
    self.patch_embedder.declare()
    for layer in self.layers:
      layer.declare()

  def __call__(self, pixel_values_NxPxC, position_ids_NxPx2):
    """(soft tokens [N, L, Dv] in the compute dtype, valid [N, L] bool), L = P // k**2.

    An image of fewer patches than P fills fewer soft tokens: its others are invalid (zero)
    and transformers drops them; `scatter_image_features` skips them."""
    v = self.cfg.vision
    chex.assert_rank(pixel_values_NxPxC, 3)
    n, p, _ = pixel_values_NxPxC.shape
    chex.assert_axis_dimension(pixel_values_NxPxC, 2, v.patch_dim)
    chex.assert_shape(position_ids_NxPx2, (n, p, 2))
    chex.assert_type(position_ids_NxPx2, int)
    kernel = v.pooling_kernel_size
    length = p // kernel ** 2
    if length * kernel ** 2 != p:
      raise ValueError(f"an image batch of {p} patches does not pool into soft tokens of "
                       f"{kernel}x{kernel} patches ({p} is not a multiple of {kernel ** 2})")
    padding_NxP = jnp.all(position_ids_NxPx2 == -1, axis=-1)
    h = self.patch_embedder(pixel_values_NxPxC, position_ids_NxPx2, padding_NxP)
    for layer in self.layers:
      h = layer(h, position_ids_NxPx2, ~padding_NxP)
    h = jnp.where(padding_NxP[..., None], jnp.zeros((), h.dtype), h)
    pooled, valid_NxL = pool_by_position(h, position_ids_NxPx2, kernel, length)
    # Scaled and standardized in float32 (sqrt(Dv) scaling can leave the float16 range).
    pooled = pooled * jnp.float32(v.hidden_size ** 0.5)
    if v.standardize:
      bias, scale = (jax.lax.stop_gradient(w).astype(jnp.float32)
                     for w in (self.std_bias, self.std_scale))
      pooled = (pooled - bias) * scale
    chex.assert_shape(pooled, (n, length, v.hidden_size))
    return pooled.astype(self.cfg.compute_dtype), valid_NxL


class MultimodalEmbedder(layers.Module):
  """Soft tokens into the text embedding space: RMSNorm without scale, then a linear map."""
  cfg: ModelConfig

  def setup(self):
    v = self.cfg.vision
    self.projection = self.weight("projection", _normal(v.initializer_range),
                                  (v.hidden_size, self.cfg.hidden_size), self.cfg.param_dtype,
                                  (None, "embed"))

  def __call__(self, soft_NxLxDv):
    chex.assert_axis_dimension(soft_NxLxDv, -1, self.cfg.vision.hidden_size)
    normed = layers.rms_norm(soft_NxLxDv, None, self.cfg.vision.rms_norm_eps)
    return layers.linear(normed, self.projection)
