"""The vision tower and the multimodal embedder against transformers' (float32, max abs < 1e-4)."""

import jax
import jax.numpy as jnp
import numpy as np
import torch

from diffgemma.io import hf_weights
from diffgemma.model import vision
from tests import reference

TOL = 1e-4
# (width, height) in patches: a full 4x4 image and a 2x6 one padded to 16 patches.
GRIDS = [(4, 4), (2, 6)]
MAX_PATCHES = 16


def _linen(tree):
  """A params subtree whose "layers" lists become linen's layers_{i} submodules."""
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      if key == "layers" and isinstance(value, list):
        out.update({f"layers_{i}": _linen(layer) for i, layer in enumerate(value)})
      else:
        out[key] = _linen(value)
    return out
  return tree


def _tiny():
  ref = reference.tiny_reference(seed=11, vision=reference.TINY_VISION)
  cfg = hf_weights.config_from_hf(ref.config.to_dict())
  return ref, cfg


def _our_vision_params(ref, cfg):
  """The vision subtrees of our params, mapped from the reference's state dict."""
  state = reference.state_dict_numpy(ref)
  tree = {"vision_tower": {"layers": [{} for _ in range(cfg.vision.num_hidden_layers)]}}
  for path, name, layout, group in hf_weights.tensor_table(cfg):
    if group != hf_weights.VISION:
      continue
    w = state[hf_weights.VISION_PREFIX[hf_weights.DIFFUSION_GEMMA] + name]
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {}) if isinstance(node, dict) else node[key]
    node[path[-1]] = jnp.asarray(layout.to_ours(w, _our_shape(layout, w)))
  return tree


def _our_shape(layout, w):
  return None if layout is not hf_weights.HEADS_IN and layout is not hf_weights.HEADS_OUT else (
      (w.shape[1], -1, 12) if layout is hf_weights.HEADS_IN else (-1, 12, w.shape[0]))


def test_config_maps_both_ways():
  ref, cfg = _tiny()
  assert cfg.vision == hf_weights.vision_config_from_hf(
      hf_weights.vision_config_to_hf(cfg.vision))
  assert cfg.vision.use_clipped_linears and cfg.vision.standardize
  assert (cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id) == (60, 61, 62)
  assert hf_weights.config_from_hf(hf_weights.config_to_hf(cfg, "float32")) == cfg


def test_tower_and_embedder_match_reference():
  ref, cfg = _tiny()
  params = _our_vision_params(ref, cfg)
  pixels, positions = reference.image_patches(np.random.default_rng(0), GRIDS, MAX_PATCHES,
                                              cfg.vision.patch_dim)
  with torch.no_grad():
    theirs = ref.model.encoder.get_image_features(
        torch.as_tensor(pixels), torch.as_tensor(positions)).pooler_output.numpy()

  @jax.jit
  def ours(params, pixels, positions):
    soft, valid = vision.VisionTower(cfg).apply({"params": _linen(params["vision_tower"])},
                                                pixels, positions)
    return vision.MultimodalEmbedder(cfg).apply({"params": params["embed_vision"]}, soft), valid

  features, valid = ours(params, jnp.asarray(pixels), jnp.asarray(positions))
  features, valid = np.asarray(features), np.asarray(valid)
  # transformers drops the padding image's empty soft tokens: 4 + 3 of 2 x 4.
  expected_counts = vision.soft_token_counts(positions, cfg.vision.pooling_kernel_size)
  np.testing.assert_array_equal(valid.sum(1), expected_counts)
  np.testing.assert_array_equal(expected_counts, [4, 3])
  assert theirs.shape == (7, cfg.hidden_size)
  np.testing.assert_array_less(np.abs(features[valid] - theirs).max(), TOL)
