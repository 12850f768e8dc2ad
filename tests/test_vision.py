"""The vision tower, the multimodal embedder and image prompts against transformers'
DiffusionGemmaForBlockDiffusion with a vision tower (float32, max abs < 1e-4)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from diffgemma.io import hf_weights, model_dirs, safetensors_dir
from diffgemma.model import attention_mask, layers, transformer, vision
from diffgemma.model.config import SLIDING
from diffgemma.sampling import sampler
from tests import reference

TOL = 1e-4
# (width, height) in patches: a full 4x4 image (4 soft tokens) and a 2x6 one padded to 16
# patches (3 soft tokens).
GRIDS = [(4, 4), (2, 6)]
MAX_PATCHES = 16
# A sliding window shorter than an image's run of placeholders: inside the run, attention
# reaches past the window when it is bidirectional.
WINDOW = 3


def _model(bidirectional: bool = False, seed: int = 11):
  """(reference, our config, our params) of a tiny model with a vision tower."""
  overrides = dict(num_hidden_layers=3, sliding_window=WINDOW)
  if bidirectional:
    overrides["use_bidirectional_attention"] = "vision"
  ref = reference.tiny_reference(seed=seed, vision=reference.TINY_VISION, **overrides)
  cfg = hf_weights.config_from_hf(ref.config.to_dict())
  params = jax.tree_util.tree_map(jnp.asarray, hf_weights.params_from_hf(
      reference.state_dict_numpy(ref), cfg))
  return ref, cfg, params


def _images(cfg, grids, seed=0):
  pixels, positions = reference.image_patches(np.random.default_rng(seed), grids, MAX_PATCHES,
                                              cfg.vision.patch_dim)
  return vision.Images(pixels, positions)


def _prompt(cfg, rows, length, rng):
  """Tokens [B, length] and valid [B, length]: each row is a list of segments, an int (that
  many random text tokens) or ("image", n) (boi, n placeholders, eoi); rows are left-padded."""
  tokens = np.full((len(rows), length), cfg.pad_token_id, np.int64)
  valid = np.zeros((len(rows), length), bool)
  for r, segments in enumerate(rows):
    row = []
    for seg in segments:
      if isinstance(seg, int):
        row += list(rng.integers(3, cfg.image_token_id - 1, seg))
      else:
        row += [cfg.boi_token_id] + [cfg.image_token_id] * seg[1] + [cfg.eoi_token_id]
    tokens[r, length - len(row):] = row
    valid[r, length - len(row):] = True
  return tokens, valid


def test_config_maps_both_ways():
  ref, cfg, _ = _model()
  assert cfg.vision == hf_weights.vision_config_from_hf(
      hf_weights.vision_config_to_hf(cfg.vision))
  assert cfg.vision.use_clipped_linears and cfg.vision.standardize
  assert (cfg.image_token_id, cfg.boi_token_id, cfg.eoi_token_id) == (60, 61, 62)
  assert hf_weights.config_from_hf(hf_weights.config_to_hf(cfg, "float32")) == cfg


def test_tower_and_embedder_match_reference():
  ref, cfg, params = _model()
  images = _images(cfg, GRIDS)
  with torch.no_grad():
    theirs = ref.model.encoder.get_image_features(
        torch.as_tensor(images.pixel_values),
        torch.as_tensor(images.position_ids)).pooler_output.numpy()

  @jax.jit
  def ours(params, images):
    variables = transformer.to_variables(params)["params"]
    soft, valid = vision.VisionTower(cfg).apply({"params": variables["vision_tower"]},
                                                *images)
    return vision.MultimodalEmbedder(cfg).apply({"params": variables["embed_vision"]},
                                                soft), valid

  features, valid = map(np.asarray, ours(params, images))
  # transformers drops the padded image's empty soft tokens: 4 + 3 of 2 x 4.
  counts = vision.soft_token_counts(images.position_ids, cfg.vision.pooling_kernel_size)
  np.testing.assert_array_equal(counts, [4, 3])
  np.testing.assert_array_equal(valid.sum(1), counts)
  assert theirs.shape == (7, cfg.hidden_size)
  np.testing.assert_array_less(np.abs(features[valid] - theirs).max(), TOL)
  # An empty image slot (all padding, as a batch's unused slots) makes no soft token.
  empty = vision.Images(np.zeros_like(images.pixel_values[:1]),
                        np.full_like(images.position_ids[:1], -1))
  _, valid = ours(params, empty)
  assert not np.asarray(valid).any()
  assert vision.soft_token_counts(empty.position_ids, cfg.vision.pooling_kernel_size) == [0]


def test_image_blocks_are_runs_of_placeholders():
  is_image = np.array([[0, 1, 1, 0, 0, 1, 0], [1, 1, 1, 1, 0, 0, 1]], bool)
  np.testing.assert_array_equal(attention_mask.image_blocks(jnp.asarray(is_image)),
                                [[-1, 0, 0, -1, -1, 1, -1], [0, 0, 0, 0, -1, -1, 1]])


# (name, rows of prompt segments, image grids in placeholder order): one image; then two
# images in one row and a third in a left-padded second row (soft tokens fill placeholders
# row-major across the batch).
PROMPTS = [
    ("one_image", [[2, ("image", 4), 3]], GRIDS[:1]),
    ("images_in_two_rows", [[1, ("image", 4), 2, ("image", 3), 2], [2, ("image", 3), 1]],
     GRIDS + GRIDS[1:]),
]
PROMPT_LEN = 17


@pytest.mark.parametrize("bidirectional", [False, True], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("name,rows,grids", PROMPTS, ids=[p[0] for p in PROMPTS])
def test_image_prompt_logits_match_reference(name, rows, grids, bidirectional):
  """Encoder logits of an image + text prompt, then decoder logits of a canvas after it (the
  decoder reads the images through the cache)."""
  ref, cfg, params = _model(bidirectional, seed=len(name))
  rng = np.random.default_rng(1)
  tokens, valid = _prompt(cfg, rows, PROMPT_LEN, rng)
  # The images' order is the placeholders' (row-major); their soft tokens fill the runs.
  images = _images(cfg, grids)
  vision.check_image_tokens(tokens, images, cfg)
  canvas = rng.integers(0, cfg.vocab_size, (len(rows), cfg.canvas_length))

  @jax.jit
  def ours(params, tokens, valid, images, canvas):
    cache = transformer.init_cache(cfg, tokens.shape[0], tokens.shape[1] + cfg.canvas_length)
    hidden, filled = transformer.encode(params, cfg, tokens, cache, valid, images)
    # Without the images, the placeholders stay token embeddings.
    plain, _ = transformer.encode(params, cfg, tokens, cache, valid)
    return (transformer.lm_head(params, hidden, cfg),
            transformer.decode(params, cfg, canvas, filled),
            transformer.lm_head(params, plain, cfg))

  # Ours in a batch's layout: a slot per row and image, unused slots all padding (row 1 has one
  # image of two slots); transformers gets the images alone.
  slots = vision.Images(*(np.concatenate([x, np.full_like(x[:1], fill)])
                          for x, fill in zip(images, (0, -1))))
  enc, dec, plain = map(np.asarray, ours(params, tokens, valid, slots, canvas))
  session = reference.ReferenceSession(ref, valid)
  theirs_enc = session.encode(tokens, images.pixel_values, images.position_ids)
  theirs_dec = session.decode(canvas)
  np.testing.assert_array_less(np.abs(enc - theirs_enc)[valid].max(), TOL)
  np.testing.assert_array_less(np.abs(dec - theirs_dec).max(), TOL)
  assert np.abs(plain - enc)[valid].max() > 1e-2  # the images matter


def test_bidirectional_attention_reaches_inside_each_image_only():
  """With "vision", an image's first placeholder sees its last (past the window of 3), never
  the next image's; text stays causal."""
  _, cfg, _ = _model(bidirectional=True)
  tokens, valid = _prompt(cfg, [[1, ("image", 4), ("image", 3), 1]], PROMPT_LEN,
                          np.random.default_rng(0))
  blocks = attention_mask.image_blocks(jnp.asarray((tokens == cfg.image_token_id) & valid))
  pos = jnp.arange(PROMPT_LEN)[None]
  mask = np.asarray(attention_mask.attention_mask(pos, pos, pos, jnp.asarray(valid), WINDOW,
                                                  q_block_BxT=blocks, kv_block_BxS=blocks))[0]
  first = int(np.argmax(tokens[0] == cfg.image_token_id))
  assert mask[first, first + 3] and not mask[first, first + 4 + 2]
  assert not mask[first - 1, first] and not mask[first, first + 4]
  # The Pallas kernel knows no blocks: such a pass gets the materialised mask (XLA attention).
  pallas = cfg.replace(attention_impl="pallas")
  args = (pos, pos, pos, jnp.asarray(valid))
  assert all(m is None for _, m in layers.layer_mask_specs(pallas, *args).values())
  specs = layers.layer_mask_specs(pallas, *args, q_block_BxT=blocks, kv_block_BxS=blocks)
  np.testing.assert_array_equal(specs[SLIDING][1][0], mask)


