"""The SFT objective: encoder next-token CE + decoder denoising CE with self-conditioning.

A batch holds sequences of P prompt tokens followed by K canvases of C tokens:
  tokens_BxL (L = P + K*C), valid_BxL (False = padding), loss_mask_BxL (supervised tokens);
  a task that reads images adds each row's I image slots (`tasks.base.ImageSlots`):
  pixel_values [B, I, M, 3 p^2] and image_position_ids [B, I, M, 2].
One encoder pass over the clean sequence (its images' soft tokens over their placeholders) fills
the KV cache that the decoder reads.

Packed batches (`tasks.base.PackedLayout`: rows of R slots holding up to E whole examples, each
its prompt then its canvases, with segment ids and positions from 0) give the same objective
(`packed_sft_loss`): one encoder pass over each row, its examples kept apart by their segment
ids; one decoder row per packed row holding one canvas of each of its E examples side by side,
each seeing only its own example's cache. Each example draws its own canvas, noise level and
corruption, and the normalisation runs over examples, not rows: "token" divides the batch's
summed CE by the batch's scored tokens, "example" averages the per-example means over the
batch's examples, so a packed batch's loss (and gradient) is the loss of the unpacked batch of
the same examples, however they are laid out in rows.
"""

from __future__ import annotations

import dataclasses
import fractions
from typing import NamedTuple

import jax
import jax.numpy as jnp

from diffgemma.model import fields, transformer, vision
from diffgemma.model.config import ModelConfig
from diffgemma.tasks.base import PackedLayout
from diffgemma.training import diffusion

ENCODER_SCOPES = ("off", "target", "prompt_and_target")
CANVAS_SELECTIONS = ("one", "all")
DECODER_WEIGHTINGS = ("flat", "inverse_t")
NORMALIZATIONS = ("token", "example")
FILL_NOISES = ("as_reply", "always")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """The SFT objective's knobs (config section `loss`); the sequence layout comes from the task.

  encoder_scope: the encoder's next-token CE over "target" tokens, over "prompt_and_target"
    (every valid prompt token too), or "off" (the last canvas is then never encoded).
  canvas_selection: "one" canvas per example, uniformly among those with supervised tokens (the
    report's objective), or "all" its supervised canvases, each denoised from its own noise
    level against the clean earlier canvases (K times the decoder work per encoder pass).
  normalization: each term's mean over the batch: "token" (every scored token of the batch
    weighs the same; NeMo AutoModel's reduction) or "example" (each example's token mean, then
    the mean over examples that have scored tokens: a long reply weighs as much as a short
    one; the per-example mean NeMo's recipe notes for the reference's encoder loss).
  t_distribution: how each row's noise level is drawn, "uniform" U(t_eps, 1) (the report's) or
    "sqrt" (more t near 1; diffusion.T_DISTRIBUTIONS).
  fill_noise: the EOS fill after a reply's end (the scored canvas's target tokens equal to the
    model's eos_token_id): corrupted "as_reply" (at the row's t, the reference) or "always", so
    the decoder never sees where the fill starts and must place the end from the content, as
    it must when sampling starts a canvas from pure noise.
  end_weight: the CE weight of each example's reply end (`reply_end_mask`: its last supervised
    token that is not EOS fill, a chat reply's end-of-turn marker) in both terms, against 1 for
    every other scored token (1 = the reference). The stop is one decision per reply among many
    "next token" ones; a larger weight makes getting it right matter as much as a few dozen
    ordinary tokens.
  """

  encoder_weight: float = 1.0
  decoder_weight: float = 1.0
  encoder_scope: str = "target"
  noise_schedule: str = "linear"
  t_eps: float = 1e-3
  self_conditioning_prob: float = 0.5
  decoder_weighting: str = "flat"  # "flat" mean CE, or "inverse_t" (ELBO-style 1/t weight)
  canvas_selection: str = "one"
  normalization: str = "token"
  t_distribution: str = "uniform"
  fill_noise: str = "as_reply"
  end_weight: float = 1.0

  def __post_init__(self):
    fields.check_types(self, "loss.")
    for name, choices in (("encoder_scope", ENCODER_SCOPES),
                          ("t_distribution", diffusion.T_DISTRIBUTIONS),
                          ("fill_noise", FILL_NOISES),
                          ("canvas_selection", CANVAS_SELECTIONS),
                          ("normalization", NORMALIZATIONS),
                          ("decoder_weighting", DECODER_WEIGHTINGS),
                          ("noise_schedule", diffusion.SCHEDULES)):
      if getattr(self, name) not in choices:
        raise ValueError(f"unknown loss.{name} {getattr(self, name)!r}; choose one of {choices}")
    if self.end_weight <= 0:
      raise ValueError(f"loss.end_weight must be > 0, got {self.end_weight}")
    if self.encoder_weight < 0 or self.decoder_weight < 0:
      raise ValueError("loss.encoder_weight and loss.decoder_weight must be >= 0")
    if not (self.encoder_weight or self.decoder_weight):
      raise ValueError("loss.encoder_weight and loss.decoder_weight are both 0: nothing to train")
    if not 0.0 <= self.self_conditioning_prob <= 1.0:
      raise ValueError("loss.self_conditioning_prob must be in [0, 1], got "
                       f"{self.self_conditioning_prob}")
    if not 0.0 < self.t_eps < 1.0:  # t = 0 is a clean canvas: nothing to denoise
      raise ValueError(f"loss.t_eps must be in (0, 1), got {self.t_eps}")

  @property
  def uses_encoder_loss(self) -> bool:
    return self.encoder_scope != "off" and self.encoder_weight > 0


