"""The SFT training loop: config -> state -> jitted steps, with checkpoints, TensorBoard, eval."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from tqdm import tqdm

from diffgemma import (
  checkpoint_io,
  checkpointing,
  data,
  evaluation,
  lora,
  losses,
  model,
  quantize,
  sampler,
  sharding,
  sudoku,
)
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
  lora_config(config), sharding_config(config), quantize_config(config)
  if config.batch_size % config.get("grad_accum_steps", 1):
    raise ValueError(f"grad_accum_steps={config.grad_accum_steps} does not divide "
                     f"batch_size={config.batch_size}")
  data.response_len(config.model.canvas_length)
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


ROUTER_LEAVES = ("router.proj", "router.scale", "router.per_expert_scale")


def make_optimizer(config: ml_collections.ConfigDict):
  """AdamW with global-norm clipping over the trained tree (params, or LoRA adapters).

  With `freeze_router` (NeMo's SFT default) in full fine-tuning, the router's leaves get no
  updates and no optimizer state; a LoRA run instead leaves the router without an adapter.
  """
  opt = config.optimizer
  schedule = learning_rate_schedule(opt, config.num_train_steps)
  # No weight decay on norms, scales and other vectors: only on matrices.
  decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)
  tx = optax.chain(
      optax.clip_by_global_norm(opt.grad_clip),
      optax.adamw(schedule, b1=opt.b1, b2=opt.b2, weight_decay=opt.weight_decay,
                  mask=decay_mask))
  if config.get("freeze_router", False) and not lora_config(config).enabled:
    def labels(params):
      return jax.tree_util.tree_map_with_path(
          lambda p, _: "frozen" if lora.dotted(p).endswith(ROUTER_LEAVES) else "trained", params)
    tx = optax.multi_transform({"trained": tx, "frozen": optax.set_to_zero()}, labels)
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


def load_initial_params(config: ml_collections.ConfigDict, init_from: str, mesh=None,
                        rules=None, dtype: str | None = None):
  """Parameters from a checkpoint directory (transformers, orbax, or a training workdir); the
  config's model architecture is replaced by the checkpoint's (numerics kept). With a mesh,
  each tensor goes straight to its shards."""
  numerics = {k: config.model[k] for k in NUMERICS_FIELDS if k != "param_dtype"}
  dtype = dtype or config.model.param_dtype
  shardings = None
  if mesh is not None:
    arch = checkpoint_io.read_model_config(init_from, dtype=dtype, **numerics)
    shardings = sharding.tree_shardings(model.abstract_params(arch), mesh, rules)
  arch, params = checkpoint_io.load_model(init_from, dtype=dtype, shardings=shardings,
                                          rng=jax.random.PRNGKey(config.seed), **numerics)
  for change in adopt_architecture(config, arch):
    print(f"  model.{change} (from {init_from})")
  return params


def lora_config(config: ml_collections.ConfigDict) -> lora.LoraConfig:
  """The run's LoRA settings (disabled for configs written before LoRA existed)."""
  if "lora" not in config:
    return lora.LoraConfig()
  cfg = lora.LoraConfig(**config.lora.to_dict())
  if cfg.enabled and config.get("freeze_router", False):
    cfg = dataclasses.replace(
        cfg, targets=tuple(t for t in cfg.targets if t != lora.ROUTER_PATTERN))
  return cfg


def quantize_config(config: ml_collections.ConfigDict) -> quantize.QuantizeConfig | None:
  """A QLoRA run's base quantization: lora.base_dtype "int8" / "int4", refined by an optional
  `quantize` section (quantize.QuantizeConfig fields but dtype); None for any other run."""
  lora_cfg = lora_config(config)
  if not lora_cfg.enabled or lora_cfg.base_dtype not in quantize.QTYPES:
    return None
  fields = config.quantize.to_dict() if "quantize" in config else {}
  return quantize.QuantizeConfig(dtype=lora_cfg.base_dtype, **fields)


def sharding_config(config: ml_collections.ConfigDict) -> sharding.ShardingConfig:
  if "sharding" not in config:
    return sharding.ShardingConfig()
  fields = config.sharding.to_dict()
  return sharding.ShardingConfig(**{**fields, "rules": dict(fields.get("rules", {}))})


@dataclasses.dataclass
class Setup:
  """Everything a run needs besides its state: typed configs, optimizer, mesh, shardings."""
  model_cfg: ModelConfig
  loss_cfg: losses.LossConfig
  lora_cfg: lora.LoraConfig
  mesh: jax.sharding.Mesh
  rules: dict
  tx: Any
  schedule: Any
  grad_accum_steps: int
  quantize_cfg: quantize.QuantizeConfig | None = None  # QLoRA: the frozen base's quantization

  @property
  def uses_lora(self) -> bool:
    return self.lora_cfg.enabled


def make_setup(config: ml_collections.ConfigDict, mesh=None) -> Setup:
  tx, schedule = make_optimizer(config)
  shard_cfg = sharding_config(config)
  mesh = mesh or sharding.make_mesh(shard_cfg)
  accum = config.get("grad_accum_steps", 1)
  if accum < 1 or config.batch_size % accum:
    raise ValueError(f"grad_accum_steps={accum} must be >= 1 and divide batch_size="
                     f"{config.batch_size}")
  return Setup(model_config(config), loss_config(config), lora_config(config), mesh,
               shard_cfg.rules, tx, schedule, accum, quantize_config(config))


def model_params(trainable, frozen, lora_cfg: lora.LoraConfig, dropout_rng=None):
  """The params the model runs: the trained tree itself, or (LoRA) the frozen base wrapped with
  the trained adapters."""
  if frozen is None:
    return trainable
  return lora.wrap(frozen, trainable, lora_cfg, dropout_rng)


def base_params_shape(setup: Setup):
  """Shapes of the frozen base of a LoRA run (in lora.base_dtype; QLoRA: quantized from the
  model's param_dtype)."""
  if setup.quantize_cfg is not None:
    shapes = model.abstract_params(setup.model_cfg)
    return jax.eval_shape(lambda p: quantize.quantize_params(p, setup.quantize_cfg), shapes)
  cfg = setup.model_cfg.replace(param_dtype=setup.lora_cfg.base_dtype)
  return model.abstract_params(cfg)


def init_state(config, setup: Setup, params=None, frozen=None):
  """The training state: {step, params (the trained tree), opt_state, rng}.

  Full fine-tuning trains `params` (random unless given). A LoRA run trains fresh adapters on
  the frozen base `frozen`; `params` is then unused.
  """
  rng = jax.random.PRNGKey(config.seed)
  init_rng, train_rng = jax.random.split(rng)
  if setup.uses_lora:
    params = lora.init(frozen, setup.lora_cfg, init_rng)
  elif params is None:
    params = model.init_params(setup.model_cfg, init_rng)
  return {"step": jnp.zeros((), jnp.int32), "params": params,
          "opt_state": setup.tx.init(params), "rng": train_rng}


def state_shardings(setup: Setup, abstract_state):
  repl = sharding.replicated(setup.mesh)
  return {"step": repl, "rng": repl,
          "params": sharding.tree_shardings(abstract_state["params"], setup.mesh, setup.rules),
          "opt_state": sharding.tree_shardings(abstract_state["opt_state"], setup.mesh,
                                               setup.rules)}


def batch_shardings(setup: Setup, batch_size: int, seq_len: int):
  one = sharding.batch_sharding(setup.mesh, setup.rules, (batch_size, seq_len))
  return {"tokens": one, "valid": one, "loss_mask": one}


# Stream ids folded into a step's key for randomness outside the loss.
DROPOUT_STREAM = 1


def make_train_step(setup: Setup, state_sh=None, frozen_sh=None, batch_sh=None):
  """A jitted (state, frozen, batch) -> (state, metrics).

  `frozen` is the LoRA base (None for full fine-tuning). The step's randomness is
  fold_in(rng, step), so a resumed run draws exactly what an uninterrupted one would. With
  grad_accum_steps = n the batch is split into n micro-batches (rows i, i+n, ...: each micro-
  batch spans all devices) whose gradients are averaged.
  """
  model_cfg, loss_cfg, lora_cfg, tx = setup.model_cfg, setup.loss_cfg, setup.lora_cfg, setup.tx
  accum = setup.grad_accum_steps

  def loss_fn(trainable, frozen, batch, rng):
    params = model_params(trainable, frozen, lora_cfg, jax.random.fold_in(rng, DROPOUT_STREAM))
    return losses.sft_loss(params, model_cfg, loss_cfg, batch, rng)

  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def train_step(state, frozen, batch):
    step_rng = jax.random.fold_in(state["rng"], state["step"])
    with sharding.activation_rules(setup.mesh, setup.rules):
      if accum == 1:
        (_, metrics), grads = grad_fn(state["params"], frozen, batch, step_rng)
      else:
        micro = jax.tree_util.tree_map(
            lambda x: x.reshape((-1, accum) + x.shape[1:]).swapaxes(0, 1), batch)

        def body(total, xs):
          micro_batch, i = xs
          (_, m), g = grad_fn(state["params"], frozen, micro_batch,
                              jax.random.fold_in(step_rng, i))
          return jax.tree_util.tree_map(jnp.add, total, (g, m)), None

        (_, metrics_shape), grads_shape = jax.eval_shape(
            grad_fn, state["params"], frozen, jax.tree_util.tree_map(lambda x: x[0], micro),
            step_rng)
        zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype),
                                       (grads_shape, metrics_shape))
        (grads, metrics), _ = jax.lax.scan(body, zeros, (micro, jnp.arange(accum)))
        grads, metrics = jax.tree_util.tree_map(lambda x: x / accum, (grads, metrics))
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["learning_rate"] = setup.schedule(state["step"])
    new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state,
                 "rng": state["rng"]}
    return new_state, metrics

  if state_sh is None:
    return jax.jit(train_step, donate_argnums=0)
  repl = sharding.replicated(setup.mesh)
  return jax.jit(train_step, in_shardings=(state_sh, frozen_sh, batch_sh),
                 out_shardings=(state_sh, repl), donate_argnums=0)


