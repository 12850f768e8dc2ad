"""Test helpers around the transformers reference (DiffusionGemmaForBlockDiffusion)."""

from __future__ import annotations

import numpy as np
import torch
from transformers import (DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, Gemma4Config,
                          Gemma4ForConditionalGeneration)
from transformers.cache_utils import DynamicCache

SOFTCAP = 30.0


TINY_TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=7,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
                 num_global_key_value_heads=1, sliding_window=8, num_experts=4, top_k_experts=2,
                 moe_intermediate_size=24, max_position_embeddings=512)


# A tiny vision tower with every feature: GQA, clippable linears, standardized soft tokens.
# Patches of 2x2 pixels (rows of 12 values), pooled 2x2 into soft tokens.
TINY_VISION = dict(hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=12, patch_size=2,
                   pooling_kernel_size=2, position_embedding_size=16, use_clipped_linears=True,
                   standardize=True)
# Token ids of the tiny vision model (inside TINY_TEXT's vocabulary of 64).
TINY_IMAGE_TOKENS = dict(image_token_id=60, boi_token_id=61, eoi_token_id=62)


# transformers' DiffusionGemma always has a vision tower (vision_config=None builds the default
# 768-wide, 16-layer one): text-only tests get this smallest one, which takes no image (its
# image token ids stay transformers' defaults, outside TINY_TEXT's vocabulary).
MINIMAL_VISION = dict(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=8, patch_size=2,
                      position_embedding_size=4)


def tiny_reference(seed: int, canvas_length: int = 8, vision: dict | None = None,
                   **text_overrides):
  """A random tiny reference model in float32 with every weight perturbed away from its init
  (norm weights, router scales and layer scalars included), so parity checks see them all.
  `vision`: a vision_config dict (e.g. TINY_VISION) for a model that reads images, whose
  buffers (clip bounds, standardization) are perturbed too; None: MINIMAL_VISION."""
  torch.manual_seed(seed)
  extra = {} if vision is None else TINY_IMAGE_TOKENS
  config = DiffusionGemmaConfig(text_config={**TINY_TEXT, **text_overrides},
                                vision_config=vision or MINIMAL_VISION,
                                canvas_length=canvas_length, **extra)
  config._attn_implementation = "eager"
  model = DiffusionGemmaForBlockDiffusion(config).eval().float()
  return _perturb(model, seed)


def tiny_gemma4_reference(seed: int, vision: dict | None = None, **text_overrides):
  """A random tiny Gemma 4 AR model (multimodal layout; text only, or with a `vision` tower)
  with DiffusionGemma's backbone features: MoE block, k_eq_v on full layers, no per-layer
  inputs, soft-capped logits."""
  torch.manual_seed(seed)
  text = {**TINY_TEXT, "enable_moe_block": True, "attention_k_eq_v": True,
          "hidden_size_per_layer_input": 0, "final_logit_softcapping": SOFTCAP, **text_overrides}
  extra = {} if vision is None else TINY_IMAGE_TOKENS
  config = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, **extra)
  config._attn_implementation = "eager"
  model = Gemma4ForConditionalGeneration(config).eval().float()
  return _perturb(model, seed)


def _perturb(model, seed: int):
  gen = torch.Generator().manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith(("norm.weight", ".scale", "per_expert_scale")):
        p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
      else:
        p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    # layer_scalar is a buffer, not tied by transformers: encoder and decoder copies are set
    # equal, as in a real checkpoint where both come from the same trained value.
    buffers = dict(model.named_buffers())
    for name, b in buffers.items():
      # The vision tower's buffers: clip bounds that cut some activations (inputs at about
      # +-1.5 of unit-scale values, outputs at +-3), and a standardization away from identity.
      if name.endswith(("input_min", "input_max", "output_min", "output_max")):
        bound = 1.5 if ".input_" in name else 3.0
        sign = -1.0 if name.endswith("_min") else 1.0
        b.fill_(sign * bound * (1.0 + 0.2 * torch.rand((), generator=gen).item()))
      elif name.endswith("std_bias"):
        b.copy_(0.3 * torch.randn(b.shape, generator=gen))
      elif name.endswith("std_scale"):
        b.copy_(1.0 + 0.3 * torch.randn(b.shape, generator=gen))
      if name.endswith("layer_scalar") and not name.startswith("model.decoder."):
        b.copy_(0.5 + torch.rand(b.shape, generator=gen))
        decoder_copy = "model.decoder.layers." + name.split("layers.")[1]
        if decoder_copy in buffers:
          buffers[decoder_copy].copy_(b)
  return model


def image_patches(rng, grids, max_patches: int, patch_dim: int):
  """Random images in the image processor's format: pixel_values [N, max_patches, patch_dim] in
  [0, 1] and image_position_ids [N, max_patches, 2] int64 ((x, y) of each patch, row by row;
  padding: zero pixels at (-1, -1)). `grids`: (width, height) in patches of each image."""
  pixels = np.zeros((len(grids), max_patches, patch_dim), np.float32)
  positions = np.full((len(grids), max_patches, 2), -1, np.int64)
  for i, (width, height) in enumerate(grids):
    n = width * height
    pixels[i, :n] = rng.uniform(0.0, 1.0, (n, patch_dim))
    ys, xs = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    positions[i, :n] = np.stack([xs.ravel(), ys.ravel()], axis=-1)
  return pixels, positions