def sft_batch_shapes(layout, batch_size: int) -> dict:
  """ShapeDtypeStructs of one SFT batch of `batch_size` rows in `layout` (a task's `Layout`, or
  its `PackedLayout`: then the packed rows' arrays too)."""
  shape = (batch_size, layout.seq_len)
  shapes = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
            "valid": jax.ShapeDtypeStruct(shape, jnp.bool_),
            "loss_mask": jax.ShapeDtypeStruct(shape, jnp.bool_)}
  if isinstance(layout, PackedLayout):
    per_example = (batch_size, layout.row_examples)
    shapes.update(segment_ids=jax.ShapeDtypeStruct(shape, jnp.int32),
                  positions=jax.ShapeDtypeStruct(shape, jnp.int32),
                  canvas_start=jax.ShapeDtypeStruct(per_example, jnp.int32),
                  num_canvases=jax.ShapeDtypeStruct(per_example, jnp.int32))
  return shapes


def image_batch_shapes(slots, batch_size: int) -> dict:
  """ShapeDtypeStructs of the image arrays of a batch of `batch_size` rows with the image slots
  `slots` (a task's `ImageSlots`; None: none)."""
  if slots is None:
    return {}
  shape = (batch_size, slots.count, slots.max_patches)
  return {"pixel_values": jax.ShapeDtypeStruct(shape + (slots.patch_dim,), jnp.float32),
          "image_position_ids": jax.ShapeDtypeStruct(shape + (2,), jnp.int32)}


def batch_images(batch) -> vision.Images | None:
  """A batch's images as `transformer.encode` takes them (one row per image slot), or None."""
  if "pixel_values" not in batch:
    return None
  return vision.batch_images(batch["pixel_values"], batch["image_position_ids"])


def cross_entropy(logits_BxTxV, targets_BxT):
  """Per-token CE in float32 [B, T]."""
  logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]


def masked_mean(x, mask):
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def normalized_mean(x_UxT, mask_UxT, example_U, num_examples: int, normalization: str):
  """The batch mean of x over `mask` under `LossConfig.normalization`; row u belongs to
  example example_U[u] (several rows may share one: canvas_selection "all"), or, packed
  rows, entry (u, t) to example example_UxT[u, t]."""
  if normalization == "token":
    return masked_mean(x_UxT, mask_UxT)
  mask = mask_UxT.astype(jnp.float32)
  if example_U.ndim == 1:
    sums_B = jax.ops.segment_sum(jnp.sum(x_UxT * mask, -1), example_U, num_examples)
    counts_B = jax.ops.segment_sum(jnp.sum(mask, -1), example_U, num_examples)
  else:
    sums_B = jax.ops.segment_sum((x_UxT * mask).reshape(-1), example_U.reshape(-1), num_examples)
    counts_B = jax.ops.segment_sum(mask.reshape(-1), example_U.reshape(-1), num_examples)
  return masked_mean(sums_B / jnp.maximum(counts_B, 1.0), counts_B > 0)