def held_out_puzzles(eval_cfg):
  return sudoku.generate_puzzles(eval_cfg.seed, eval_cfg.num_puzzles, eval_cfg.min_givens,
                                 eval_cfg.max_givens)


def deadline(config) -> float | None:
  """Wall-clock time at which `max_train_minutes` ends a run (None: no limit)."""
  return time.time() + 60 * config.max_train_minutes if config.max_train_minutes > 0 else None


def close_run(bar, mngr, writer):
  """End of an SFT or SD·RL loop: the progress bar, pending checkpoint writes, TensorBoard."""
  bar.close()
  mngr.wait_until_finished()
  mngr.close()
  writer.close()


def evaluate_and_log(step, params, model_cfg: ModelConfig, sampler_cfg, config, eval_set,
                     generate_fn, writer) -> dict[str, float]:
  """The periodic held-out Sudoku evaluation of SFT and SD·RL runs: written to TensorBoard,
  printed above the progress bar, returned as eval/* metrics."""
  puzzles, solutions = eval_set
  metrics = evaluation.evaluate_sudoku(params, model_cfg, sampler_cfg, puzzles, solutions,
                                       config.eval.batch_size, config.data.prompt_format,
                                       seed=step, generate_fn=generate_fn)
  tqdm.write(f"step {step}: eval puzzle_accuracy={metrics['puzzle_accuracy']:.3f} "
             f"cell_accuracy={metrics['cell_accuracy']:.3f} "
             f"TPF={metrics['tokens_per_forward']:.2f} "
             f"steps/canvas={metrics['steps_per_canvas']:.1f}")
  metrics = {f"eval/{k}": v for k, v in metrics.items()}
  writer.write(step, metrics)
  return metrics


