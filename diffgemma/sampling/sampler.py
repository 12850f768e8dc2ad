"""Block-diffusion sampling (docs/design.md, "The sampler"), and autoregressive decoding on the
same weights.

Semantics follow transformers' `generation_diffusion_gemma.py` (the reference):
  * `temperature`            <-> LinearTemperatureScheduleLogitsProcessor
  * `token_entropy`          <-> torch.distributions.Categorical(logits).entropy()
  * `entropy_bounded_accept` <-> EntropyBoundSampler.accept_canvas (the mask)
  * `stable_and_confident`   <-> StableAndConfidentStoppingCriteria
  * `denoising_step`         <-> DiffusionGemmaGenerationMixin._denoising_step
  * `finalize_canvas`        <-> DiffusionGemmaGenerationMixin._finalize_canvas
  * `generate`               <-> DiffusionGemmaGenerationMixin.generate
                                 (+ _compute_tokens_per_forward for the statistics)

Everything is a pure function; loops are `lax.while_loop`s so a whole `generate` call is one
jitted program (configs static). The trainer and the RL stage reuse the per-step pieces.

Shape suffixes: B batch, P prompt, C canvas, V vocab, N max denoising steps, K canvases,
S stability history, L = K * C generated slots.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from diffgemma.model import fields, transformer, vision
from diffgemma.model.config import ModelConfig

DIFFUSION = "diffusion"
AR = "ar"
# AR fallback rules (SamplerConfig.ar_fallback): which canvases are decoded left to right.
FALLBACK_OFF = ""
FALLBACK_UNCONVERGED = "unconverged"  # the loop hit max_denoising_steps without stopping
FALLBACK_ENTROPY = "entropy"  # mean entropy still above a threshold after k steps
FALLBACK_RULES = (FALLBACK_OFF, FALLBACK_UNCONVERGED, FALLBACK_ENTROPY)
# Acceptance orders (SamplerConfig.acceptance): which drawn positions a denoising step keeps.
ACCEPT_ENTROPY = "entropy"  # the reference: lowest entropy first, anywhere in the canvas
ACCEPT_LEFT_TO_RIGHT = "left_to_right"  # from the canvas's left end, while the bound lasts
ACCEPTANCES = (ACCEPT_ENTROPY, ACCEPT_LEFT_TO_RIGHT)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """Sampling hyper-parameters; defaults are the reference's (report Table 2)."""

  max_denoising_steps: int = 48
  entropy_bound: float = 0.1
  t_max: float = 0.8  # temperature at the first denoising step
  t_min: float = 0.4  # temperature at the last denoising step
  confidence_threshold: float = 0.005  # mean tempered entropy below which a canvas is confident
  stability_threshold: int = 1  # steps the argmax canvas must stay unchanged; 0 = not required
  max_new_tokens: int = 256
  mode: str = DIFFUSION  # "diffusion" | "ar" (left-to-right through the encoder)
  ar_temperature: float = 0.0  # AR mode only; 0 = greedy
  record_trajectory: bool = False  # keep every step's canvases (for RL replay)
  # Ids that end a row besides the model's eos_token_id (e.g. a chat model's end-of-turn), as
  # the reference's list-valued `eos_token_id`.
  stop_token_ids: tuple[int, ...] = ()
  # Fused step: one pass over the tempered [C, V] distribution yields the draw, entropy, argmax
  # and the next step's self-conditioning embedding, and the loop carries [B, C, D] embeddings
  # instead of [B, C, V] logits. Same results as the unfused step (up to float rounding).
  fused_step: bool = False
  # Fused step only: truncate the tempered distribution to its top_k tokens (renormalised) for
  # the draw, the entropy and the self-conditioning; 0 (or >= vocab_size) = off (the
  # reference's semantics).
  top_k: int = 0
  # AR fallback per canvas (diffusion mode; off = the reference's semantics exactly): a canvas
  # that meets the rule is decoded left to right through the encoder's next-token head instead
  # (greedy, or at ar_temperature), then diffusion goes on with the next canvas.
  #   "unconverged": its denoising loop ran all max_denoising_steps without the adaptive stop;
  #   "entropy": after ar_fallback_after_steps steps its mean tempered entropy (the stop test's)
  #     is above ar_fallback_entropy; its denoising stops there.
  ar_fallback: str = FALLBACK_OFF
  ar_fallback_entropy: float = 1.0
  ar_fallback_after_steps: int = 8
  # Stops in order (diffusion mode; False = the reference's acceptance exactly): a drawn stop
  # token is kept in the canvas only when every position to its left is kept in the same step,
  # so a confident EOS tail cannot fix the reply's length before its content (the blocked
  # positions are left out of the entropy ranking and renoised; `accept_in_order`).
  stop_in_order: bool = False
  # Which positions a step keeps (diffusion mode; "entropy" = the reference): "left_to_right"
  # keeps the longest run from the canvas's left end whose entropy sum without its last entry is
  # <= entropy_bound, so every kept token has its whole left context kept with it (an ablation
  # of parallel commits; on sort it lost to the reference's order, benchmarks/RESULTS.md
  # 2026-12-06). It implies stop_in_order's guarantee.
  acceptance: str = ACCEPT_ENTROPY
  # At most this many positions drawing the same token are kept in one step (diffusion mode;
  # 0 = off, the reference): the others wait for a later step, when the kept ones are in the
  # canvas they see. Aimed at replies whose errors are token counts (sort's letters); the first
  # in the acceptance's order are kept (`over_token_limit`).
  max_same_token_per_step: int = 0

  def __post_init__(self):
    fields.check_types(self, "sampler.")
    if self.mode not in (DIFFUSION, AR):
      raise ValueError(f"unknown sampler.mode {self.mode!r}; choose {DIFFUSION!r} or {AR!r}")
    if self.max_denoising_steps <= 0:
      raise ValueError(f"sampler.max_denoising_steps must be >= 1, got {self.max_denoising_steps}")
    # As the reference: t_n > t_min >= 0 at every step n >= 1, so t_min = 0 is allowed.
    if not 0.0 <= self.t_min < self.t_max:
      raise ValueError(f"need 0 <= sampler.t_min < sampler.t_max (got {self.t_min}, "
                       f"{self.t_max})")
    for name in ("stability_threshold", "ar_temperature", "entropy_bound",
                 "confidence_threshold"):
      if getattr(self, name) < 0:
        raise ValueError(f"sampler.{name} must be >= 0, got {getattr(self, name)}")
    if self.max_new_tokens <= 0:
      raise ValueError(f"sampler.max_new_tokens must be >= 1, got {self.max_new_tokens}")
    if self.top_k < 0:
      raise ValueError("sampler.top_k must be >= 0 (0 = no truncation)")
    if self.top_k and not self.fused_step:
      raise ValueError("top_k truncation needs fused_step=True")
    if self.ar_fallback not in FALLBACK_RULES:
      raise ValueError(f"unknown ar_fallback {self.ar_fallback!r}; choose one of "
                       f"{FALLBACK_RULES} ('' = off)")
    if self.ar_fallback and self.mode != DIFFUSION:
      raise ValueError("ar_fallback applies to mode='diffusion'")
    if (self.ar_fallback == FALLBACK_ENTROPY
        and not 1 <= self.ar_fallback_after_steps <= self.max_denoising_steps):
      raise ValueError(f"ar_fallback_after_steps must be in 1..max_denoising_steps "
                       f"(got {self.ar_fallback_after_steps})")
    if self.stop_in_order and self.mode != DIFFUSION:
      raise ValueError("stop_in_order applies to mode='diffusion'")
    if self.acceptance not in ACCEPTANCES:
      raise ValueError(f"unknown acceptance {self.acceptance!r}; choose one of {ACCEPTANCES}")
    if self.ar_fallback_entropy < 0:
      raise ValueError("ar_fallback_entropy must be >= 0")
    if self.max_same_token_per_step < 0:
      raise ValueError("sampler.max_same_token_per_step must be >= 0 (0 = no limit)")
    if self.max_same_token_per_step and self.mode != DIFFUSION:
      raise ValueError("max_same_token_per_step applies to mode='diffusion'")
    try:
      ids = tuple(int(i) for i in self.stop_token_ids)
    except (TypeError, ValueError):
      raise ValueError(f"stop_token_ids must be token ids (integers), got "
                       f"{self.stop_token_ids!r}") from None
    object.__setattr__(self, "stop_token_ids", ids)

  def replace(self, **kwargs: Any) -> "SamplerConfig":
    return dataclasses.replace(self, **kwargs)

  def with_stops(self, stop_token_ids=()) -> "SamplerConfig":
    """This sampler ending rows also at `stop_token_ids` (e.g. a task's end-of-turn ids)."""
    return self.replace(stop_token_ids=tuple(dict.fromkeys(
        self.stop_token_ids + tuple(int(i) for i in stop_token_ids))))