def state_dict_numpy(model) -> dict[str, np.ndarray]:
  return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def softcap(logits):
  return SOFTCAP * torch.tanh(logits.float() / SOFTCAP)


class ReferenceSession:
  """Drives the reference encoder/decoder the way its `generate` does (DynamicCache)."""

  def __init__(self, model, attention_mask_BxP):
    self.model = model
    self.cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    self.mask = torch.as_tensor(attention_mask_BxP, dtype=torch.bool)
    self.length = 0

  @torch.no_grad()
  def encode(self, tokens_BxT, pixel_values=None, image_position_ids=None):
    """Encoder logits of new tokens; with images (the processor's arrays), their placeholders
    are filled, and under use_bidirectional_attention="vision" the masks are the ones
    `generate` prepares from the placeholders' mm_token_type_ids (the encoder's forward alone
    drops that mask and stays causal)."""
    tokens = torch.as_tensor(np.asarray(tokens_BxT), dtype=torch.long)
    t = tokens.shape[1]
    if self.length > 0:
      self.mask = torch.cat([self.mask, torch.ones(tokens.shape[0], t, dtype=torch.bool)], 1)
    positions = torch.arange(self.length, self.length + t)[None]
    mask = self.mask
    kwargs = {}
    if pixel_values is not None:
      kwargs = dict(pixel_values=torch.as_tensor(np.asarray(pixel_values)),
                    image_position_ids=torch.as_tensor(np.asarray(image_position_ids)))
      mask = self.model.model.encoder.create_masks_for_generate(
          config=self.model.config, inputs_embeds=torch.empty(tokens.shape[0], t, 0),
          attention_mask=self.mask, cache=self.cache, position_ids=positions,
          mm_token_type_ids=(tokens == self.model.config.image_token_id).long())
    out = self.model.model.encoder(input_ids=tokens, attention_mask=mask, cache=self.cache,
                                   position_ids=positions, **kwargs)
    self.length += t
    return softcap(self.model.lm_head(out.last_hidden_state)).numpy()

  @torch.no_grad()
  def decode(self, canvas_BxC, self_cond_logits=None, self_cond_mask=None):
    canvas = torch.as_tensor(np.asarray(canvas_BxC), dtype=torch.long)
    c = canvas.shape[1]
    dec_mask = torch.nn.functional.pad(self.mask, (0, c), value=True)
    positions = torch.arange(self.length, self.length + c)[None]
    kwargs = {}
    if self_cond_logits is not None:
      kwargs["self_conditioning_logits"] = torch.as_tensor(np.asarray(self_cond_logits))
    if self_cond_mask is not None:
      kwargs["self_conditioning_mask"] = torch.as_tensor(np.asarray(self_cond_mask))
    out = self.model(cache=self.cache, decoder_input_ids=canvas, decoder_attention_mask=dec_mask,
                     decoder_position_ids=positions, **kwargs)
    return out.logits.numpy()


def max_logit_diff(ref_model, cfg, params, seed=0):
  """Max |ours - reference| over encoder logits of a padded prompt and decoder logits of one
  canvas with self-conditioning on half of the rows (ours: transformer.encode / decode of `cfg` on
  `params`, jitted: one compile per config instead of op-by-op dispatch)."""
  import jax
  import jax.numpy as jnp

  from diffgemma.model import transformer

  rng = np.random.default_rng(seed)
  batch, prompt_len, canvas_len = 2, 11, cfg.canvas_length
  prompt = rng.integers(3, cfg.vocab_size, (batch, prompt_len))
  valid = np.arange(prompt_len)[None, :] >= np.array([[0], [3]])
  prompt = np.where(valid, prompt, cfg.pad_token_id)
  canvas = rng.integers(0, cfg.vocab_size, (batch, canvas_len))
  sc = rng.normal(0.0, 3.0, (batch, canvas_len, cfg.vocab_size)).astype(np.float32)
  sc_mask = np.array([True, False])

  @jax.jit
  def ours(params, prompt, valid, canvas, sc, sc_mask):
    cache = transformer.init_cache(cfg, batch, prompt_len + canvas_len)
    hidden, cache = transformer.encode(params, cfg, prompt, cache, valid)
    return (transformer.lm_head(params, hidden, cfg),
            transformer.decode(params, cfg, canvas, cache, None, sc, sc_mask))

  enc, dec = ours(params, *map(jnp.asarray, (prompt, valid, canvas, sc, sc_mask)))
  session = ReferenceSession(ref_model, valid)
  enc = np.abs(np.asarray(enc) - session.encode(prompt))[valid]
  dec = np.abs(np.asarray(dec) - session.decode(canvas, sc, sc_mask))
  return max(enc.max(), dec.max())