def abstract_state(config, setup: Setup, frozen_shape=None):
  """Shapes, dtypes and shardings of the training state (nothing allocated)."""
  shapes = jax.eval_shape(lambda f: init_state(config, setup, frozen=f), frozen_shape)
  shardings = state_shardings(setup, shapes)
  return jax.tree_util.tree_map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)


def load_frozen_base(config, setup: Setup):
  """A LoRA run's frozen base, read from its init_from in lora.base_dtype, sharded."""
  init_from = config.get("init_from")
  if not init_from:
    raise ValueError("a LoRA run fine-tunes a base model: pass --init_from=DIR (a checkpoint "
                     "or a training workdir)")
  if setup.quantize_cfg is not None:
    return _load_quantized_base(config, init_from, setup)
  return load_initial_params(config, init_from, setup.mesh, setup.rules,
                             dtype=setup.lora_cfg.base_dtype)


def _load_quantized_base(config, init_from: str, setup: Setup):
  """QLoRA: the base read into host memory in model.param_dtype, then quantized one weight at a
  time onto the mesh (the devices never hold the float base)."""
  try:
    host = jax.local_devices(backend="cpu")[0]
  except RuntimeError:  # no CPU backend (JAX_PLATFORMS excludes it): load on the default device
    host = None
  with jax.default_device(host):
    params = load_initial_params(config, init_from, dtype=config.model.param_dtype)
  shapes = jax.eval_shape(lambda p: quantize.quantize_params(p, setup.quantize_cfg), params)
  return quantize.quantize_params(params, setup.quantize_cfg,
                                  sharding.tree_shardings(shapes, setup.mesh, setup.rules))


