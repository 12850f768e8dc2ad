"""The SFT objective: encoder next-token CE + decoder denoising CE with self-conditioning.

A batch holds sequences of P prompt tokens followed by K canvases of C tokens:
  tokens_BxL (L = P + K*C), valid_BxL (False = padding), loss_mask_BxL (supervised tokens).
One encoder pass over the clean sequence fills the KV cache that the decoder reads.
"""

from __future__ import annotations

import dataclasses
import fractions

import jax
import jax.numpy as jnp

from diffgemma import diffusion, model
from diffgemma.config import ModelConfig

DECODER_WEIGHTINGS = ("flat", "inverse_t")


@dataclasses.dataclass(frozen=True)
class LossConfig:
  prompt_len: int  # P: every sequence's prompt is (left-)padded to this length
  encoder_weight: float = 1.0
  decoder_weight: float = 1.0
  encoder_loss_on_prompt: bool = False  # next-token CE on prompt tokens too (else response only)
  noise_schedule: str = "linear"
  t_eps: float = 1e-3
  self_conditioning_prob: float = 0.5
  decoder_weighting: str = "flat"  # "flat" mean CE, or "inverse_t" (ELBO-style 1/t weight)


def cross_entropy(logits_BxTxV, targets_BxT):
  """Per-token CE in float32 [B, T]."""
  logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]


def masked_mean(x, mask):
  mask = mask.astype(jnp.float32)
  return jnp.sum(x * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _take_canvas(x_BxL, start_B, canvas_len: int):
  """Rows' canvases x[b, start_b : start_b + C] -> [B, C]."""
  index_BxC = start_B[:, None] + jnp.arange(canvas_len)
  return jnp.take_along_axis(x_BxL, index_BxC, axis=1)


def sft_loss(params, cfg: ModelConfig, loss_cfg: LossConfig, batch, rng):
  """Total loss and metrics for one batch. Returns (loss, metrics dict of scalars)."""
  tokens, valid, loss_mask = batch["tokens"], batch["valid"], batch["loss_mask"]
  b, seq_len = tokens.shape
  c, p = cfg.canvas_length, loss_cfg.prompt_len
  num_canvases = (seq_len - p) // c
  if p + num_canvases * c != seq_len:
    raise ValueError(f"sequence length {seq_len} is not prompt {p} + a multiple of canvas {c}")
  canvas_rng, t_rng, noise_rng = jax.random.split(rng, 3)

  # The decoder never needs the last canvas's K/V; without an encoder loss, skip encoding it.
  encode_len = seq_len if loss_cfg.encoder_weight else p + (num_canvases - 1) * c
  cache = model.init_cache(cfg, b, encode_len)
  hidden, cache = model.encode(params, cfg, tokens[:, :encode_len], cache, valid[:, :encode_len])

  metrics = {}
  encoder_loss = jnp.zeros(())
  if loss_cfg.encoder_weight:
    targets_mask = valid[:, 1:] & (loss_mask[:, 1:] | loss_cfg.encoder_loss_on_prompt)
    logits = model.lm_head(params, hidden[:, :-1], cfg)
    encoder_loss = masked_mean(cross_entropy(logits, tokens[:, 1:]), targets_mask)
    metrics["encoder_loss"] = encoder_loss

  # One canvas per example, uniformly among those with supervised tokens.
  has_target_BxK = loss_mask[:, p:].reshape(b, num_canvases, c).any(-1)
  choice_logits = jnp.where(has_target_BxK, 0.0, -jnp.inf)
  k_B = jax.random.categorical(canvas_rng, choice_logits)
  start_B = p + k_B * c
  clean_BxC = _take_canvas(tokens, start_B, c)
  target_mask_BxC = _take_canvas(loss_mask, start_B, c)
  t_B = diffusion.sample_noise_level(t_rng, b, loss_cfg.t_eps)
  noisy_BxC = diffusion.corrupt(noise_rng, clean_BxC, t_B, cfg.vocab_size,
                                loss_cfg.noise_schedule, target_mask_BxC)

  logits, _, _ = self_conditioned_logits(params, cfg, noisy_BxC, cache, start_B,
                                         loss_cfg.self_conditioning_prob)
  ce_BxC = cross_entropy(logits, clean_BxC)
  if loss_cfg.decoder_weighting == "inverse_t":
    ce_BxC = ce_BxC / t_B[:, None]
  elif loss_cfg.decoder_weighting != "flat":
    raise ValueError(f"unknown decoder_weighting {loss_cfg.decoder_weighting!r}; choose one of "
                     f"{DECODER_WEIGHTINGS}")
  decoder_loss = masked_mean(ce_BxC, target_mask_BxC)
  correct = (jnp.argmax(logits, -1) == clean_BxC)
  metrics["decoder_loss"] = decoder_loss
  metrics["decoder_token_accuracy"] = masked_mean(correct, target_mask_BxC)
  total = loss_cfg.encoder_weight * encoder_loss + loss_cfg.decoder_weight * decoder_loss
  metrics["loss"] = total
  return total, metrics


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
                            self_conditioning_prob: float):
  """Decoder logits [B, C, V] under the SFT self-conditioning scheme, and its inputs.

  A gradient-free first pass supplies the self-conditioning input of a `self_conditioning_prob`
  share of the rows (`self_conditioning_rows`); the rest get zeros. Callers pass rows in random
  order, so those rows are a random subset. The first pass and the soft embedding run on those
  rows only (the rest would be multiplied by zero).
  Returns (logits_BxCxV, self-conditioning logits [B, C, V] (zeros on the other rows) or None,
  self-conditioning mask [B]).
  """
  b = noisy_BxC.shape[0]
  k, g = self_conditioning_rows(b, self_conditioning_prob)
  sc_mask_B = jnp.arange(b) % g < k
  if not k:
    logits = model.decode(params, cfg, noisy_BxC, cache, prefix_len_B, None, sc_mask_B)
    return logits, None, sc_mask_B

  def take(x):  # [B, ...] -> the self-conditioned rows [B / g * k, ...]
    return x.reshape(b // g, g, *x.shape[1:])[:, :k].reshape(b // g * k, *x.shape[1:])

  def spread(x):  # inverse of `take`, zeros on the other rows
    x = x.reshape(b // g, k, *x.shape[1:])
    pad = jnp.zeros((b // g, g - k) + x.shape[2:], x.dtype)
    return jnp.concatenate([x, pad], axis=1).reshape(b, *x.shape[2:])

  sc_cache = {"layers": jax.tree_util.tree_map(take, cache["layers"]),
              "valid": take(cache["valid"]), "end": cache["end"]}
  first = jax.lax.stop_gradient(
      model.decode(params, cfg, take(noisy_BxC), sc_cache, take(prefix_len_B)))
  soft_BxCxD = spread(model.self_conditioning_embedding(params, first, cfg))
  logits = model.decode(params, cfg, noisy_BxC, cache, prefix_len_B, None, sc_mask_B, soft_BxCxD)
  return logits, spread(first), sc_mask_B
