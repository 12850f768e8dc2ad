"""The parameter initialisers of the modules, and the draw that keeps a seed's weights: each
normal-initialised weight has a fixed index into one split of the seed (`draw_keys`), the order
`transformer.init_params` has always drawn in, so a seed gives the same weights as before the
linen modules."""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp

from diffgemma.model.config import SLIDING, ModelConfig


@functools.partial(jax.jit, static_argnums=(2, 3))
def _normal_leaf(key, std, shape, dtype):
  """std * normal(key, shape) in `dtype`: one small program per (shape, dtype)."""
  return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _ones_leaf(shape, dtype):
  return jnp.ones(shape, dtype)


# Per-leaf PRNG keys of the draw `transformer.init_params` has always made (one split of the seed,
# consumed layer by layer, then the embedding, then the self-conditioning block): while set,
# each normal initialiser takes the key of its draw index instead of linen's per-path key, so a
# seed gives the same weights as before the modules.
_DRAW_KEYS = contextvars.ContextVar("diffgemma_draw_keys", default=None)


@contextlib.contextmanager
def draw_keys(keys):
  token = _DRAW_KEYS.set(keys)
  try:
    yield
  finally:
    _DRAW_KEYS.reset(token)


def normal_init(std: float, draw: int):
  def init(key, shape, dtype):
    keys = _DRAW_KEYS.get()
    if keys is not None:
      key = keys[draw]
    return _normal_leaf(key, jnp.float32(std), tuple(shape), jnp.dtype(dtype))
  return init


def ones_init(value: float = 1.0):
  def init(key, shape, dtype):
    del key
    ones = _ones_leaf(tuple(shape), jnp.dtype(dtype))
    return ones if value == 1.0 else value * ones
  return init


def layer_draw_offsets(cfg: ModelConfig) -> list[int]:
  """Index of each layer's first normal draw: q, k, o, (v), mlp gate/up/down, router proj,
  experts gate_up/down per layer; the embedding and the self-conditioning block follow."""
  offsets, n = [], 0
  for lt in cfg.layer_types:
    offsets.append(n)
    n += 9 + (lt == SLIDING)
  return offsets + [n]


def num_draws(cfg: ModelConfig) -> int:
  return 8 + 12 * cfg.num_layers  # the split init_params has always made