def restore_run(workdir: str, config=None):
  """(config, setup, state, frozen, step) of a workdir's latest checkpoint (CheckpointError if
  there is none). A LoRA run's base comes from the checkpoint when it was saved there (
  lora.save_base), else from the run's init_from."""
  saved = checkpointing.load_config(workdir)
  config = ml_collections.ConfigDict((config or saved).to_dict())
  adopt_architecture(config, model_config(saved))
  if saved.get("init_from"):
    with config.unlocked():
      config.init_from = saved.init_from  # where a LoRA run's base lives
  setup = make_setup(config)
  step = checkpointing.latest_step(workdir)
  if step is None:
    raise checkpointing.CheckpointError(
        f"no checkpoint in {checkpointing.checkpoint_dir(workdir)!r} (train first, or check "
        "--workdir)")
  frozen = None
  target = abstract_state(config, setup)
  if setup.uses_lora:
    base_shape = base_params_shape(setup)
    target = abstract_state(config, setup, base_shape)
    if setup.lora_cfg.save_base:
      target["base"] = jax.tree_util.tree_map(
          lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), base_shape,
          sharding.tree_shardings(base_shape, setup.mesh, setup.rules))
    else:
      frozen = load_frozen_base(config, setup)
  with checkpointing.manager(workdir, read_only=True) as mngr:
    state = checkpointing.restore(mngr, step, target)
  if "base" in state:
    frozen = state.pop("base")
  return config, setup, state, frozen, int(step)


def restore_params(workdir: str):
  """(ModelConfig, plain params) of a workdir's latest checkpoint; LoRA adapters are merged
  into their base (in the base's dtype)."""
  config, setup, state, frozen, step = restore_run(workdir)
  params = state["params"] if frozen is None else lora.merge(frozen, state["params"],
                                                               setup.lora_cfg)
  return config, setup.model_cfg.replace(param_dtype=_dtype_name(params)), params, step


def _dtype_name(params) -> str:
  return jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype).name


