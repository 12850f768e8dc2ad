"""The one update step every training stage shares.

`make_update_step` turns a loss function into a jitted, sharded optimizer step with gradient
accumulation, LoRA (adapters trained on a frozen base), a frozen vision tower and a
finite-or-skip guard. A stage (`diffgemma.training.stages`: the `Stage` protocol, SFT, SD·RL)
supplies the loss and the batches, nothing else.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from diffgemma.model import sharding
from diffgemma.training.training_state import Setup, model_params, without_vision_gradients

# Stream ids folded into a step's key for randomness outside the loss.
DROPOUT_STREAM = 1


def split_micro_batches(batch, accum: int):
  """[B, ...] leaves -> [accum, B / accum, ...]; micro-batch i holds rows i, i + accum, ...
  (each micro-batch spans every device of a batch-sharded layout)."""
  # Explicit sizes, not -1: a leaf may have no elements (SD·RL's context with one canvas).
  return jax.tree_util.tree_map(
      lambda x: x.reshape((x.shape[0] // accum, accum) + x.shape[1:]).swapaxes(0, 1), batch)


def make_update_step(setup: Setup, loss_fn, state_sh=None, frozen_sh=None, batch_sh=None,
                     stream: int | None = None):
  """A jitted (state, frozen, batch) -> (state, metrics).

  `loss_fn(params, batch, rng) -> (loss, metrics)` gets the params the model runs (the trained
  tree, or the frozen base wrapped with the trained LoRA adapters). The step's randomness is
  fold_in(rng, step) (of the stage's `stream` of the run's key), so a resumed run draws exactly
  what an uninterrupted one would. With
  grad_accum_steps = n the batch is split into n micro-batches whose gradients and metrics are
  averaged (a loss that normalises by whole-batch counts carried in the batch makes the sum
  exact). A step whose loss or gradient norm is not finite changes neither the parameters nor
  the optimizer state; it increments state["nonfinite"] and, the first time, records its step
  in state["nonfinite_step"] (the loop decides whether to stop).
  """
  lora_cfg, tx, accum = setup.lora_cfg, setup.tx, setup.grad_accum_steps

  freezes_vision = setup.freezes_vision

  def trained_loss(trainable, frozen, batch, rng):
    params = model_params(trainable, frozen, lora_cfg, jax.random.fold_in(rng, DROPOUT_STREAM))
    if freezes_vision:
      params = without_vision_gradients(params)
    return loss_fn(params, batch, rng)

  grad_fn = jax.value_and_grad(trained_loss, has_aux=True)

  def update_step(state, frozen, batch):
    rng = state["rng"] if stream is None else jax.random.fold_in(state["rng"], stream)
    step_rng = jax.random.fold_in(rng, state["step"])
    with sharding.activation_rules(setup.mesh, setup.rules):
      if accum == 1:
        (loss, metrics), grads = grad_fn(state["params"], frozen, batch, step_rng)
      else:
        micro = split_micro_batches(batch, accum)

        def body(total, xs):
          micro_batch, i = xs
          (loss, m), g = grad_fn(state["params"], frozen, micro_batch,
                                 jax.random.fold_in(step_rng, i))
          return jax.tree_util.tree_map(jnp.add, total, (loss, g, m)), None

        shapes = jax.eval_shape(grad_fn, state["params"], frozen,
                                jax.tree_util.tree_map(lambda x: x[0], micro), step_rng)
        (loss_shape, metrics_shape), grads_shape = shapes
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                       (loss_shape, grads_shape, metrics_shape))
        (loss, grads, metrics), _ = jax.lax.scan(body, zeros, (micro, jnp.arange(accum)))
        loss, grads, metrics = jax.tree_util.tree_map(lambda x: x / accum,
                                                      (loss, grads, metrics))
    with jax.named_scope("optimizer"):  # a label for benchmarks/step_profile.py
      grad_norm = optax.tree.norm(grads)
      finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
      updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
      params = optax.apply_updates(state["params"], updates)
    keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
    first = ~finite & (state["nonfinite"] == 0)
    metrics.update(loss=loss, grad_norm=grad_norm, learning_rate=setup.schedule(state["step"]))
    new_state = dict(state, step=state["step"] + 1,
                     params=keep(params, state["params"]),
                     opt_state=keep(opt_state, state["opt_state"]),
                     nonfinite=state["nonfinite"] + (~finite).astype(jnp.int32),
                     nonfinite_step=jnp.where(first, state["step"] + 1, state["nonfinite_step"]))
    return new_state, metrics

  if state_sh is None:
    return jax.jit(update_step, donate_argnums=0)
  repl = sharding.replicated(setup.mesh)
  return jax.jit(update_step, in_shardings=(state_sh, frozen_sh, batch_sh),
                 out_shardings=(state_sh, repl), donate_argnums=0)


def batch_shardings(setup: Setup, batch_shapes):
  """Every batch leaf split along its first (batch) axis by the rules."""
  return jax.tree_util.tree_map(
      lambda x: sharding.batch_sharding(setup.mesh, setup.rules, x.shape), batch_shapes)