def num_canvases(model_cfg: ModelConfig, sampler_cfg: SamplerConfig) -> int:
  """K = ceil(max_new_tokens / C): the reference always fills whole canvases."""
  return math.ceil(sampler_cfg.max_new_tokens / model_cfg.canvas_length)


# ----------------------------------------------------------------------------- per-step pieces


def temperature(step_remaining, cfg: SamplerConfig):
  """t_n = t_min + (t_max - t_min) * n / N, float32; n counts DOWN from N (first step) to 1."""
  frac = jnp.asarray(step_remaining, jnp.int32).astype(jnp.float32) / cfg.max_denoising_steps
  return cfg.t_min + (cfg.t_max - cfg.t_min) * frac


def token_entropy(logits_xV):
  """Entropy of softmax(logits) over the last axis, in float32; shape [...]."""
  return _entropy(jax.nn.log_softmax(logits_xV.astype(jnp.float32), axis=-1))


def _entropy(log_probs_xV):
  # As torch's Categorical: clamp -inf log-probs so 0 * log 0 contributes 0, not nan.
  logp = jnp.maximum(log_probs_xV, jnp.finfo(jnp.float32).min)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def sample_categorical(rng, log_probs_xV):
  """One draw from exp(log_probs) over the last axis, by inverse CDF; int32 [...].

  One uniform number per draw, as torch.multinomial, where jax.random.categorical (Gumbel-max)
  draws and takes two logs of one per vocabulary entry: on CPU that cost more than everything
  else in a denoising step outside the network.
  """
  cdf_xV = jnp.cumsum(jnp.exp(log_probs_xV), axis=-1)
  u_x1 = jax.random.uniform(rng, cdf_xV.shape[:-1] + (1,), cdf_xV.dtype) * cdf_xV[..., -1:]
  # The first entry whose cdf exceeds u (never a zero-probability one); the clamp guards
  # against u rounding up to the total.
  first_above = jnp.sum(cdf_xV <= u_x1, axis=-1)
  return jnp.minimum(first_above, cdf_xV.shape[-1] - 1).astype(jnp.int32)


def entropy_bounded_accept(entropy_BxC, bound: float, left_to_right: bool = False):
  """Entropy-bounded acceptance mask [B, C] bool.

  Sort positions by entropy (ascending, ties in position order) and accept the longest prefix
  whose entropy sum without its own (largest) entry is <= bound; the lowest-entropy position is
  therefore always accepted. `left_to_right`: the positions are taken in canvas order instead
  (SamplerConfig.acceptance "left_to_right"), so the accepted set is a run from the left end.
  """
  if left_to_right:
    order_BxC = jnp.broadcast_to(jnp.arange(entropy_BxC.shape[-1]), entropy_BxC.shape)
  else:
    order_BxC = jnp.argsort(entropy_BxC, axis=-1, stable=True)
  sorted_BxC = jnp.take_along_axis(entropy_BxC, order_BxC, axis=-1)
  # cumsum - own, not an exclusive cumsum: the same float rounding as the reference.
  accept_sorted_BxC = jnp.cumsum(sorted_BxC, axis=-1) - sorted_BxC <= bound
  rows_Bx1 = jnp.arange(entropy_BxC.shape[0])[:, None]
  return jnp.zeros_like(accept_sorted_BxC).at[rows_Bx1, order_BxC].set(accept_sorted_BxC)


def accept_in_order(entropy_BxC, sampled_BxC, bound: float, stop_token_ids: tuple[int, ...]):
  """Entropy-bounded acceptance [B, C] bool in which no stop token is kept while a position to
  its left is not (SamplerConfig.stop_in_order).

  The plain acceptance decides which positions are kept; a drawn stop token with an unkept
  position to its left is blocked, and the acceptance is taken again with the blocked positions
  out of the ranking (their entropy spends none of the bound). The leftmost position is never
  blocked, so every row keeps at least one position, as in the plain acceptance.
  """
  first_BxC = entropy_bounded_accept(entropy_BxC, bound)
  unkept_left_BxC = jnp.cumsum(~first_BxC, axis=-1) - (~first_BxC) > 0
  blocked_BxC = is_stop(sampled_BxC, stop_token_ids) & unkept_left_BxC
  ranked_BxC = jnp.where(blocked_BxC, jnp.inf, entropy_BxC)
  return entropy_bounded_accept(ranked_BxC, bound) & ~blocked_BxC


def over_token_limit(entropy_BxC, sampled_BxC, limit: int, free_BxC=None,
                     left_to_right: bool = False):
  """Positions a step may not keep under SamplerConfig.max_same_token_per_step, [B, C] bool.

  A position is over the limit when `limit` positions drawing the same token come before it in
  the acceptance's order: lower entropy, ties in position order (the order of
  `entropy_bounded_accept`), or further left under `left_to_right`. Only free positions count
  and can be over (`free_BxC`; infilling's fixed tokens are not free). The lowest-entropy
  position of a row is never over, so the acceptance still keeps one.
  """
  c = entropy_BxC.shape[-1]
  pos_C = jnp.arange(c)
  left_of_CxC = pos_C[None, :] < pos_C[:, None]  # [i, j]: j is left of i
  if left_to_right:
    before_BxCxC = jnp.broadcast_to(left_of_CxC, entropy_BxC.shape + (c,))
  else:
    e_i, e_j = entropy_BxC[:, :, None], entropy_BxC[:, None, :]
    before_BxCxC = (e_j < e_i) | ((e_j == e_i) & left_of_CxC)
  counted_BxCxC = before_BxCxC & (sampled_BxC[:, :, None] == sampled_BxC[:, None, :])
  if free_BxC is not None:
    counted_BxCxC &= free_BxC[:, None, :]
  over_BxC = jnp.sum(counted_BxCxC, axis=-1) >= limit
  return over_BxC if free_BxC is None else over_BxC & free_BxC


def init_stability_history(batch: int, canvas_length: int, cfg: SamplerConfig):
  """The last `stability_threshold` argmax canvases [S, B, C]; -1 so step one is never stable."""
  return jnp.full((cfg.stability_threshold, batch, canvas_length), -1, jnp.int32)