def train(config: ml_collections.ConfigDict, workdir: str, stop_at: int | None = None,
          init_from: str | None = None) -> dict:
  """Train (or resume) in `workdir`; returns the last logged metrics.

  `stop_at` ends this invocation early at that step (with a checkpoint), as a preemption would;
  the schedule still spans `num_train_steps`, so rerunning resumes the same run. `init_from`
  starts a new run from a checkpoint directory's parameters (see `load_initial_params`); a LoRA
  run (lora.enabled) trains adapters on that base.
  """
  config = ml_collections.ConfigDict(config.to_dict())  # adopting an architecture edits it
  os.makedirs(workdir, exist_ok=True)
  start_step = checkpointing.latest_step(workdir)
  if start_step is not None:
    # The architecture is the run's, as saved when it started (possibly from --init_from).
    config, setup, state, frozen, start_step = restore_run(workdir, config)
    print(f"resumed from step {start_step} in {workdir}" +
          (" (--init_from applies only to a new run)" if init_from else ""))
  else:
    start_step = 0
    mesh = sharding.make_mesh(sharding_config(config))
    params = frozen = None
    if init_from:
      with config.unlocked():
        config.init_from = os.path.abspath(init_from)
      print(f"initialising from {init_from}")
    if lora_config(config).enabled:
      frozen = load_frozen_base(config, make_setup(config, mesh))
    elif init_from:
      params = load_initial_params(config, init_from, mesh, sharding_config(config).rules)
    validate_config(config)
    setup = make_setup(config, mesh)
    frozen_shape = None if frozen is None else jax.eval_shape(lambda: frozen)
    target = abstract_state(config, setup, frozen_shape)
    init_fn = jax.jit(lambda p, f: init_state(config, setup, p, f), donate_argnums=0,
                      out_shardings=jax.tree_util.tree_map(lambda x: x.sharding, target))
    state = init_fn(params, frozen)
    checkpointing.save_config(workdir, config)
  mngr = checkpointing.manager(workdir, keep=config.keep_checkpoints)
  model_cfg, lora_cfg = setup.model_cfg, setup.lora_cfg
  sampler_cfg = sampler_config(config)
  trained = model.count_params(state["params"])
  if frozen is None:
    print(f"model: {trained / 1e6:.3f}M parameters; training steps {start_step}.."
          f"{config.num_train_steps}")
  else:
    print(f"model: {model.count_params(frozen) / 1e6:.3f}M frozen parameters "
          f"({lora_cfg.base_dtype}), {trained / 1e6:.3f}M LoRA parameters (rank "
          f"{lora_cfg.rank}); training steps {start_step}..{config.num_train_steps}")

  seq_len = data.PROMPT_LEN + data.response_len(model_cfg.canvas_length)
  state_sh = jax.tree_util.tree_map(lambda x: x.sharding, state)
  frozen_sh = None if frozen is None else jax.tree_util.tree_map(lambda x: x.sharding, frozen)
  train_step = make_train_step(setup, state_sh, frozen_sh,
                               batch_shardings(setup, config.batch_size, seq_len))
  batches = data.train_batches(config.data, config.batch_size, config.num_train_steps,
                               start_step, model_cfg.canvas_length,
                               jax.process_index(), jax.process_count())
  writer = ScalarWriter(os.path.join(workdir, "tensorboard"))
  eval_set = held_out_puzzles(config.eval) if config.eval.every_steps > 0 else (None, None)
  generate_fn = sampler.make_generate_fn(model_cfg, sampler_cfg)
  tokens_per_batch = config.batch_size * seq_len

  def checkpoint(step):
    saved = state if not (frozen is not None and lora_cfg.save_base) else {**state, "base": frozen}
    checkpointing.save(mngr, step, saved)

  end_time = deadline(config)
  metrics, last = {}, {}
  window_start, window_steps = time.perf_counter(), 0
  bar = tqdm(total=config.num_train_steps, initial=start_step, desc="train", unit="step",
             dynamic_ncols=True)
  step = start_step
  try:
    while step < config.num_train_steps:
      batch = sharding.global_batch(next(batches), setup.mesh, setup.rules)
      state, metrics = train_step(state, frozen, batch)
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
      timed_out = end_time is not None and time.time() > end_time
      stopping = timed_out or step == stop_at
      final = step == config.num_train_steps
      if config.eval.every_steps > 0 and (step % config.eval.every_steps == 0 or final or timed_out):
        params = (state["params"] if frozen is None
                  else lora.merge(frozen, state["params"], lora_cfg, model_cfg.compute_dtype))
        last.update(evaluate_and_log(step, params, model_cfg, sampler_cfg, config, eval_set,
                                     generate_fn, writer))
        window_start = time.perf_counter()  # eval time is not training throughput
        window_steps = 0
      if step % config.checkpoint_every == 0 or final or stopping:
        checkpoint(step)
      if timed_out:
        tqdm.write(f"stopping at step {step}: max_train_minutes={config.max_train_minutes} reached")
      if stopping:
        break
  finally:
    close_run(bar, mngr, writer)
  return last


# ----------------------------------------------------------------------------- memory planning