def reply_end_mask(tokens_BxL, loss_mask_BxL, eos_token_id: int, segment_ids_BxL=None):
  """[B, L] bool: each row's (packed rows: each segment's) last supervised token that is not
  `eos_token_id` (the EOS fill after a reply); none in a row or segment without one."""
  content_BxL = loss_mask_BxL & (tokens_BxL != eos_token_id)
  b, l = content_BxL.shape
  if segment_ids_BxL is None:
    last_B = l - 1 - jnp.argmax(content_BxL[:, ::-1], axis=1)
    return (jnp.arange(l)[None] == last_B[:, None]) & content_BxL.any(1)[:, None]
  slot_BxL = jnp.broadcast_to(jnp.arange(l), (b, l))
  example_BxL = jnp.arange(b)[:, None] * (l + 1) + segment_ids_BxL
  last_N = jax.ops.segment_max(jnp.where(content_BxL, slot_BxL, -1).reshape(-1),
                               example_BxL.reshape(-1), b * (l + 1))
  return content_BxL & (slot_BxL == last_N[example_BxL])


def token_weights(tokens_BxL, loss_mask_BxL, eos_token_id: int, end_weight: float,
                  segment_ids_BxL=None):
  """[B, L] float32 CE weights: `end_weight` at the reply end (`reply_end_mask`), else 1."""
  end_BxL = reply_end_mask(tokens_BxL, loss_mask_BxL, eos_token_id, segment_ids_BxL)
  return jnp.where(end_BxL, jnp.float32(end_weight), jnp.float32(1.0))


def take_canvas(x_BxL, start_B, canvas_len: int):
  """Rows' canvases x[b, start_b : start_b + C] -> [B, C]."""
  index_BxC = start_B[:, None] + jnp.arange(canvas_len)
  return jnp.take_along_axis(x_BxL, index_BxC, axis=1)


def take_cache_rows(cache, row_U):
  """The cache of each of U rows' source row, [U, ...] (rows may repeat)."""
  return map_cache_rows(cache, lambda x: x[row_U])


def map_cache_rows(cache, fn):
  """The cache with `fn` applied to every per-row array (all but "end": the layers' K/V, the
  slots' validity and, packed, their positions and segments)."""
  return {key: value if key == "end" else jax.tree_util.tree_map(fn, value)
          for key, value in cache.items()}


class Draws(NamedTuple):
  """The random choices of one SFT batch, one entry per decoder row u (`decoder_rows`).

  canvas_U: the canvas k that row u denoises; t_U: its noise level (read only by
  decoder_weighting "inverse_t"); noisy_UxC: that canvas after the forward process.
  Packed rows (`sample_packed_draws`): one entry per decoder row u and example slot j,
  canvas_UxE and t_UxE, and noisy_UxEC the E corrupted canvases side by side.
  """
  canvas_U: jnp.ndarray
  t_U: jnp.ndarray
  noisy_UxC: jnp.ndarray


def decoder_rows(loss_cfg: LossConfig, batch_size: int, num_canvases: int):
  """The example each decoder row reads, [U]: one row per example ("one"), or row
  u = b * K + k for every canvas k of every example b ("all")."""
  if loss_cfg.canvas_selection == "one":
    return jnp.arange(batch_size)
  return jnp.repeat(jnp.arange(batch_size), num_canvases)


