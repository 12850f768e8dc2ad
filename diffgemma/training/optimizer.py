"""The optimizer: a typed config (section `optimizer`) built once into an optax transformation.

AdamW (the default) or Adafactor (factored second moments: O(rows + cols) state per matrix, as
Google's full fine-tuning recipe uses), global-norm clipping, a warmup + cosine or constant
learning-rate schedule, and optional bfloat16 optimizer state (moments stored in bfloat16,
updates computed in float32).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from diffgemma.model import fields, lora

NAMES = ("adamw", "adafactor")
SCHEDULES = ("cosine", "constant")
STATE_DTYPES = ("float32", "bfloat16")
ROUTER_LEAVES = ("router.proj", "router.scale", "router.per_expert_scale")
# The vision tower and its embedder (a model with cfg.vision): frozen unless train.freeze_vision
# is False.
VISION_SUBTREES = ("vision_tower.", "embed_vision.")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Every optimizer knob. `b2` is AdamW's second-moment decay (Adafactor uses its own
  step-dependent decay); `state_dtype` the dtype of AdamW's moments / Adafactor's factors."""

  lr: float = 3e-3
  warmup_steps: int = 50
  schedule: str = "cosine"
  end_lr_fraction: float = 0.05
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.99
  grad_clip: float = 1.0
  name: str = "adamw"
  state_dtype: str = "float32"

  def __post_init__(self):
    fields.check_types(self, "optimizer.")
    for field, choices in (("name", NAMES), ("schedule", SCHEDULES),
                           ("state_dtype", STATE_DTYPES)):
      if getattr(self, field) not in choices:
        raise ValueError(f"unknown optimizer.{field} {getattr(self, field)!r}; choose one of "
                         f"{choices}")
    if not self.lr > 0:
      raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
    if self.warmup_steps < 0:
      raise ValueError(f"optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")
    if not 0.0 <= self.end_lr_fraction <= 1.0:
      raise ValueError(f"optimizer.end_lr_fraction must be in [0, 1], got {self.end_lr_fraction}")
    if self.weight_decay < 0:
      raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")
    for name in ("b1", "b2"):
      if not 0.0 <= getattr(self, name) < 1.0:
        raise ValueError(f"optimizer.{name} must be in [0, 1), got {getattr(self, name)}")
    if not self.grad_clip > 0:
      raise ValueError(f"optimizer.grad_clip must be > 0, got {self.grad_clip}")


def learning_rate_schedule(cfg: OptimizerConfig, num_steps: int, lengths=()):
  """Linear warmup from 0, then cosine decay to end_lr_fraction * lr, or constant.

  `lengths` ((first step, schedule length) pairs, from `training.budget.schedule_lengths`): a
  cosine schedule whose length was re-fitted during the run. From each change on, the decay
  continues from the point it has reached and ends at the new length (its progress runs
  linearly from there to 1), so the learning rate is continuous across a change; its slope
  changes. Up to the first change it is the plain schedule of the first length."""
  if cfg.schedule == "cosine" and len(lengths) > 1:
    return _refitted_cosine(cfg, lengths)
  if cfg.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup_steps, max(num_steps, cfg.warmup_steps + 1),
        end_value=cfg.lr * cfg.end_lr_fraction)
  return optax.join_schedules(
      [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), optax.constant_schedule(cfg.lr)],
      [cfg.warmup_steps])


def _refitted_cosine(cfg: OptimizerConfig, lengths):
  """The warmup-cosine schedule of `lengths[0]`, continued at each (step, length) after it:
  progress p (0 at the warmup's end, 1 at the schedule's) goes on from its value at the change
  (or at the warmup's end, if later) linearly to 1 at the new length."""
  warmup = cfg.warmup_steps
  first = learning_rate_schedule(cfg, lengths[0][1])
  pieces = []  # (first count, progress at it, progress per step)
  anchor, progress, rate = warmup, 0.0, 1.0 / max(lengths[0][1] - warmup, 1)
  for step, length in lengths[1:]:
    start = max(step, warmup)
    progress = min(1.0, progress + rate * (start - anchor))  # where the previous piece got to
    anchor, rate = start, (1.0 - progress) / max(length - start, 1)
    pieces.append((anchor, progress, rate))
  end = cfg.lr * cfg.end_lr_fraction

  def schedule(count):
    value = first(count)
    for start, at, per_step in pieces:
      p = jnp.clip(at + per_step * (count - start), 0.0, 1.0)
      cosine = end + (cfg.lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
      value = jnp.where(count >= start, cosine, value)
    return value

  return schedule


def _matrices(params):
  """Weight decay only on matrices, not on norms, scales and other vectors."""
  return jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)


def cast_state(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
  """`inner` with its floating-point state stored in `dtype` and computed in float32."""
  dtype = jnp.dtype(dtype)

  def store(state):
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)

  def load(state):
    return jax.tree_util.tree_map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)

  def init(params):
    return store(inner.init(params))

  def update(updates, state, params=None):
    updates, state = inner.update(updates, load(state), params)
    return updates, store(state)

  return optax.GradientTransformation(init, update)


def _base(cfg: OptimizerConfig, schedule) -> optax.GradientTransformation:
  if cfg.name == "adamw":
    tx = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                     mask=_matrices)
  else:
    # Factored second moments over the two largest axes of every matrix (per expert for the
    # stacked experts), full ones for vectors, Adafactor's step-dependent decay 1 - t^-0.8; the
    # step size is the schedule's (no parameter-scale rule, no update clipping: clipping is
    # global, below), momentum b1 (0 = none, the memory-lean choice). Weight decay is decoupled
    # and scaled by the learning rate, as AdamW's: the update is -lr * (u + wd * param).
    # (optax.adafactor adds wd * param after the learning rate, a 1% shrink per step at wd 0.01.)
    tx = optax.chain(
        optax.scale_by_factored_rms(min_dim_size_to_factor=1),
        optax.ema(cfg.b1, debias=False) if cfg.b1 else optax.identity(),
        optax.add_decayed_weights(cfg.weight_decay, mask=_matrices) if cfg.weight_decay
        else optax.identity(),
        optax.scale_by_learning_rate(schedule))
  return tx if cfg.state_dtype == "float32" else cast_state(tx, cfg.state_dtype)


def make(cfg: OptimizerConfig, num_steps: int, frozen_router: bool = False, lengths=(),
         frozen_vision: bool = False):
  """(optax transformation over the trained tree, learning-rate schedule).

  `lengths`: a fitted schedule's re-fitted lengths (`learning_rate_schedule`).

  Global-norm clipping, then the optimizer. With `frozen_router` (NeMo's SFT default, full
  fine-tuning only) the router's leaves get no updates and no optimizer state; so the vision
  tower's and its embedder's with `frozen_vision` (a model that has them: their weights leave
  the run exactly as they came, with no weight decay).
  """
  schedule = learning_rate_schedule(cfg, num_steps, lengths)
  tx = optax.chain(optax.clip_by_global_norm(cfg.grad_clip), _base(cfg, schedule))
  if frozen_router or frozen_vision:
    def frozen(name: str) -> bool:
      return ((frozen_router and name.endswith(ROUTER_LEAVES))
              or (frozen_vision and name.startswith(VISION_SUBTREES)))

    def labels(params):
      return jax.tree_util.tree_map_with_path(
          lambda p, _: "frozen" if frozen(lora.dotted(p)) else "trained", params)
    tx = optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)
  return tx, schedule
