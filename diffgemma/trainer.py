"""The SFT training loop: config -> state -> jitted steps, with checkpoints, TensorBoard, eval."""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import optax
from tqdm import tqdm

from diffgemma import checkpoint_io, checkpointing, data, evaluation, losses, model, sampler, sudoku
from diffgemma.config import NUMERICS_FIELDS, ModelConfig
from diffgemma.tb_writer import ScalarWriter


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
  return ModelConfig(**config.model.to_dict())


def loss_config(config: ml_collections.ConfigDict) -> losses.LossConfig:
  return losses.LossConfig(prompt_len=data.PROMPT_LEN, **config.loss.to_dict())


def sampler_config(config: ml_collections.ConfigDict) -> sampler.SamplerConfig:
  return sampler.SamplerConfig(**config.sampler.to_dict())


def validate_config(config: ml_collections.ConfigDict) -> None:
  """Build every typed piece of a config once, so a bad value fails before any work starts."""
  model_config(config), loss_config(config), sampler_config(config)
  learning_rate_schedule(config.optimizer, config.num_train_steps)
  data.GivensCurriculum(config.data.start_min_givens, config.data.start_max_givens,
                        config.data.min_givens, config.data.max_givens,
                        config.data.curriculum_steps)
  needed = data.vocab_size(config.data.prompt_format)
  if config.model.vocab_size < needed:
    raise ValueError(f"model.vocab_size={config.model.vocab_size} is too small for "
                     f"data.prompt_format={config.data.prompt_format!r} (needs {needed})")
  for lo, hi in ((config.data.start_min_givens, config.data.start_max_givens),
                 (config.data.min_givens, config.data.max_givens),
                 (config.eval.min_givens, config.eval.max_givens)):
    sudoku.check_givens_range(lo, hi)


def learning_rate_schedule(opt: ml_collections.ConfigDict, num_steps: int):
  if opt.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        0.0, opt.lr, opt.warmup_steps, max(num_steps, opt.warmup_steps + 1),
        end_value=opt.lr * opt.end_lr_fraction)
  if opt.schedule == "constant":
    return optax.join_schedules(
        [optax.linear_schedule(0.0, opt.lr, opt.warmup_steps), optax.constant_schedule(opt.lr)],
        [opt.warmup_steps])
  raise ValueError(f"unknown optimizer.schedule {opt.schedule!r}; choose 'cosine' or 'constant'")


def make_optimizer(config: ml_collections.ConfigDict):
  opt = config.optimizer
  schedule = learning_rate_schedule(opt, config.num_train_steps)
  # No weight decay on norms, scales and other vectors: only on matrices.
  decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)
  tx = optax.chain(
      optax.clip_by_global_norm(opt.grad_clip),
      optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                  mask=decay_mask))
  return tx, schedule


def adopt_architecture(config: ml_collections.ConfigDict, arch: ModelConfig) -> list[str]:
  """Set config.model to `arch`'s architecture, keeping the config's numerics fields.

  Returns the changed fields as "name: old -> new" lines (for the log)."""
  changes = []
  with config.unlocked():
    for field in dataclasses.fields(ModelConfig):
      if field.name in NUMERICS_FIELDS:
        continue
      new = getattr(arch, field.name)
      new = list(new) if isinstance(new, tuple) else new
      old = config.model.get(field.name)
      if (list(old) if isinstance(old, tuple) else old) != new:
        changes.append(f"{field.name}: {old} -> {new}")
      config.model[field.name] = new
  return changes


def load_initial_params(config: ml_collections.ConfigDict, init_from: str):
  """Parameters from a checkpoint directory (transformers, orbax, or a training workdir); the
  config's model architecture is replaced by the checkpoint's (numerics kept)."""
  numerics = {k: config.model[k] for k in NUMERICS_FIELDS if k != "param_dtype"}
  arch, params = checkpoint_io.load_model(init_from, dtype=config.model.param_dtype,
                                          rng=jax.random.PRNGKey(config.seed), **numerics)
  for change in adopt_architecture(config, arch):
    print(f"  model.{change} (from {init_from})")
  return params


def init_state(config, model_cfg: ModelConfig, tx, params=None):
  """The training state; random parameters unless `params` is given (a fine-tuning start)."""
  rng = jax.random.PRNGKey(config.seed)
  init_rng, train_rng = jax.random.split(rng)
  if params is None:
    params = model.init_params(model_cfg, init_rng)
  return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
          "rng": train_rng}


def make_train_step(model_cfg: ModelConfig, loss_cfg: losses.LossConfig, tx, schedule):
  """A jitted (state, batch) -> (state, metrics); the step's randomness is fold_in(rng, step),
  so a resumed run draws exactly what an uninterrupted one would."""

  def train_step(state, batch):
    step_rng = jax.random.fold_in(state["rng"], state["step"])
    grad_fn = jax.value_and_grad(losses.sft_loss, has_aux=True)
    (_, metrics), grads = grad_fn(state["params"], model_cfg, loss_cfg, batch, step_rng)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["learning_rate"] = schedule(state["step"])
    new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state,
                 "rng": state["rng"]}
    return new_state, metrics

  return jax.jit(train_step, donate_argnums=0)