def sample_draws(rng, cfg: ModelConfig, loss_cfg: LossConfig, layout, batch) -> Draws:
  """`sft_loss`'s draws from `rng`: the canvas of each row (uniform among the example's
  canvases with supervised tokens under "one"), t ~ U(t_eps, 1) per row, the corruption."""
  tokens, loss_mask = batch["tokens"], batch["loss_mask"]
  b = tokens.shape[0]
  c, p, num_canvases = cfg.canvas_length, layout.prompt_len, layout.num_canvases
  canvas_rng, t_rng, noise_rng = jax.random.split(rng, 3)
  if loss_cfg.canvas_selection == "one":
    has_target_BxK = loss_mask[:, p:].reshape(b, num_canvases, c).any(-1)
    k_U = jax.random.categorical(canvas_rng, jnp.where(has_target_BxK, 0.0, -jnp.inf))
  else:
    k_U = jnp.tile(jnp.arange(num_canvases), b)
  row_U = decoder_rows(loss_cfg, b, num_canvases)
  start_U = p + k_U * c
  clean_UxC = take_canvas(tokens[row_U], start_U, c)
  target_mask_UxC = take_canvas(loss_mask[row_U], start_U, c)
  t_U = diffusion.sample_noise_level(t_rng, k_U.shape[0], loss_cfg.t_eps,
                                     loss_cfg.t_distribution)
  fill_UxC = (target_mask_UxC & (clean_UxC == cfg.eos_token_id)
              if loss_cfg.fill_noise == "always" else None)
  noisy_UxC = diffusion.corrupt(noise_rng, clean_UxC, t_U, cfg.vocab_size,
                                loss_cfg.noise_schedule, target_mask_UxC, fill_UxC)
  return Draws(k_U, t_U, noisy_UxC)


def sft_loss(params, cfg: ModelConfig, loss_cfg: LossConfig, layout, batch, rng,
             draws: Draws | None = None):
  """Total loss and metrics for one batch. Returns (loss, metrics dict of scalars).

  layout: the task's `Layout` (P prompt slots, K canvases of C = cfg.canvas_length); batch:
  tokens_BxL, valid_BxL, loss_mask_BxL with L = P + K * C (diffgemma/tasks/base.py).
  draws: `Draws` to use instead of `sample_draws(rng, ...)` (e.g. another implementation's
  corruption, to compare objectives on the same noise).
  """
  if isinstance(layout, PackedLayout):
    return packed_sft_loss(params, cfg, loss_cfg, layout, batch, rng, draws)
  tokens, valid, loss_mask = batch["tokens"], batch["valid"], batch["loss_mask"]
  b, seq_len = tokens.shape
  c, p, num_canvases = cfg.canvas_length, layout.prompt_len, layout.num_canvases
  if layout.canvas_length != c or layout.seq_len != seq_len:
    raise ValueError(f"batch of length {seq_len} does not match the layout {layout} of a model "
                     f"with canvas_length {c}")
  if draws is None:
    with jax.named_scope("forward_process"):
      draws = sample_draws(rng, cfg, loss_cfg, layout, batch)

  # The decoder never needs the last canvas's K/V; without an encoder loss, skip encoding it.
  encode_len = seq_len if loss_cfg.uses_encoder_loss else p + (num_canvases - 1) * c
  cache = transformer.init_cache(cfg, b, encode_len)
  hidden, cache = transformer.encode(params, cfg, tokens[:, :encode_len], cache,
                                     valid[:, :encode_len], batch_images(batch))

  # Weights multiply the masks that normalized_mean reduces over: a weighted mean.
  weight_BxL = token_weights(tokens, loss_mask, cfg.eos_token_id, loss_cfg.end_weight)
  metrics = {}
  encoder_loss = jnp.zeros(())
  if loss_cfg.uses_encoder_loss:
    scope_BxL = loss_mask
    if loss_cfg.encoder_scope == "prompt_and_target":
      scope_BxL = loss_mask | (jnp.arange(seq_len) < p)[None]
    # A pair needs its input token valid too: a padding slot before the prompt sees nothing.
    targets_mask = valid[:, :-1] & valid[:, 1:] & scope_BxL[:, 1:]
    encoder_loss = _encoder_term(params, cfg, loss_cfg, hidden, tokens,
                                 targets_mask * weight_BxL[:, 1:], jnp.arange(b), b)
    metrics["encoder_loss"] = encoder_loss

  # Row u denoises canvas k_U[u] of example row_U[u], reading that example's cache up to it (a
  # canvas without supervised tokens contributes nothing).
  row_U = decoder_rows(loss_cfg, b, num_canvases)
  decode_cache = cache if loss_cfg.canvas_selection == "one" else take_cache_rows(cache, row_U)
  start_U = p + draws.canvas_U * c
  clean_UxC = take_canvas(tokens[row_U], start_U, c)
  target_mask_UxC = take_canvas(loss_mask[row_U], start_U, c)

  logits, _, _ = self_conditioned_logits(params, cfg, draws.noisy_UxC, decode_cache, start_U,
                                         loss_cfg.self_conditioning_prob)
  weight_UxC = take_canvas(weight_BxL[row_U], start_U, c)
  return _total(loss_cfg, encoder_loss, metrics, logits, clean_UxC, target_mask_UxC, weight_UxC,
                draws.t_U[:, None], row_U, b)