def stable_and_confident(history_SxBxC, argmax_BxC, tempered_logits_BxCxV, cfg: SamplerConfig,
                         entropy_BxC=None):
  """Adaptive stop: (stop_B, new history).

  stable: the new argmax canvas equals each of the last S ones (always true when S = 0);
  confident: mean over positions of the tempered-logit entropy < confidence_threshold.
  `entropy_BxC`, when given, is that entropy (the logits are then not read).
  """
  stable_B = jnp.all(history_SxBxC == argmax_BxC[None], axis=(0, 2))
  if cfg.stability_threshold > 0:
    history_SxBxC = jnp.concatenate([history_SxBxC[1:], argmax_BxC[None]], axis=0)
  if entropy_BxC is None:
    entropy_BxC = token_entropy(tempered_logits_BxCxV)
  mean_entropy_B = jnp.mean(entropy_BxC, axis=-1)
  return stable_B & (mean_entropy_B < cfg.confidence_threshold), history_SxBxC


def stop_ids(model_cfg: ModelConfig, sampler_cfg: SamplerConfig) -> tuple[int, ...]:
  """The ids that end a row: the model's EOS, then the sampler's extra stop ids."""
  return tuple(dict.fromkeys((model_cfg.eos_token_id,) + sampler_cfg.stop_token_ids))


def is_stop(tokens, stop_token_ids: tuple[int, ...]):
  """Elementwise: is the token one of `stop_token_ids` (the reference's `torch.isin`)."""
  return jnp.isin(tokens, jnp.asarray(stop_token_ids, jnp.int32))


def finalize_canvas(canvas_BxC, finished_B, budget_reached, model_cfg: ModelConfig,
                    stop_token_ids: tuple[int, ...] | None = None, stop_allowed_BxC=None):
  """EOS handling of a newly denoised canvas: (final canvas [B, C], finished [B]).

  Rows finished in earlier canvases get an all-pad canvas; in every row, tokens after the first
  EOS become pad (the EOS itself stays). A row finishes when its canvas (as denoised) holds an
  EOS or when the token budget is reached (`budget_reached`, a scalar bool). "EOS" is any of
  `stop_token_ids` (default: the model's eos_token_id alone) at a position where
  `stop_allowed_BxC` is True (default: everywhere; infilling: after the last fixed token).
  """
  if stop_token_ids is None:
    stop_token_ids = (model_cfg.eos_token_id,)
  pad = model_cfg.pad_token_id

  def stops(canvas_BxC):
    is_eos_BxC = is_stop(canvas_BxC, stop_token_ids)
    return is_eos_BxC if stop_allowed_BxC is None else is_eos_BxC & stop_allowed_BxC

  finished_now_B = jnp.any(stops(canvas_BxC), axis=-1) | budget_reached
  canvas_BxC = jnp.where(finished_B[:, None], pad, canvas_BxC)
  is_eos_BxC = stops(canvas_BxC)
  eos_count_BxC = jnp.cumsum(is_eos_BxC, axis=-1)
  after_eos_BxC = (eos_count_BxC > 0) & ~((eos_count_BxC == 1) & is_eos_BxC)
  return jnp.where(after_eos_BxC, pad, canvas_BxC), finished_B | finished_now_B


class DenoiseState(NamedTuple):
  """Loop state of one canvas's denoising.

  canvas_BxC: the noisy canvas fed to the next decoder pass.
  argmax_BxC: argmax of the last tempered logits (the canvas that gets committed).
  self_cond_BxCxV: the last tempered logits in the embedding dtype (self-conditioning input);
    [B, C, 0] with `fused_step`, which carries instead
  self_cond_embedding_BxCxD: the next step's self-conditioning embedding ([B, C, 0] unfused).
  history_SxBxC: argmax canvases for the stability test.
  finished_B: rows that stopped (or never needed to run); they are frozen.
  step: denoising steps taken so far (scalar int32); step remaining n = N - step.
  fixed_BxC, fixed_mask_BxC: infilling's clean tokens and where they sit (None: no infilling);
    they are never re-noised (`denoising_step`).
  """

  canvas_BxC: jax.Array
  argmax_BxC: jax.Array
  self_cond_BxCxV: jax.Array
  self_cond_embedding_BxCxD: jax.Array
  history_SxBxC: jax.Array
  finished_B: jax.Array
  step: jax.Array
  fixed_BxC: Any = None
  fixed_mask_BxC: Any = None


class StepOutput(NamedTuple):
  """What one step did, for bookkeeping and RL: rows that ran (active_B), the acceptance mask
  (False on inactive rows), the tempered logits (before the finished-row substitution) and their
  per-position entropy, the quantity the acceptance ranks (float32 [B, C], 0 on inactive rows)."""

  active_B: jax.Array
  accepted_BxC: jax.Array
  tempered_logits_BxCxV: jax.Array
  entropy_BxC: jax.Array


def _step_output(frozen_B, accepted_BxC, tempered_BxCxV, entropy_BxC) -> StepOutput:
  """A step's StepOutput; rows frozen before it report no acceptance and zero entropy."""
  frozen_Bx1 = frozen_B[:, None]
  return StepOutput(~frozen_B, accepted_BxC & ~frozen_Bx1, tempered_BxCxV,
                    jnp.where(frozen_Bx1, 0.0, entropy_BxC.astype(jnp.float32)))


def init_denoise_state(params, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, rng,
                       batch: int, finished_B=None, fixed=None) -> DenoiseState:
  """Uniform random canvas; argmax starts as that canvas (as the reference), no self-cond.
  `fixed` = (tokens_BxC, mask_BxC): infilling's clean tokens, placed where mask is True."""
  c, v = model_cfg.canvas_length, model_cfg.vocab_size
  canvas_BxC = jax.random.randint(rng, (batch, c), 0, v, jnp.int32)
  fixed_BxC = fixed_mask_BxC = None
  if fixed is not None:
    fixed_BxC, fixed_mask_BxC = fixed
    canvas_BxC = jnp.where(fixed_mask_BxC, fixed_BxC, canvas_BxC)
  if finished_B is None:
    finished_B = jnp.zeros((batch,), bool)
  return DenoiseState(
      canvas_BxC=canvas_BxC,
      argmax_BxC=canvas_BxC,
      self_cond_BxCxV=jnp.zeros((batch, c, 0 if sampler_cfg.fused_step else v),
                                params["embedding"].dtype),
      self_cond_embedding_BxCxD=jnp.zeros(
          (batch, c, model_cfg.hidden_size if sampler_cfg.fused_step else 0),
          model_cfg.compute_dtype),
      history_SxBxC=init_stability_history(batch, c, sampler_cfg),
      finished_B=finished_B,
      step=jnp.zeros((), jnp.int32),
      fixed_BxC=fixed_BxC, fixed_mask_BxC=fixed_mask_BxC)