def _bytes_per_device(tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (its largest shard)."""
  total = 0
  for x in jax.tree_util.tree_leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += int(np.prod(shape)) * quantize.bits_per_value(x.dtype) // 8
  return total


def dry_run(config: ml_collections.ConfigDict, init_from: str | None = None) -> dict:
  """Lower and compile the training step against abstract parameters on the configured mesh;
  return the per-device memory of the compiled executable (nothing is allocated).

  With `init_from`, the architecture is read from that checkpoint's config (no weights read).
  """
  config = ml_collections.ConfigDict(config.to_dict())
  if init_from:
    numerics = {k: config.model[k] for k in NUMERICS_FIELDS if k != "param_dtype"}
    adopt_architecture(config, checkpoint_io.read_model_config(init_from, **numerics))
  validate_config(config)
  setup = make_setup(config)
  frozen = None
  if setup.uses_lora:
    shapes = base_params_shape(setup)
    frozen = jax.tree_util.tree_map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
        sharding.tree_shardings(shapes, setup.mesh, setup.rules))
  state = abstract_state(config, setup, frozen)
  seq_len = data.PROMPT_LEN + data.response_len(setup.model_cfg.canvas_length)
  batch_sh = batch_shardings(setup, config.batch_size, seq_len)
  batch = {k: jax.ShapeDtypeStruct((config.batch_size, seq_len), jnp.int32 if k == "tokens"
                                   else jnp.bool_, sharding=sh) for k, sh in batch_sh.items()}
  step_fn = make_train_step(
      setup, jax.tree_util.tree_map(lambda x: x.sharding, state),
      None if frozen is None else jax.tree_util.tree_map(lambda x: x.sharding, frozen), batch_sh)
  start = time.perf_counter()
  compiled = step_fn.lower(state, frozen, batch).compile()
  compile_seconds = time.perf_counter() - start
  mem = compiled.memory_analysis()
  gib = 2 ** 30
  report = {
      "devices": setup.mesh.size,
      "mesh": dict(setup.mesh.shape),
      "arguments_gib": mem.argument_size_in_bytes / gib,
      "outputs_gib": mem.output_size_in_bytes / gib,
      "aliased_gib": mem.alias_size_in_bytes / gib,
      "temporaries_gib": mem.temp_size_in_bytes / gib,
      "code_gib": mem.generated_code_size_in_bytes / gib,
      "frozen_params_gib": 0.0 if frozen is None else _bytes_per_device(frozen) / gib,
      "trained_params_gib": _bytes_per_device(state["params"]) / gib,
      "optimizer_gib": _bytes_per_device(state["opt_state"]) / gib,
      "compile_seconds": compile_seconds,
  }
  # Donated state buffers are reused for the outputs (aliased): count them once.
  report["peak_gib"] = (report["arguments_gib"] + report["outputs_gib"] - report["aliased_gib"]
                        + report["temporaries_gib"] + report["code_gib"])
  report["device_memory_gib"] = float(config.get("device_memory_gib", 80))
  report["fits"] = report["peak_gib"] <= report["device_memory_gib"]
  return report


def format_dry_run(report: dict, config) -> str:
  rows = [("arguments (params, optimizer, batch)", report["arguments_gib"]),
          ("outputs (new state, metrics)", report["outputs_gib"]),
          ("  of which aliased to arguments", report["aliased_gib"]),
          ("temporaries (activations, gradients)", report["temporaries_gib"]),
          ("generated code", report["code_gib"]),
          ("peak per device", report["peak_gib"]),
          ("  frozen base params", report["frozen_params_gib"]),
          ("  trained params", report["trained_params_gib"]),
          ("  optimizer state", report["optimizer_gib"])]
  mesh = " ".join(f"{k}={v}" for k, v in report["mesh"].items())
  header = (f"dry run: {report['devices']} devices ({mesh}), batch {config.batch_size}, "
            f"canvas {config.model.canvas_length}, grad_accum_steps "
            f"{config.get('grad_accum_steps', 1)}, remat {config.model.get('remat', 'none')}, "
            f"compiled in {report['compile_seconds']:.0f} s")
  lines = [header, "| per device | GiB |", "|---|---|"]
  lines += [f"| {name} | {value:.2f} |" for name, value in rows]
  verdict = "fits" if report["fits"] else "does NOT fit"
  lines.append(f"peak {report['peak_gib']:.2f} GiB per device {verdict} in "
               f"device_memory_gib={report['device_memory_gib']:.0f}")
  return "\n".join(lines)