def _encoder_term(params, cfg: ModelConfig, loss_cfg: LossConfig, hidden_BxLxD, tokens_BxL,
                  weight_BxL1, example, num_examples: int):
  """The encoder's next-token CE of the pairs (l, l + 1) weighted by weight_BxL1 [B, L - 1]
  (0: not scored), normalised over `example` (`normalized_mean`)."""
  logits = transformer.lm_head(params, hidden_BxLxD[:, :-1], cfg)
  return normalized_mean(cross_entropy(logits, tokens_BxL[:, 1:]), weight_BxL1, example,
                         num_examples, loss_cfg.normalization)


def _total(loss_cfg: LossConfig, encoder_loss, metrics: dict, logits_UxCxV, clean_UxC,
           target_mask_UxC, weight_UxC, t_Ux1, example, num_examples: int):
  """(total loss, metrics) from the encoder term and the decoder's logits on the noisy canvases
  (`t_Ux1` broadcasts each canvas's noise level over its tokens)."""
  ce_UxC = cross_entropy(logits_UxCxV, clean_UxC)
  if loss_cfg.decoder_weighting == "inverse_t":
    ce_UxC = ce_UxC / t_Ux1
  decoder_loss = normalized_mean(ce_UxC, target_mask_UxC * weight_UxC, example, num_examples,
                                 loss_cfg.normalization)
  correct = (jnp.argmax(logits_UxCxV, -1) == clean_UxC)
  metrics["decoder_loss"] = decoder_loss
  metrics["decoder_token_accuracy"] = masked_mean(correct, target_mask_UxC)
  total = loss_cfg.encoder_weight * encoder_loss + loss_cfg.decoder_weight * decoder_loss
  metrics["loss"] = total
  return total, metrics


# ----------------------------------------------------------------------------- packed rows


def packed_canvases(batch, row_U, canvas_UxE, canvas_len: int):
  """Where decoder row u's E canvases lie: canvas canvas_UxE[u, j] of example j of packed row
  row_U[u]. Returns (index_UxEC: their row slots, side by side; exists_UxE: example j has that
  canvas; prefix_len_UxE: each canvas's first position in its example; segments_UxE: j + 1
  where it exists, else 0)."""
  canvas_start_UxE = batch["canvas_start"][row_U]
  exists_UxE = canvas_UxE < batch["num_canvases"][row_U]
  start_UxE = canvas_start_UxE + canvas_UxE * canvas_len
  u, e = canvas_UxE.shape
  row_len = batch["tokens"].shape[1]
  index_UxEC = jnp.minimum(start_UxE[..., None] + jnp.arange(canvas_len), row_len - 1)
  prompt_len_UxE = jnp.take_along_axis(batch["positions"][row_U], canvas_start_UxE, axis=1)
  segments_UxE = jnp.where(exists_UxE, jnp.arange(1, e + 1), 0)
  return (index_UxEC.reshape(u, e * canvas_len), exists_UxE,
          prompt_len_UxE + canvas_UxE * canvas_len, segments_UxE)