@pytest.mark.parametrize("window", [None, 2], ids=["full", "sliding"])
def test_segments_cut_image_blocks_too(window):
  """Segment ids and image blocks in the one mask: key j is visible to query t iff of t's
  segment and (by the causal/window rule or in t's image block), as defined one pair at a time."""
  segment = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 0]])
  position = np.array([[0, 1, 2, 3, 0, 1, 2, 3, 0]])
  # Both examples' images have block id 0 (as per-example ids would): segments still part them.
  block = np.array([[-1, 0, 0, -1, 0, 0, 0, -1, -1]])
  valid = segment > 0
  as_j = lambda x: jnp.asarray(x, jnp.int32)
  mask = np.asarray(attention_mask.attention_mask(
      as_j(position), as_j(position), as_j(position), jnp.asarray(valid), window,
      as_j(segment), as_j(segment), as_j(block), as_j(block)))[0]
  r = segment.shape[1]
  expected = np.zeros((r, r), bool)
  for t in range(r):
    for j in range(r):
      causal = position[0, j] <= position[0, t] and (
          window is None or position[0, j] > position[0, t] - window)
      same_block = block[0, t] >= 0 and block[0, j] == block[0, t]
      expected[t, j] = (valid[0, j] and segment[0, j] == segment[0, t]
                        and (causal or same_block))
  np.testing.assert_array_equal(mask, expected)
  assert mask[1, 2] and mask[4, 6] and not mask[4, 1]  # inside each image; never across examples


