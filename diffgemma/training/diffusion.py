"""The multinomial (uniform-state) forward process: no mask token, noise is a uniform token."""

from __future__ import annotations

import jax
import jax.numpy as jnp

SCHEDULES = ("linear", "cosine")
# How t is drawn: "uniform" U(eps, 1) (the report's objective), or "sqrt" (t = sqrt(u) with
# u ~ U(eps, 1): density 2t, more training near pure noise, where sampling starts).
T_DISTRIBUTIONS = ("uniform", "sqrt")


def alpha(t_B, schedule: str):
  """Probability that a token survives to noise level t (alpha(0) = 1, alpha(1) = 0)."""
  if schedule == "linear":
    return 1.0 - t_B
  if schedule == "cosine":
    return jnp.cos(0.5 * jnp.pi * t_B)
  raise ValueError(f"unknown noise schedule {schedule!r}; choose one of {SCHEDULES}")


def sample_noise_level(rng, batch: int, eps: float, distribution: str = "uniform"):
  """t per example, [batch]: U(eps, 1), or its square root under "sqrt" (T_DISTRIBUTIONS); eps
  keeps the fully clean end out of the objective."""
  u_B = jax.random.uniform(rng, (batch,), minval=eps, maxval=1.0)
  if distribution == "uniform":
    return u_B
  if distribution == "sqrt":
    return jnp.sqrt(u_B)
  raise ValueError(f"unknown noise-level distribution {distribution!r}; choose one of "
                   f"{T_DISTRIBUTIONS}")


def corrupt(rng, tokens_BxC, t_B, vocab_size: int, schedule: str, corruptible_BxC=None,
            always_BxC=None):
  """Keep each token with probability alpha(t), else replace it by a uniform vocabulary token.

  Only `corruptible_BxC` positions (the supervised ones) are touched; the rest stay clean.
  `always_BxC` positions are replaced whatever t is (the same draws: None changes nothing).
  """
  keep_rng, noise_rng = jax.random.split(rng)
  keep_prob_B = alpha(t_B, schedule)
  keep_BxC = jax.random.uniform(keep_rng, tokens_BxC.shape) < keep_prob_B[:, None]
  if corruptible_BxC is not None:
    keep_BxC |= ~corruptible_BxC
  if always_BxC is not None:
    keep_BxC &= ~always_BxC
  noise_BxC = jax.random.randint(noise_rng, tokens_BxC.shape, 0, vocab_size, tokens_BxC.dtype)
  return jnp.where(keep_BxC, tokens_BxC, noise_BxC)