def sample_packed_draws(rng, cfg: ModelConfig, loss_cfg: LossConfig, layout: PackedLayout,
                        batch) -> Draws:
  """`sample_draws` for packed rows: for decoder row u and example slot j the canvas k
  (uniform among the example's canvases under "one"; canvas u % K under "all"), its noise level
  t and its corruption, each example's as `sample_draws` draws it for that example alone."""
  b = batch["tokens"].shape[0]
  c, e, k_max = cfg.canvas_length, layout.row_examples, layout.num_canvases
  canvas_rng, t_rng, noise_rng = jax.random.split(rng, 3)
  num_canvases_BxE = batch["num_canvases"]
  if loss_cfg.canvas_selection == "one":
    has_BxExK = jnp.arange(k_max) < num_canvases_BxE[..., None]
    # An empty example slot draws canvas 0, which it does not have: nothing is scored there.
    k_UxE = jax.random.categorical(
        canvas_rng, jnp.where(has_BxExK | (num_canvases_BxE[..., None] == 0), 0.0, -jnp.inf))
  else:
    k_UxE = jnp.broadcast_to(jnp.tile(jnp.arange(k_max), b)[:, None], (b * k_max, e))
  row_U = decoder_rows(loss_cfg, b, k_max)
  index_UxEC, exists_UxE, _, _ = packed_canvases(batch, row_U, k_UxE, c)
  u = row_U.shape[0]
  clean_NxC = jnp.take_along_axis(batch["tokens"][row_U], index_UxEC, axis=1).reshape(u * e, c)
  target_mask_NxC = (jnp.take_along_axis(batch["loss_mask"][row_U], index_UxEC, axis=1)
                     .reshape(u * e, c) & exists_UxE.reshape(u * e, 1))
  t_N = diffusion.sample_noise_level(t_rng, u * e, loss_cfg.t_eps, loss_cfg.t_distribution)
  fill_NxC = (target_mask_NxC & (clean_NxC == cfg.eos_token_id)
              if loss_cfg.fill_noise == "always" else None)
  noisy_NxC = diffusion.corrupt(noise_rng, clean_NxC, t_N, cfg.vocab_size,
                                loss_cfg.noise_schedule, target_mask_NxC, fill_NxC)
  return Draws(k_UxE, t_N.reshape(u, e), noisy_NxC.reshape(u, e * c))


def packed_sft_loss(params, cfg: ModelConfig, loss_cfg: LossConfig, layout: PackedLayout, batch,
                    rng, draws: Draws | None = None):
  """`sft_loss` of a packed batch (`PackedLayout`'s arrays; the module docstring). Each example
  is computed as it is alone: its encoder pass sees its own tokens only (segment ids,
  positions from 0), its decoder canvas its own cache and canvas. Example j of row b is example
  b * E + j of the normalisation. draws: `Draws` as `sample_packed_draws` makes them."""
  tokens, valid, loss_mask = batch["tokens"], batch["valid"], batch["loss_mask"]
  segment_ids_BxR, positions_BxR = batch["segment_ids"], batch["positions"]
  b, row_len = tokens.shape
  c, e = cfg.canvas_length, layout.row_examples
  if layout.canvas_length != c or layout.row_tokens != row_len:
    raise ValueError(f"packed rows of {row_len} slots do not match the layout {layout} of a "
                     f"model with canvas_length {c}")
  if draws is None:
    with jax.named_scope("forward_process"):
      draws = sample_packed_draws(rng, cfg, loss_cfg, layout, batch)

  cache = transformer.init_cache(cfg, b, row_len)
  hidden, cache = transformer.encode(params, cfg, tokens, cache, valid,
                                     positions_BxT=positions_BxR, segment_ids_BxT=segment_ids_BxR)
  weight_BxR = token_weights(tokens, loss_mask, cfg.eos_token_id, loss_cfg.end_weight,
                             segment_ids_BxR)
  metrics = {}
  encoder_loss = jnp.zeros(())
  if loss_cfg.uses_encoder_loss:
    # "prompt_and_target": every slot of an example is its prompt or its canvases.
    scope_BxR = loss_mask if loss_cfg.encoder_scope == "target" else valid
    # A pair never crosses from one example into the next.
    targets_mask = (valid[:, :-1] & valid[:, 1:] & scope_BxR[:, 1:]
                    & (segment_ids_BxR[:, :-1] == segment_ids_BxR[:, 1:]))
    example_BxR = jnp.arange(b)[:, None] * e + jnp.maximum(segment_ids_BxR - 1, 0)
    encoder_loss = _encoder_term(params, cfg, loss_cfg, hidden, tokens,
                                 targets_mask * weight_BxR[:, 1:], example_BxR[:, 1:], b * e)
    metrics["encoder_loss"] = encoder_loss

  row_U = decoder_rows(loss_cfg, b, layout.num_canvases)
  decode_cache = cache if loss_cfg.canvas_selection == "one" else take_cache_rows(cache, row_U)
  index_UxEC, exists_UxE, prefix_len_UxE, segments_UxE = packed_canvases(
      batch, row_U, draws.canvas_U, c)
  take = lambda x_BxR: jnp.take_along_axis(x_BxR[row_U], index_UxEC, axis=1)
  target_mask_UxEC = take(loss_mask) & jnp.repeat(exists_UxE, c, axis=1)
  logits, _, _ = self_conditioned_logits(params, cfg, draws.noisy_UxC, decode_cache,
                                         prefix_len_UxE, loss_cfg.self_conditioning_prob,
                                         segments_UxE)
  example_UxEC = jnp.repeat(row_U[:, None] * e + jnp.arange(e), c, axis=1)
  return _total(loss_cfg, encoder_loss, metrics, logits, take(tokens), target_mask_UxEC,
                take(weight_BxR), jnp.repeat(draws.t_U, c, axis=1), example_UxEC, b * e)