# ----------------------------------------------------------------------------- weights

SHARD = "20KB"  # small shards, so the tiny checkpoints exercise the sharded index


def _assert_same_tensors(first_dir, second_dir, names=None):
  """Every tensor (or those of `names`) of two checkpoint directories: same names, dtypes,
  shapes and bytes."""
  first, second = safetensors_dir.SafetensorsDir(first_dir), safetensors_dir.SafetensorsDir(
      second_dir)
  if names is None:
    assert sorted(first) == sorted(second)
    names = list(first)
  for name in names:
    a, b = np.asarray(first[name]), np.asarray(second[name])
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vision_checkpoint_round_trips_bit_exact(tmp_path, dtype):
  """transformers' directory -> our params -> orbax -> transformers' directory: every tensor,
  the vision tower's buffers included, bit for bit; the config.json's vision_config loads."""
  ref = reference.tiny_reference(seed=5, vision=reference.TINY_VISION)
  source = str(tmp_path / "hf")
  ref.to(getattr(torch, dtype)).save_pretrained(source, max_shard_size=SHARD)
  cfg, params = model_dirs.load_model(source, log=lambda _: None)
  assert cfg.vision == hf_weights.config_from_hf(ref.config.to_dict()).vision
  model_dirs.save_orbax(cfg, params, str(tmp_path / "orbax"))
  cfg2, params2 = model_dirs.load_model(str(tmp_path / "orbax"))
  assert cfg2 == cfg
  back = str(tmp_path / "back")
  model_dirs.save_hf(cfg2, params2, back, max_shard_bytes=30_000)
  _assert_same_tensors(source, back)
  theirs = DiffusionGemmaForBlockDiffusion.from_pretrained(back, dtype=getattr(torch, dtype))
  bookkeeping = {"transformers_version": None, "dtype": None}
  assert theirs.config.vision_config.to_dict() | bookkeeping == (
      ref.config.vision_config.to_dict() | bookkeeping)
  assert theirs.config.image_token_id == ref.config.image_token_id