def denoising_step(params, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, cache,
                   state: DenoiseState, rng) -> tuple[DenoiseState, StepOutput]:
  """One denoising step, exactly the reference `_denoising_step`.

  Decoder pass with the previous step's tempered logits as self-conditioning (none on the first
  step); temper by t_n; sample a candidate canvas from softmax(tempered); accept the entropy-
  bounded low-entropy positions and renoise the rest with fresh uniform tokens; rows already
  finished keep canvas, argmax and self-conditioning; then finished |= stable & confident.
  """
  if sampler_cfg.fused_step:
    return _fused_denoising_step(params, model_cfg, sampler_cfg, cache, state, rng)
  b = state.canvas_BxC.shape[0]
  sample_key, noise_key = jax.random.split(rng)
  sc_mask_B = jnp.broadcast_to(state.step > 0, (b,))
  logits_BxCxV = transformer.decode(params, model_cfg, state.canvas_BxC, cache, None,
                                    state.self_cond_BxCxV, sc_mask_B)
  tempered_BxCxV = logits_BxCxV / temperature(sampler_cfg.max_denoising_steps - state.step,
                                              sampler_cfg)
  # One log-softmax serves the draw, the acceptance and the stopping test.
  log_probs_BxCxV = jax.nn.log_softmax(tempered_BxCxV, axis=-1)
  entropy_BxC = _entropy(log_probs_BxCxV)
  sampled_BxC = sample_categorical(sample_key, log_probs_BxCxV)
  argmax_BxC = jnp.argmax(tempered_BxCxV, axis=-1).astype(jnp.int32)
  sampled_BxC, argmax_BxC, entropy_BxC = _clamp_fixed(state, sampled_BxC, argmax_BxC, entropy_BxC)
  canvas_BxC, argmax_BxC, accepted_BxC = _accept_and_renoise(
      state, sampled_BxC, argmax_BxC, entropy_BxC, noise_key, model_cfg, sampler_cfg)
  frozen_B = state.finished_B
  # Finished rows are judged (and self-conditioned) on their previous logits, as the reference.
  stop_logits_BxCxV = jnp.where(frozen_B[:, None, None],
                                state.self_cond_BxCxV.astype(jnp.float32), tempered_BxCxV)
  # A finished row stays finished whatever its stop test says, so the new entropy serves all.
  stop_B, history_SxBxC = stable_and_confident(state.history_SxBxC, argmax_BxC,
                                               stop_logits_BxCxV, sampler_cfg, entropy_BxC)
  new_state = DenoiseState(
      canvas_BxC=canvas_BxC,
      argmax_BxC=argmax_BxC,
      self_cond_BxCxV=stop_logits_BxCxV.astype(state.self_cond_BxCxV.dtype),
      self_cond_embedding_BxCxD=state.self_cond_embedding_BxCxD,
      history_SxBxC=history_SxBxC,
      finished_B=frozen_B | stop_B,
      step=state.step + 1,
      fixed_BxC=state.fixed_BxC, fixed_mask_BxC=state.fixed_mask_BxC)
  return new_state, _step_output(frozen_B, accepted_BxC, tempered_BxCxV, entropy_BxC)


def _clamp_fixed(state: DenoiseState, sampled_BxC, argmax_BxC, entropy_BxC):
  """Infilling: at fixed positions the draw and the argmax are the clean token and the entropy
  is 0 (it is certain), so the acceptance always keeps it, it spends none of the entropy bound
  and counts as confident in the stop test. A no-op without fixed tokens."""
  if state.fixed_mask_BxC is None:
    return sampled_BxC, argmax_BxC, entropy_BxC
  mask_BxC, fixed_BxC = state.fixed_mask_BxC, state.fixed_BxC
  return (jnp.where(mask_BxC, fixed_BxC, sampled_BxC), jnp.where(mask_BxC, fixed_BxC, argmax_BxC),
          jnp.where(mask_BxC, 0.0, entropy_BxC))


def _accept_and_renoise(state: DenoiseState, sampled_BxC, argmax_BxC, entropy_BxC, noise_key,
                        model_cfg: ModelConfig, sampler_cfg: SamplerConfig):
  """Keep the entropy-bounded accepted draws, renoise the rest with uniform tokens; finished
  rows keep their canvas and argmax. Returns (canvas_BxC, argmax_BxC, accepted_BxC)."""
  left_to_right = sampler_cfg.acceptance == ACCEPT_LEFT_TO_RIGHT
  ranked_BxC, over_BxC = entropy_BxC, None
  if sampler_cfg.max_same_token_per_step:
    free_BxC = None if state.fixed_mask_BxC is None else ~state.fixed_mask_BxC
    over_BxC = over_token_limit(entropy_BxC, sampled_BxC, sampler_cfg.max_same_token_per_step,
                                free_BxC, left_to_right)
    # Out of the ranking: they spend none of the bound (and end a left run).
    ranked_BxC = jnp.where(over_BxC, jnp.inf, entropy_BxC)
  if left_to_right:  # a left run: stops are in order already
    accepted_BxC = entropy_bounded_accept(ranked_BxC, sampler_cfg.entropy_bound,
                                          left_to_right=True)
  elif sampler_cfg.stop_in_order:
    accepted_BxC = accept_in_order(ranked_BxC, sampled_BxC, sampler_cfg.entropy_bound,
                                   stop_ids(model_cfg, sampler_cfg))
  else:
    accepted_BxC = entropy_bounded_accept(ranked_BxC, sampler_cfg.entropy_bound)
  if over_BxC is not None:
    accepted_BxC &= ~over_BxC
  noise_BxC = jax.random.randint(noise_key, sampled_BxC.shape, 0, model_cfg.vocab_size,
                                 jnp.int32)
  canvas_BxC = jnp.where(accepted_BxC, sampled_BxC, noise_BxC)
  frozen_Bx1 = state.finished_B[:, None]
  return (jnp.where(frozen_Bx1, state.canvas_BxC, canvas_BxC),
          jnp.where(frozen_Bx1, state.argmax_BxC, argmax_BxC), accepted_BxC)


def fused_sample(params, model_cfg: ModelConfig, tempered_BxCxV, rng, top_k: int = 0):
  """Everything a step needs from the tempered logits, from one softmax of them.

  Returns (sampled_BxC, argmax_BxC, entropy_BxC, self_cond_embedding_BxCxD). With top_k > 0 the
  distribution is truncated to the top_k logits and renormalised: the draw, the entropy and the
  embedding (top_k gathered rows instead of a [V, D] matmul) all use the truncated one; the
  argmax is unchanged. top_k >= V truncates nothing: the same program as top_k = 0.
  """
  if 0 < top_k < tempered_BxCxV.shape[-1]:
    top_logits_BxCxK, top_ids_BxCxK = jax.lax.top_k(tempered_BxCxV, top_k)
    log_probs_BxCxK = jax.nn.log_softmax(top_logits_BxCxK, axis=-1)
    choice_BxC = sample_categorical(rng, log_probs_BxCxK)
    sampled_BxC = jnp.take_along_axis(top_ids_BxCxK, choice_BxC[..., None], -1)[..., 0]
    return (sampled_BxC.astype(jnp.int32), top_ids_BxCxK[..., 0].astype(jnp.int32),
            _entropy(log_probs_BxCxK),
            transformer.soft_embedding(params, jnp.exp(log_probs_BxCxK), model_cfg, top_ids_BxCxK))
  log_probs_BxCxV = jax.nn.log_softmax(tempered_BxCxV, axis=-1)
  return (sample_categorical(rng, log_probs_BxCxV),
          jnp.argmax(tempered_BxCxV, axis=-1).astype(jnp.int32), _entropy(log_probs_BxCxV),
          transformer.soft_embedding(params, jnp.exp(log_probs_BxCxV), model_cfg))