def self_conditioning_rows(batch: int, prob: float) -> tuple[int, int]:
  """(k, g): the self-conditioned rows are the first k of every g consecutive rows; k / g is
  prob as the closest fraction with a denominator of at most `batch` (0.3 of 6 rows: 1 of 3).

  Spreading them evenly (instead of taking the first round(B * prob) rows) keeps the selection
  inside each batch shard under data / FSDP sharding, and does not depend on the device count.
  A prob with no denominator dividing the batch falls back to one group of the whole batch.
  """
  frac = fractions.Fraction(prob).limit_denominator(batch)
  group = frac.denominator if batch % frac.denominator == 0 else batch
  return round(group * prob), group


def self_conditioned_logits(params, cfg: ModelConfig, noisy_BxC, cache, prefix_len_B,
                            self_conditioning_prob: float, canvas_segments_BxE=None):
  """Decoder logits [B, C, V] under the SFT self-conditioning scheme, and its inputs.

  A gradient-free first pass supplies the self-conditioning input of a `self_conditioning_prob`
  share of the rows (`self_conditioning_rows`); the rest get zeros. Callers pass rows in random
  order, so those rows are a random subset. The first pass and the soft embedding run on those
  rows only (the rest would be multiplied by zero).
  Packed rows (`canvas_segments_BxE`, prefix_len_BxE: `transformer.decode`'s packed canvases): a
  row's every canvas is self-conditioned or none is.
  Returns (logits_BxCxV, self-conditioning logits [B, C, V] (zeros on the other rows) or None,
  self-conditioning mask [B]).
  """
  b = noisy_BxC.shape[0]
  k, g = self_conditioning_rows(b, self_conditioning_prob)
  sc_mask_B = jnp.arange(b) % g < k
  packed = {} if canvas_segments_BxE is None else {"canvas_segments_BxE": canvas_segments_BxE}
  if not k:
    logits = transformer.decode(params, cfg, noisy_BxC, cache, prefix_len_B, None, sc_mask_B,
                                **packed)
    return logits, None, sc_mask_B

  def take(x):  # [B, ...] -> the self-conditioned rows [B / g * k, ...]
    return x.reshape(b // g, g, *x.shape[1:])[:, :k].reshape(b // g * k, *x.shape[1:])

  def spread(x):  # inverse of `take`, zeros on the other rows
    x = x.reshape(b // g, k, *x.shape[1:])
    pad = jnp.zeros((b // g, g - k) + x.shape[2:], x.dtype)
    return jnp.concatenate([x, pad], axis=1).reshape(b, *x.shape[2:])

  sc_cache = map_cache_rows(cache, take)
  with jax.named_scope("self_conditioning_pass"):
    first = jax.lax.stop_gradient(
        transformer.decode(params, cfg, take(noisy_BxC), sc_cache, take(prefix_len_B),
                           **{key: take(x) for key, x in packed.items()}))
  soft_BxCxD = spread(transformer.self_conditioning_embedding(params, first, cfg))
  logits = transformer.decode(params, cfg, noisy_BxC, cache, prefix_len_B, None, sc_mask_B,
                              soft_BxCxD, **packed)
  return logits, spread(first), sc_mask_B