def test_gemma4_checkpoint_brings_its_vision_tower(tmp_path):
  """A Gemma 4 AR checkpoint's tower (under model.vision_tower) imports too: its soft tokens
  are transformers' Gemma 4's."""
  ref = reference.tiny_gemma4_reference(seed=6, vision=reference.TINY_VISION)
  path = str(tmp_path / "gemma4")
  ref.save_pretrained(path)
  cfg, params = model_dirs.load_model(path, canvas_length=8, log=lambda _: None)
  assert cfg.vision == hf_weights.vision_config_from_hf(reference.TINY_VISION)
  images = _images(cfg, GRIDS)
  with torch.no_grad():
    theirs = torch.cat(ref.model.get_image_features(
        torch.as_tensor(images.pixel_values),
        torch.as_tensor(images.position_ids)).pooler_output).numpy()
  variables = transformer.to_variables(params)["params"]
  soft, valid = vision.VisionTower(cfg).apply({"params": variables["vision_tower"]}, *images)
  ours = vision.MultimodalEmbedder(cfg).apply({"params": variables["embed_vision"]}, soft)
  np.testing.assert_array_less(np.abs(np.asarray(ours)[np.asarray(valid)] - theirs).max(), TOL)


def _vision_sudoku_checkpoint(path: str, config) -> str:
  """A float32 transformers checkpoint of the tiny Sudoku model with a vision tower (random,
  clip bounds and standardization away from their init), for runs to start from."""
  from diffgemma.training import run_config

  vision_cfg = hf_weights.vision_config_from_hf(reference.TINY_VISION)
  cfg = run_config.build(config).model.replace(vision=vision_cfg, param_dtype="float32")
  params = transformer.init_params(cfg, jax.random.PRNGKey(4))
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.5 * jax.random.normal(jax.random.PRNGKey(len(p)), x.shape, x.dtype),
      params)
  model_dirs.save_hf(cfg, params, path)
  return path


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_text_only_runs_export_the_vision_tower_unchanged(tmp_path, use_lora):
  """A run on text from a checkpoint with a vision tower (full fine-tuning: the tower frozen;
  LoRA: adapters on the language model only, merged at export) exports a transformers
  checkpoint whose vision tensors are the source's, bit for bit, and whose text weights moved."""
  from diffgemma.training import loop, training_state
  from tests.helpers import tiny_sudoku_config

  config = tiny_sudoku_config(workdir_steps=2)
  config.optimizer.weight_decay = 0.1  # would shrink an unfrozen tower even with no gradient
  if use_lora:
    config.lora.update(enabled=True, base_dtype="float32")
  source = _vision_sudoku_checkpoint(str(tmp_path / "source"), config)
  training_state.adopt_checkpoint_architecture(config, source)
  assert config.model.vision.hidden_size == reference.TINY_VISION["hidden_size"]
  workdir = str(tmp_path / "run")
  loop.train(config, workdir, init_from=source)
  cfg, params = model_dirs.load_model(workdir)
  exported = str(tmp_path / "export")
  model_dirs.save_hf(cfg, params, exported)
  vision_names = [n for n in safetensors_dir.SafetensorsDir(source)
                  if n.startswith(hf_weights.VISION_PREFIX[hf_weights.DIFFUSION_GEMMA] + "v")
                  or ".embed_vision." in n]
  assert len(vision_names) > 30
  _assert_same_tensors(source, exported, vision_names)
  moved = "model.decoder.layers.0.mlp.gate_proj.weight"
  assert not np.array_equal(np.asarray(safetensors_dir.SafetensorsDir(source)[moved]),
                            np.asarray(safetensors_dir.SafetensorsDir(exported)[moved]))


# ----------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def image_prompt():
  """(cfg, params, tokens, valid, images) of the tiny vision model: two rows, three images."""
  _, cfg, params = _model(seed=3)
  rows, grids = PROMPTS[1][1], PROMPTS[1][2]
  tokens, valid = _prompt(cfg, rows, PROMPT_LEN, np.random.default_rng(2))
  return cfg, params, tokens.astype(np.int32), valid, _images(cfg, grids)