def held_out_puzzles(eval_cfg):
  return sudoku.generate_puzzles(eval_cfg.seed, eval_cfg.num_puzzles, eval_cfg.min_givens,
                                 eval_cfg.max_givens)


def train(config: ml_collections.ConfigDict, workdir: str, stop_at: int | None = None,
          init_from: str | None = None) -> dict:
  """Train (or resume) in `workdir`; returns the last logged metrics.

  `stop_at` ends this invocation early at that step (with a checkpoint), as a preemption would;
  the schedule still spans `num_train_steps`, so rerunning resumes the same run. `init_from`
  starts a new run from a checkpoint directory's parameters (see `load_initial_params`).
  """
  config = ml_collections.ConfigDict(config.to_dict())  # adopting an architecture edits it
  os.makedirs(workdir, exist_ok=True)
  mngr = checkpointing.manager(workdir, keep=config.keep_checkpoints)
  start_step = mngr.latest_step()
  tx, schedule = make_optimizer(config)
  if start_step is not None:
    # The architecture is the run's, as saved when it started (possibly from --init_from).
    adopt_architecture(config, model_config(checkpointing.load_config(workdir)))
    model_cfg = model_config(config)
    abstract_state = jax.eval_shape(lambda: init_state(config, model_cfg, tx))
    state = checkpointing.restore(mngr, start_step, abstract_state)
    print(f"resumed from step {start_step} in {workdir}" +
          (" (--init_from applies only to a new run)" if init_from else ""))
  else:
    start_step = 0
    params = None
    if init_from:
      print(f"initialising from {init_from}")
      params = load_initial_params(config, init_from)
      with config.unlocked():
        config.init_from = os.path.abspath(init_from)
      validate_config(config)
    model_cfg = model_config(config)
    state = init_state(config, model_cfg, tx, params)
    checkpointing.save_config(workdir, config)
  loss_cfg, sampler_cfg = loss_config(config), sampler_config(config)
  num_params = model.count_params(state["params"])
  print(f"model: {num_params / 1e6:.3f}M parameters; training steps {start_step}.."
        f"{config.num_train_steps}")

  train_step = make_train_step(model_cfg, loss_cfg, tx, schedule)
  batches = data.train_batches(config.data, config.batch_size, config.num_train_steps, start_step)
  writer = ScalarWriter(os.path.join(workdir, "tensorboard"))
  eval_puzzles, eval_solutions = (held_out_puzzles(config.eval) if config.eval.every_steps > 0
                                  else (None, None))
  generate_fn = sampler.make_generate_fn(model_cfg, sampler_cfg)
  tokens_per_batch = config.batch_size * (data.PROMPT_LEN + data.CANVAS_LEN)

  deadline = time.time() + 60 * config.max_train_minutes if config.max_train_minutes > 0 else None
  metrics, last = {}, {}
  window_start, window_steps = time.perf_counter(), 0
  bar = tqdm(total=config.num_train_steps, initial=start_step, desc="train", unit="step",
             dynamic_ncols=True)
  step = start_step
  try:
    while step < config.num_train_steps:
      batch = next(batches)
      state, metrics = train_step(state, batch)
      step += 1
      window_steps += 1
      bar.update(1)
      if step % config.log_every == 0 or step == config.num_train_steps:
        metrics = jax.tree_util.tree_map(float, jax.device_get(metrics))
        elapsed = time.perf_counter() - window_start
        metrics["tokens_per_second"] = window_steps * tokens_per_batch / elapsed
        metrics["steps_per_second"] = window_steps / elapsed
        window_start, window_steps = time.perf_counter(), 0
        writer.write(step, metrics)
        bar.set_postfix(loss=f"{metrics['loss']:.4f}", acc=f"{metrics['decoder_token_accuracy']:.3f}")
        last.update(metrics)
      timed_out = deadline is not None and time.time() > deadline
      stopping = timed_out or step == stop_at
      final = step == config.num_train_steps
      if config.eval.every_steps > 0 and (step % config.eval.every_steps == 0 or final or timed_out):
        eval_metrics = evaluation.evaluate_sudoku(
            state["params"], model_cfg, sampler_cfg, eval_puzzles, eval_solutions,
            config.eval.batch_size, config.data.prompt_format, seed=step,
            generate_fn=generate_fn)
        writer.write(step, {f"eval/{k}": v for k, v in eval_metrics.items()})
        tqdm.write(f"step {step}: eval puzzle_accuracy={eval_metrics['puzzle_accuracy']:.3f} "
                   f"cell_accuracy={eval_metrics['cell_accuracy']:.3f} "
                   f"TPF={eval_metrics['tokens_per_forward']:.2f} "
                   f"steps/canvas={eval_metrics['steps_per_canvas']:.1f}")
        last.update({f"eval/{k}": v for k, v in eval_metrics.items()})
        window_start = time.perf_counter()  # eval time is not training throughput
        window_steps = 0
      if step % config.checkpoint_every == 0 or final or stopping:
        checkpointing.save(mngr, step, state)
      if timed_out:
        tqdm.write(f"stopping at step {step}: max_train_minutes={config.max_train_minutes} reached")
      if stopping:
        break
  finally:
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    writer.close()
  return last
