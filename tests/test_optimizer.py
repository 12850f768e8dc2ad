"""The optimizer (diffgemma/training/optimizer.py) against float64 numpy references of its update rules:
AdamW and Adafactor (factored and not, with and without momentum), global-norm clipping,
decoupled weight decay on matrices only, and bfloat16 optimizer state."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from diffgemma.training import optimizer

SHAPES = {"experts": (3, 7, 5), "matrix": (6, 4), "norm": (5,)}  # distinct sizes per tensor
STEPS = 3
LR, WD, CLIP = 0.1, 0.1, 1.0


def _grads(step):
  rng = np.random.default_rng(100 + step)
  # Norms well above CLIP, so the global clipping acts.
  return {k: rng.normal(size=s) * (1.0 + np.arange(s[-1])) for k, s in SHAPES.items()}


def _params():
  rng = np.random.default_rng(0)
  return {k: rng.normal(size=s) for k, s in SHAPES.items()}


def _clip(grads):
  norm = np.sqrt(sum(np.sum(g * g) for g in grads.values()))
  return {k: g * min(1.0, CLIP / norm) for k, g in grads.items()}


def _round(x, dtype):
  """The state as stored between steps (an update uses the unrounded new state)."""
  return x if dtype == "float32" else x.astype(ml_dtypes.bfloat16).astype(np.float64)


def _adamw_reference(params, b1, b2, state_dtype):
  mu = {k: np.zeros_like(p) for k, p in params.items()}
  nu = {k: np.zeros_like(p) for k, p in params.items()}
  updates = []
  for t in range(1, STEPS + 1):
    grads, step_updates = _clip(_grads(t)), {}
    for k, g in grads.items():
      m, v = b1 * mu[k] + (1 - b1) * g, b2 * nu[k] + (1 - b2) * g * g
      mu[k], nu[k] = _round(m, state_dtype), _round(v, state_dtype)
      u = (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + 1e-8)
      if params[k].ndim >= 2:
        u = u + WD * params[k]
      step_updates[k] = -LR * u
      params[k] = params[k] + step_updates[k]
    updates.append(step_updates)
  return updates


def _adafactor_reference(params, b1, state_dtype):
  """Shazeer & Stern's factored second moments over a tensor's two largest axes (rows: the
  largest axis averaged out, columns: the second largest), decay 1 - t^-0.8, no update clipping
  or parameter scaling; momentum without bias correction; decoupled weight decay * lr."""
  state, momentum, updates = {}, {k: np.zeros_like(p) for k, p in params.items()}, []
  for t in range(1, STEPS + 1):
    grads, step_updates = _clip(_grads(t)), {}
    decay = 1.0 - t ** -0.8
    for k, g in grads.items():
      g2 = g * g + 1e-30
      if g.ndim >= 2:
        d1, d0 = np.argsort(g.shape)[-2:]  # second largest, largest
        row, col = state.get(k, (0.0, 0.0))
        row = decay * row + (1 - decay) * g2.mean(axis=d0)
        col = decay * col + (1 - decay) * g2.mean(axis=d1)
        state[k] = (_round(row, state_dtype), _round(col, state_dtype))
        reduced_d1 = d1 - 1 if d1 > d0 else d1
        row_factor = (row / row.mean(axis=reduced_d1, keepdims=True)) ** -0.5
        u = g * np.expand_dims(row_factor, d0) * np.expand_dims(col ** -0.5, d1)
      else:
        v = decay * state.get(k, 0.0) + (1 - decay) * g2
        state[k] = _round(v, state_dtype)
        u = g / np.sqrt(v)
      if b1:
        u = b1 * momentum[k] + (1 - b1) * u
        momentum[k] = _round(u, state_dtype)
      if params[k].ndim >= 2:
        u = u + WD * params[k]
      step_updates[k] = -LR * u
      params[k] = params[k] + step_updates[k]
    updates.append(step_updates)
  return updates


def _ours(cfg):
  tx, _ = optimizer.make(cfg, num_steps=10)
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), _params())
  state = tx.init(params)
  step = jax.jit(tx.update)
  updates = []
  for t in range(1, STEPS + 1):
    grads = jax.tree_util.tree_map(lambda x: jnp.asarray(x, jnp.float32), _grads(t))
    u, state = step(grads, state, params)
    params = optax.apply_updates(params, u)
    updates.append(jax.tree_util.tree_map(np.asarray, u))
  return updates, state


# float32 arithmetic against float64 (measured: at most 7e-6 relative). With bfloat16 state the
# reference rounds its stored state to bfloat16 as ours does, so both see the same state; a
# value within float32 error of a bfloat16 rounding boundary could round the other way (2^-8
# relative), which these draws do not hit.
TOLERANCE = {"float32": 2e-5, "bfloat16": 1e-4}


@pytest.mark.parametrize("state_dtype", optimizer.STATE_DTYPES)
@pytest.mark.parametrize("name,b1", [("adamw", 0.9), ("adafactor", 0.0), ("adafactor", 0.9)])
def test_update_matches_float64_reference(name, b1, state_dtype):
  cfg = optimizer.OptimizerConfig(lr=LR, warmup_steps=0, schedule="constant", weight_decay=WD,
                                  b1=b1, b2=0.95, grad_clip=CLIP, name=name,
                                  state_dtype=state_dtype)
  ours, state = _ours(cfg)
  if name == "adamw":
    reference = _adamw_reference(_params(), b1, 0.95, state_dtype)
  else:
    reference = _adafactor_reference(_params(), b1, state_dtype)
  tol = TOLERANCE[state_dtype]
  for got, want in zip(ours, reference):
    for k in SHAPES:
      np.testing.assert_allclose(got[k], want[k], rtol=tol, atol=tol * LR, err_msg=k)
  floats = [x for x in jax.tree_util.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)]
  assert floats and all(x.dtype == jnp.dtype(state_dtype) for x in floats)
  if name == "adafactor":  # factored: O(rows + cols) per matrix, plus the optional momentum
    params = sum(int(np.prod(s)) for s in SHAPES.values())
    second_moments = sum(x.size for x in floats) - (params if b1 else 0)
    assert second_moments < 0.5 * params, second_moments