def test_generate_with_images_is_encode_then_denoise(image_prompt):
  """Diffusion: generate's first canvas is a manual encode of the image prompt, then
  `denoise_canvas` and `finalize_canvas` on that cache."""
  cfg, params, tokens, valid, images = image_prompt
  scfg = sampler.SamplerConfig(max_denoising_steps=3, max_new_tokens=cfg.canvas_length)
  rng = jax.random.PRNGKey(5)
  out = sampler.make_generate_fn(cfg, scfg)(params, tokens, valid, rng, images=images)

  @jax.jit
  def manual(params, tokens, valid, images):
    cache = transformer.init_cache(cfg, tokens.shape[0], tokens.shape[1] + cfg.canvas_length)
    _, cache = transformer.encode(params, cfg, tokens, cache, valid, images)
    canvas, _ = sampler.denoise_canvas(params, cfg, scfg, cache, jax.random.fold_in(rng, 0))
    return sampler.finalize_canvas(canvas, jnp.zeros(tokens.shape[0], bool), True, cfg,
                                   sampler.stop_ids(cfg, scfg))[0]

  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(manual(params, tokens, valid,
                                                                          images)))


def test_ar_mode_fallback_and_infill_read_the_images(image_prompt):
  """AR mode = a manual loop of encode + argmax after the image prompt; the AR fallback decodes
  a canvas exactly as AR mode does; infilling keeps its prefix and suffix after an image."""
  cfg, params, tokens, valid, images = image_prompt
  c = cfg.canvas_length
  ar = sampler.make_generate_fn(cfg, sampler.SamplerConfig(mode="ar", max_new_tokens=c))(
      params, tokens, valid, jax.random.PRNGKey(0), images=images)

  @jax.jit
  def manual(params, tokens, valid, images):
    cache = transformer.init_cache(cfg, tokens.shape[0], tokens.shape[1] + c)
    hidden, cache = transformer.encode(params, cfg, tokens, cache, valid, images)

    def step(carry, _):
      hidden, cache = carry
      token = jnp.argmax(transformer.lm_head(params, hidden[:, -1], cfg), -1).astype(jnp.int32)
      return transformer.encode(params, cfg, token[:, None], cache), token

    return jax.lax.scan(step, (hidden[:, -1:], cache), length=c)[1].T

  expected = np.asarray(manual(params, tokens, valid, images))
  got = np.asarray(ar.tokens)
  for row in range(len(tokens)):  # up to and including a stop, then pads
    stop = np.flatnonzero(expected[row] == cfg.eos_token_id)
    n = stop[0] + 1 if stop.size else c
    np.testing.assert_array_equal(got[row, :n], expected[row, :n])

  fallback = sampler.make_generate_fn(cfg, sampler.SamplerConfig(
      max_denoising_steps=1, max_new_tokens=c, ar_fallback="unconverged"))(
          params, tokens, valid, jax.random.PRNGKey(0), images=images)
  fell_back = np.asarray(fallback.canvas_ar)[:, 0]
  assert fell_back.any()
  np.testing.assert_array_equal(np.asarray(fallback.tokens)[fell_back], got[fell_back])

  out = sampler.infill(params, cfg, sampler.SamplerConfig(max_denoising_steps=2, max_new_tokens=c),
                       tokens, valid, [5, 6], [7], 3, images=images)
  np.testing.assert_array_equal(np.asarray(out.tokens)[:, [0, 1, 5]], [[5, 6, 7]] * 2)


def test_image_inputs_that_cannot_work_are_refused_in_one_line(image_prompt):
  cfg, params, tokens, valid, images = image_prompt
  fn = sampler.make_generate_fn(cfg, sampler.SamplerConfig(max_new_tokens=cfg.canvas_length))
  with pytest.raises(vision.ImageTokenError, match="10 image placeholder tokens .* make 14 soft"):
    fn(params, tokens, valid, jax.random.PRNGKey(0), images=_images(cfg, GRIDS + GRIDS))
  text_only = cfg.replace(vision=None)
  with pytest.raises(vision.ImageTokenError, match="without a vision tower"):
    vision.check_image_tokens(tokens, images, text_only)
  with pytest.raises(vision.ImageTokenError, match="no images were given"):
    vision.check_image_tokens(tokens, None, cfg)