def _fused_denoising_step(params, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, cache,
                          state: DenoiseState, rng) -> tuple[DenoiseState, StepOutput]:
  """`denoising_step` with `fused_sample`: same semantics, self-conditioning carried as the
  [B, C, D] embedding, and the [C, V] probabilities computed once."""
  b = state.canvas_BxC.shape[0]
  sample_key, noise_key = jax.random.split(rng)
  sc_mask_B = jnp.broadcast_to(state.step > 0, (b,))
  logits_BxCxV = transformer.decode(params, model_cfg, state.canvas_BxC, cache, None, None,
                                    sc_mask_B, state.self_cond_embedding_BxCxD)
  tempered_BxCxV = logits_BxCxV / temperature(sampler_cfg.max_denoising_steps - state.step,
                                              sampler_cfg)
  sampled_BxC, argmax_BxC, entropy_BxC, embedding_BxCxD = fused_sample(
      params, model_cfg, tempered_BxCxV, sample_key, sampler_cfg.top_k)
  sampled_BxC, argmax_BxC, entropy_BxC = _clamp_fixed(state, sampled_BxC, argmax_BxC, entropy_BxC)
  canvas_BxC, argmax_BxC, accepted_BxC = _accept_and_renoise(
      state, sampled_BxC, argmax_BxC, entropy_BxC, noise_key, model_cfg, sampler_cfg)
  frozen_B = state.finished_B
  embedding_BxCxD = jnp.where(frozen_B[:, None, None], state.self_cond_embedding_BxCxD,
                              embedding_BxCxD.astype(state.self_cond_embedding_BxCxD.dtype))
  # A finished row stays finished whatever its stop test says (see denoising_step).
  stop_B, history_SxBxC = stable_and_confident(state.history_SxBxC, argmax_BxC, None,
                                               sampler_cfg, entropy_BxC)
  new_state = state._replace(
      canvas_BxC=canvas_BxC, argmax_BxC=argmax_BxC, self_cond_embedding_BxCxD=embedding_BxCxD,
      history_SxBxC=history_SxBxC, finished_B=frozen_B | stop_B, step=state.step + 1)
  return new_state, _step_output(frozen_B, accepted_BxC, tempered_BxCxV, entropy_BxC)


def denoise_canvas(params, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, cache, rng,
                   row_done_B=None, fixed=None):
  """Denoise one canvas after the cached prefix, in one `lax.while_loop`.

  Args:
    cache: the encoder cache; the canvas sits at slots [cache['end'], end + C).
    row_done_B: rows whose sequence already ended: frozen from the start, no passes counted.
    fixed: infilling's (tokens_BxC, mask_BxC): clean tokens that stay as given (never
      re-noised; the returned canvas holds them).
  Returns:
    (argmax_canvas_BxC, stats) with stats['num_steps'] [B] int32 (decoder passes per row); with
    `ar_fallback`, stats['fallback'] [B] bool: rows that met the rule (and did not denoise
    further); when `record_trajectory`, stats['trajectory'] = {canvas [N,B,C] (each step's input),
    argmax [N,B,C] (each step's output), accepted [N,B,C], entropy [N,B,C] (float32, the
    tempered entropy the acceptance ranked), valid [N,B] (row ran that step)}.
  """
  b = cache["valid"].shape[0]
  n_max, c = sampler_cfg.max_denoising_steps, model_cfg.canvas_length
  init_key, loop_key = jax.random.split(rng)
  state = init_denoise_state(params, model_cfg, sampler_cfg, init_key, b, row_done_B, fixed)
  steps_B = jnp.zeros((b,), jnp.int32)
  by_entropy = sampler_cfg.ar_fallback == FALLBACK_ENTROPY
  fallback_B = jnp.zeros((b,), bool)
  traj = None
  if sampler_cfg.record_trajectory:
    traj = {"canvas": jnp.zeros((n_max, b, c), jnp.int32),
            "argmax": jnp.zeros((n_max, b, c), jnp.int32),
            "accepted": jnp.zeros((n_max, b, c), bool),
            "entropy": jnp.zeros((n_max, b, c), jnp.float32),
            "valid": jnp.zeros((n_max, b), bool)}

  def cond(carry):
    state = carry[0]
    return (state.step < n_max) & ~jnp.all(state.finished_B)

  def body(carry):
    state, steps_B, traj, fallback_B = carry
    # fold_in by step: each step's randomness is independent of when the loop exits.
    new_state, out = denoising_step(params, model_cfg, sampler_cfg, cache, state,
                                    jax.random.fold_in(loop_key, state.step))
    if by_entropy:
      # After k steps, a row still uncertain leaves the loop for AR decoding (frozen here).
      hit_B = (out.active_B & ~new_state.finished_B
               & (new_state.step == sampler_cfg.ar_fallback_after_steps)
               & (jnp.mean(out.entropy_BxC, axis=-1) > sampler_cfg.ar_fallback_entropy))
      fallback_B = fallback_B | hit_B
      new_state = new_state._replace(finished_B=new_state.finished_B | hit_B)
    if traj is not None:
      put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, state.step, 0)
      traj = {"canvas": put(traj["canvas"], state.canvas_BxC),
              "argmax": put(traj["argmax"], new_state.argmax_BxC),
              "accepted": put(traj["accepted"], out.accepted_BxC),
              "entropy": put(traj["entropy"], out.entropy_BxC),
              "valid": put(traj["valid"], out.active_B)}
    return new_state, steps_B + out.active_B.astype(jnp.int32), traj, fallback_B

  state, steps_B, traj, fallback_B = jax.lax.while_loop(cond, body,
                                                        (state, steps_B, traj, fallback_B))
  stats = {"num_steps": steps_B}
  if sampler_cfg.ar_fallback == FALLBACK_UNCONVERGED:
    stats["fallback"] = ~state.finished_B  # ran all N steps without the adaptive stop
  elif by_entropy:
    stats["fallback"] = fallback_B
  if traj is not None:
    stats["trajectory"] = traj
  return state.argmax_BxC, stats


# ----------------------------------------------------------------------------- generation


@struct.dataclass(kw_only=True)
class GenerateOutput:
  """What `generate` returns (a pytree: jit returns it, `jax.tree_util` maps over it).

  Every mode fills:
    tokens [B, K*C] int32: the reply slots, pad after a row's end;
    num_tokens [B] int32: generated non-pad tokens (infilling's fixed ones not counted);
    decoder_passes [B] int32: denoising forwards (AR, and the AR fallback's canvases:
      token-producing forwards);
    commit_passes [B] int32: canvas commits the row needed (AR: 0);
    num_canvases [B] int32: canvases the row ran (AR: canvas-sized blocks it wrote into);
    steps_per_canvas [B] float32 = decoder_passes / num_canvases;
    tokens_per_forward [B] float32 = num_tokens / decoder_passes (TPF, the reference's).
  The rest are None where the mode does not fill them:
    canvas_steps [B, K] int32: denoising steps of each canvas (diffusion);
    ar_canvases [B] int32, ar_passes [B] int32, canvas_ar [B, K] bool: canvases decoded left to
      right, their token-producing forwards (already in decoder_passes) and which canvases
      (diffusion with `ar_fallback`);
    trajectory: {canvas, argmax int32, accepted bool, entropy float32: [K, N, B, C]; valid bool
      [K, N, B]}, every denoising step of every canvas (diffusion with `record_trajectory`;
      `denoise_canvas` says what each holds).
  """

  tokens: jax.Array
  num_tokens: jax.Array
  decoder_passes: jax.Array
  commit_passes: jax.Array
  num_canvases: jax.Array
  steps_per_canvas: jax.Array
  tokens_per_forward: jax.Array
  canvas_steps: jax.Array | None = None
  ar_canvases: jax.Array | None = None
  ar_passes: jax.Array | None = None
  canvas_ar: jax.Array | None = None
  trajectory: dict[str, jax.Array] | None = None

  def to_dict(self) -> dict[str, Any]:
    """{field: value} of the fields this mode filled (None ones dropped)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None}


def _output(model_cfg: ModelConfig, sampler_cfg: SamplerConfig, tokens_BxL, decoder_passes_B,
            commit_passes_B, canvases_B, given_BxL=None, **optional) -> GenerateOutput:
  """The GenerateOutput of a finished generation, its per-row ratios derived (TPF = generated
  non-pad tokens / decoder passes, the reference's) and checked (`_check_output`).
  `given_BxL` (infilling's fixed slots) are not generated, so not counted; `optional`: the
  fields this mode fills beyond every mode's."""
  generated_BxL = tokens_BxL != model_cfg.pad_token_id
  if given_BxL is not None:
    generated_BxL &= ~given_BxL
  num_tokens_B = jnp.sum(generated_BxL, axis=-1).astype(jnp.int32)
  out = GenerateOutput(
      tokens=tokens_BxL, num_tokens=num_tokens_B, decoder_passes=decoder_passes_B,
      commit_passes=commit_passes_B, num_canvases=canvases_B,
      steps_per_canvas=decoder_passes_B / jnp.maximum(canvases_B, 1),
      tokens_per_forward=num_tokens_B / jnp.maximum(decoder_passes_B, 1), **optional)
  _check_output(out, model_cfg, sampler_cfg)
  return out


def _check_output(out: GenerateOutput, model_cfg: ModelConfig, sampler_cfg: SamplerConfig):
  """Every field's shape and dtype as GenerateOutput states them, and exactly the optional
  fields this mode fills (static under jit: shapes, dtypes and None-ness only)."""
  b = out.tokens.shape[0]
  k, c = num_canvases(model_cfg, sampler_cfg), model_cfg.canvas_length
  n = sampler_cfg.max_denoising_steps
  chex.assert_shape(out.tokens, (b, k * c))
  chex.assert_type(out.tokens, jnp.int32)
  counts_B = [out.num_tokens, out.decoder_passes, out.commit_passes, out.num_canvases]
  ratios_B = [out.steps_per_canvas, out.tokens_per_forward]
  chex.assert_shape(counts_B + ratios_B, (b,))
  chex.assert_type(counts_B, jnp.int32)
  chex.assert_type(ratios_B, jnp.float32)
  diffusion, fallback = sampler_cfg.mode == DIFFUSION, bool(sampler_cfg.ar_fallback)
  expected = {"canvas_steps": diffusion, "ar_canvases": fallback, "ar_passes": fallback,
              "canvas_ar": fallback, "trajectory": diffusion and sampler_cfg.record_trajectory}
  filled = {name: getattr(out, name) is not None for name in expected}
  if filled != expected:
    raise AssertionError(f"GenerateOutput fields filled {filled}, expected {expected}")
  if diffusion:
    chex.assert_shape(out.canvas_steps, (b, k))
    chex.assert_type(out.canvas_steps, jnp.int32)
  if fallback:
    chex.assert_shape([out.ar_canvases, out.ar_passes], (b,))
    chex.assert_type([out.ar_canvases, out.ar_passes], jnp.int32)
    chex.assert_shape(out.canvas_ar, (b, k))
    chex.assert_type(out.canvas_ar, bool)
  if out.trajectory is not None:
    traj = out.trajectory
    names = ("canvas", "argmax", "accepted", "entropy")
    chex.assert_shape([traj[name] for name in names], (k, n, b, c))
    chex.assert_shape(traj["valid"], (k, n, b))
    chex.assert_type([traj[name] for name in names + ("valid",)],
                     [jnp.int32, jnp.int32, bool, jnp.float32, bool])


def _generate_diffusion(params, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, cache,
                        batch: int, rng, last_logits_BxV=None, fixed=None):
  """Block-autoregressive canvases after an encoded prompt (see `generate`). With
  `ar_fallback`, `last_logits_BxV` (the next-token logits after the prompt) starts the AR
  decoding of a canvas that falls back; every commit then keeps its own last logits. `fixed`:
  infilling's (tokens_BxL, mask_BxL) over the K*C reply slots (see `generate`). Returns a
  GenerateOutput with canvas_steps (and the fallback's fields, and the trajectory, when
  configured)."""
  c, k_max = model_cfg.canvas_length, num_canvases(model_cfg, sampler_cfg)
  n_max = sampler_cfg.max_denoising_steps
  fallback = bool(sampler_cfg.ar_fallback)
  if fixed is not None:
    # A reply cannot end before its last fixed token (a stop id drawn in the middle stays a
    # token), so the supplied suffix is never cut off.
    fixed_stop_allowed_BxL = jnp.cumsum(fixed[1][:, ::-1], axis=1)[:, ::-1] == 0
  zeros_B = jnp.zeros((batch,), jnp.int32)
  carry = {
      "k": jnp.zeros((), jnp.int32), "cache": cache,
      "tokens": jnp.full((batch, k_max * c), model_cfg.pad_token_id, jnp.int32),
      "finished": jnp.zeros((batch,), bool), "passes": zeros_B, "commits": zeros_B,
      "canvases": zeros_B, "canvas_steps": jnp.zeros((batch, k_max), jnp.int32)}
  if fallback:
    carry.update(logits=last_logits_BxV.astype(jnp.float32), ar_canvases=zeros_B,
                 ar_passes=zeros_B, canvas_ar=jnp.zeros((batch, k_max), bool))
  if sampler_cfg.record_trajectory:
    carry["trajectory"] = {
        "canvas": jnp.zeros((k_max, n_max, batch, c), jnp.int32),
        "argmax": jnp.zeros((k_max, n_max, batch, c), jnp.int32),
        "accepted": jnp.zeros((k_max, n_max, batch, c), bool),
        "entropy": jnp.zeros((k_max, n_max, batch, c), jnp.float32),
        "valid": jnp.zeros((k_max, n_max, batch), bool)}

  def cond(carry):
    return (carry["k"] < k_max) & ~jnp.all(carry["finished"])

  def body(carry):
    k, finished_B = carry["k"], carry["finished"]
    fixed_k = stop_allowed_BxC = None
    if fixed is not None:
      fixed_k = tuple(jax.lax.dynamic_slice_in_dim(x, k * c, c, axis=1) for x in fixed)
      stop_allowed_BxC = jax.lax.dynamic_slice_in_dim(fixed_stop_allowed_BxL, k * c, c, axis=1)
    canvas_BxC, stats = denoise_canvas(params, model_cfg, sampler_cfg, carry["cache"],
                                       jax.random.fold_in(rng, k), finished_B, fixed_k)
    if fallback:
      ar_B = stats["fallback"] & ~finished_B
      # The AR pass writes a copy of the cache; the canvas is then committed as any other.
      canvas_BxC, ar_passes_B = jax.lax.cond(
          jnp.any(ar_B),
          lambda: ar_canvas(params, model_cfg, sampler_cfg, carry["cache"], carry["logits"],
                            ar_B, canvas_BxC, jax.random.fold_in(jax.random.fold_in(rng, k), 1),
                            fixed_k, stop_allowed_BxC),
          lambda: (canvas_BxC, zeros_B))
    budget_reached = (k + 1) * c >= sampler_cfg.max_new_tokens
    canvas_BxC, new_finished_B = finalize_canvas(canvas_BxC, finished_B, budget_reached,
                                                 model_cfg, stop_ids(model_cfg, sampler_cfg),
                                                 stop_allowed_BxC)
    # Commit the final canvas (pads included, all attended, as the reference) only when another
    # canvas follows: the last canvas is never encoded.
    if fallback:
      def commit(args):
        hidden_BxCxD, cache = transformer.encode(params, model_cfg, canvas_BxC, args[0])
        return cache, transformer.lm_head(params, hidden_BxCxD[:, -1], model_cfg).astype(
            jnp.float32)

      cache, logits_BxV = jax.lax.cond(jnp.all(new_finished_B), lambda args: args, commit,
                                       (carry["cache"], carry["logits"]))
    else:
      cache = jax.lax.cond(
          jnp.all(new_finished_B), lambda cache: cache,
          lambda cache: transformer.encode(params, model_cfg, canvas_BxC, cache)[1], carry["cache"])
    new = dict(carry)
    new.update(
        k=k + 1, cache=cache, finished=new_finished_B,
        tokens=jax.lax.dynamic_update_slice(carry["tokens"], canvas_BxC, (0, k * c)),
        passes=carry["passes"] + stats["num_steps"],
        commits=carry["commits"] + (~new_finished_B).astype(jnp.int32),
        canvases=carry["canvases"] + (~finished_B).astype(jnp.int32),
        canvas_steps=carry["canvas_steps"].at[:, k].set(stats["num_steps"]))
    if fallback:
      new.update(logits=logits_BxV, passes=new["passes"] + ar_passes_B,
                 ar_canvases=carry["ar_canvases"] + ar_B.astype(jnp.int32),
                 ar_passes=carry["ar_passes"] + ar_passes_B,
                 canvas_ar=carry["canvas_ar"].at[:, k].set(ar_B))
    if sampler_cfg.record_trajectory:
      new["trajectory"] = jax.tree_util.tree_map(
          lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, k, 0),
          carry["trajectory"], stats["trajectory"])
    return new

  carry = jax.lax.while_loop(cond, body, carry)
  optional = {"canvas_steps": carry["canvas_steps"]}
  if fallback:
    optional.update(ar_canvases=carry["ar_canvases"], ar_passes=carry["ar_passes"],
                    canvas_ar=carry["canvas_ar"])
  if sampler_cfg.record_trajectory:
    optional["trajectory"] = carry["trajectory"]
  return _output(model_cfg, sampler_cfg, carry["tokens"], carry["passes"], carry["commits"],
                 carry["canvases"], None if fixed is None else fixed[1], **optional)


def ar_canvas(params, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, cache,
              last_logits_BxV, rows_B, canvas_BxC, rng, fixed=None, stop_allowed_BxC=None):
  """AR fallback: rows `rows_B` of the canvas at cache['end'] decoded left to right through
  the encoder's next-token head, exactly as mode="ar" decodes (`ar_next_token`, `ar_forward`);
  other rows keep `canvas_BxC`. A row stops at a stop id (pad after it). `cache` is not
  returned: the caller commits the finished canvas as any other. Infilling: `fixed`
  (tokens_BxC, mask_BxC) slots emit their fixed token, and a stop id counts only where
  `stop_allowed_BxC`.

  Returns (canvas_BxC, ar_passes_B): token-producing forwards per row, counted as mode="ar"
  counts them (one per token emitted; 0 for rows not decoded).
  """
  c = model_cfg.canvas_length
  stops, pad = stop_ids(model_cfg, sampler_cfg), model_cfg.pad_token_id

  def cond(carry):
    return (carry["t"] < c) & ~jnp.all(carry["done"])

  def body(carry):
    t, done_B = carry["t"], carry["done"]
    token_B = ar_next_token(carry["logits"], t, rng, sampler_cfg)
    stop_B = is_stop(token_B, stops)
    if fixed is not None:
      token_B = jnp.where(fixed[1][:, t], fixed[0][:, t], token_B)
      stop_B = is_stop(token_B, stops) & stop_allowed_BxC[:, t]
    token_B = jnp.where(done_B, pad, token_B)
    new_done_B = done_B | stop_B
    # No encoder pass after the canvas's last token (the commit encodes the whole canvas).
    cache, logits_BxV = jax.lax.cond(
        jnp.all(new_done_B) | (t + 1 >= c), lambda args: args,
        lambda args: ar_forward(params, model_cfg, args[0], token_B),
        (carry["cache"], carry["logits"]))
    return {"t": t + 1, "cache": cache, "logits": logits_BxV.astype(jnp.float32),
            "done": new_done_B,
            "tokens": jax.lax.dynamic_update_index_in_dim(carry["tokens"], token_B, t, 1),
            "passes": carry["passes"] + (~done_B).astype(jnp.int32)}

  carry = {"t": jnp.zeros((), jnp.int32), "cache": cache,
           "logits": last_logits_BxV.astype(jnp.float32), "done": ~rows_B,
           "tokens": jnp.full(canvas_BxC.shape, pad, jnp.int32),
           "passes": jnp.zeros(rows_B.shape, jnp.int32)}
  carry = jax.lax.while_loop(cond, body, carry)
  return jnp.where(rows_B[:, None], carry["tokens"], canvas_BxC), carry["passes"]


def ar_next_token(logits_BxV, t, rng, sampler_cfg: SamplerConfig):
  """The next AR token from next-token logits: argmax (ar_temperature 0) or a draw at
  ar_temperature with key fold_in(rng, t); int32 [B]."""
  if sampler_cfg.ar_temperature == 0.0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  return jax.random.categorical(jax.random.fold_in(rng, t),
                                logits_BxV / sampler_cfg.ar_temperature).astype(jnp.int32)


def ar_forward(params, model_cfg: ModelConfig, cache, token_B):
  """One encoder pass over one token per row: (cache with it appended, next-token logits
  [B, V])."""
  hidden, cache = transformer.encode(params, model_cfg, token_B[:, None], cache)
  return cache, transformer.lm_head(params, hidden[:, -1], model_cfg)


def settle_steps(trajectory):
  """When each canvas's argmax stopped changing: int32 [K, B], the 1-based step from which every
  later step's argmax canvas equals the final one (0 where the row did not run canvas k).

  Steps after it (steps_run - settle) were spent only on the stopping rule (confidence and
  stability), not on changing the answer. `trajectory`: a recorded trajectory (argmax
  [K, N, B, C], valid [K, N, B]).
  """
  argmax_KxNxBxC, valid_KxNxB = trajectory["argmax"], trajectory["valid"]
  steps_KxB = jnp.sum(valid_KxNxB, axis=1).astype(jnp.int32)
  last_KxBxC = jnp.take_along_axis(argmax_KxNxBxC,
                                   jnp.maximum(steps_KxB - 1, 0)[:, None, :, None], axis=1)
  differs_KxNxB = jnp.any(argmax_KxNxBxC != last_KxBxC, axis=-1) & valid_KxNxB
  n_1xNx1 = jnp.arange(argmax_KxNxBxC.shape[1])[None, :, None]
  last_change_KxB = jnp.max(jnp.where(differs_KxNxB, n_1xNx1, -1), axis=1)
  return jnp.where(steps_KxB > 0, last_change_KxB + 2, 0).astype(jnp.int32)


def _generate_ar(params, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, cache,
                 last_logits_BxV, rng):
  """Left-to-right decoding through the encoder: one token per encoder pass (see `generate`);
  a GenerateOutput without the diffusion-only fields."""
  batch = last_logits_BxV.shape[0]
  c, k_max = model_cfg.canvas_length, num_canvases(model_cfg, sampler_cfg)
  max_new = sampler_cfg.max_new_tokens
  stops, pad = stop_ids(model_cfg, sampler_cfg), model_cfg.pad_token_id

  def cond(carry):
    return (carry["t"] < max_new) & ~jnp.all(carry["done"])

  def body(carry):
    t, done_B = carry["t"], carry["done"]
    token_B = jnp.where(done_B, pad, ar_next_token(carry["logits"], t, rng, sampler_cfg))
    new_done_B = done_B | is_stop(token_B, stops)
    # No encoder pass after the last token.
    cache, logits_BxV = jax.lax.cond(
        jnp.all(new_done_B) | (t + 1 >= max_new), lambda args: args,
        lambda args: ar_forward(params, model_cfg, args[0], token_B),
        (carry["cache"], carry["logits"]))
    return {"t": t + 1, "cache": cache, "logits": logits_BxV, "done": new_done_B,
            "tokens": jax.lax.dynamic_update_index_in_dim(carry["tokens"], token_B, t, 1),
            "passes": carry["passes"] + (~done_B).astype(jnp.int32)}

  carry = {"t": jnp.zeros((), jnp.int32), "cache": cache, "logits": last_logits_BxV,
           "done": jnp.zeros((batch,), bool),
           "tokens": jnp.full((batch, k_max * c), pad, jnp.int32),
           "passes": jnp.zeros((batch,), jnp.int32)}
  carry = jax.lax.while_loop(cond, body, carry)
  passes_B = carry["passes"]
  # Canvas-sized blocks the row wrote into, so the stats keep one format across modes.
  canvases_B = (passes_B + c - 1) // c
  return _output(model_cfg, sampler_cfg, carry["tokens"], passes_B, jnp.zeros_like(passes_B),
                 canvases_B)


def generate(params, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, prompt_BxP,
             prompt_valid_BxP=None, rng=None, fixed_BxL=None, fixed_mask_BxL=None,
             images: vision.Images | None = None) -> GenerateOutput:
  """Generate after a (left-padded) prompt; jittable with configs static (`make_generate_fn`).

  Allocates a cache of P + K*C slots (K = ceil(max_new_tokens / C)), encodes the prompt (pads
  masked out; positions are slot indices, as the reference), then either
    diffusion: per canvas, `denoise_canvas`, `finalize_canvas`, and one encoder pass to commit
      it; rows stop at EOS (or a `stop_token_ids` id) or the budget; the loop stops when every
      row has; or
    ar: one token per encoder pass from the last hidden state (greedy or `ar_temperature`).
  Returns a GenerateOutput: the tokens and per-row statistics; the fields only some modes fill
  (canvas_steps, the AR fallback's, the trajectory) are None in the others.
  Infilling (diffusion mode): `fixed_BxL` int32 and `fixed_mask_BxL` bool over the K*C reply
  slots give clean tokens (e.g. a prefix and a suffix, `infill_slots`) that sit in their
  canvases from the start and are never re-noised; a stop id before a row's last fixed slot
  does not end the row. The tokens returned hold them unchanged; num_tokens (and so TPF) counts
  only the generated ones. None: no infilling (the program is today's).
  Images (a model with a vision tower): the prompt's, as `transformer.encode` takes them; they
  are encoded once with the prompt, and every mode reads them through the cache.
  """
  batch, prompt_len = prompt_BxP.shape
  if prompt_valid_BxP is None:
    prompt_valid_BxP = jnp.ones((batch, prompt_len), bool)
  if rng is None:
    rng = jax.random.PRNGKey(0)
  max_len = prompt_len + num_canvases(model_cfg, sampler_cfg) * model_cfg.canvas_length
  cache = transformer.init_cache(model_cfg, batch, max_len)
  hidden_BxPxD, cache = transformer.encode(params, model_cfg, prompt_BxP.astype(jnp.int32),
                                           cache, prompt_valid_BxP.astype(bool), images)
  fixed = None
  if fixed_BxL is not None:
    if sampler_cfg.mode == AR:
      raise ValueError("infilling needs mode='diffusion'")
    fixed = (jnp.asarray(fixed_BxL, jnp.int32), jnp.asarray(fixed_mask_BxL, bool))
  if sampler_cfg.mode == AR:
    last_logits_BxV = transformer.lm_head(params, hidden_BxPxD[:, -1], model_cfg)
    return _generate_ar(params, model_cfg, sampler_cfg, cache, last_logits_BxV, rng)
  if sampler_cfg.ar_fallback:
    last_logits_BxV = transformer.lm_head(params, hidden_BxPxD[:, -1], model_cfg)
    return _generate_diffusion(params, model_cfg, sampler_cfg, cache, batch, rng,
                               last_logits_BxV, fixed)
  return _generate_diffusion(params, model_cfg, sampler_cfg, cache, batch, rng, fixed=fixed)


def make_generate_fn(model_cfg: ModelConfig, sampler_cfg: SamplerConfig):
  """`fn(params, prompt_BxP, prompt_valid_BxP, rng, fixed_BxL=None, fixed_mask_BxL=None,
  images=None) -> GenerateOutput`, jitted for these configs (the fixed tokens: infilling; images:
  a vision model's prompt images; see `generate`). Given images, the prompt's placeholders are
  checked against them first (`vision.check_image_tokens`, one line)."""
  jitted = jax.jit(generate, static_argnums=(1, 2))

  def generate_fn(params, prompt_BxP, prompt_valid_BxP, rng, fixed_BxL=None,
                  fixed_mask_BxL=None, images: vision.Images | None = None):
    if images is not None:
      vision.check_image_tokens(prompt_BxP, images, model_cfg)
    return jitted(params, model_cfg, sampler_cfg, prompt_BxP, prompt_valid_BxP, rng, fixed_BxL,
                  fixed_mask_BxL, images)

  return generate_fn


def infill_slots(prefix_ids, suffix_ids, middle_len: int, num_slots: int, pad_id: int):
  """The fixed tokens of an infill over `num_slots` (K*C) reply slots: the prefix at slots
  [0, len(prefix)), the middle (generated) at the next `middle_len`, the suffix right after it;
  the slots after the suffix are generated too (the reply's end). Returns (tokens_L int32,
  mask_L bool), numpy; ValueError (one line) if they do not fit."""
  prefix, suffix = list(prefix_ids), list(suffix_ids)
  if middle_len < 0:
    raise ValueError(f"the middle length must be >= 0 (got {middle_len})")
  if not suffix:
    raise ValueError("infilling needs a suffix (an empty one is plain generation)")
  end = len(prefix) + middle_len + len(suffix)
  if end > num_slots:
    raise ValueError(f"prefix ({len(prefix)}) + middle ({middle_len}) + suffix ({len(suffix)}) "
                     f"tokens exceed the {num_slots} reply slots; raise max_new_tokens")
  tokens_L = np.full(num_slots, pad_id, np.int32)
  mask_L = np.zeros(num_slots, bool)
  tokens_L[:len(prefix)], mask_L[:len(prefix)] = prefix, True
  tokens_L[end - len(suffix):end], mask_L[end - len(suffix):end] = suffix, True
  return tokens_L, mask_L


def infill(params, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, prompt_BxP,
           prompt_valid_BxP, prefix_ids, suffix_ids, middle_len: int, rng=None,
           images: vision.Images | None = None) -> GenerateOutput:
  """Generate the middle between a prefix and a suffix (the same for every row) after each
  prompt (and its images): `generate` with `infill_slots` fixed; jitted for these configs. The
  returned tokens hold the prefix, the middle (`tokens[:, len(prefix):len(prefix) +
  middle_len]`), the suffix unchanged, then whatever the reply ends with."""
  tokens_L, mask_L = infill_slots(prefix_ids, suffix_ids, middle_len,
                                  num_canvases(model_cfg, sampler_cfg) * model_cfg.canvas_length,
                                  model_cfg.pad_token_id)
  b = np.asarray(prompt_BxP).shape[0]
  fn = make_generate_fn(model_cfg, sampler_cfg)
  return fn(params, prompt_BxP, prompt_valid_BxP, jax.random.PRNGKey(0) if rng is None else rng,
            np.repeat(tokens_L[None], b, 0), np.repeat(mask_L[None], b, 0), images)
