"""A training run's state: what it is made of, how it starts, where it lives, how it resumes.

The state is one pytree {step, params (the trained tree), opt_state, rng, nonfinite, seen}; a LoRA
run also has a frozen base outside it (kept in the checkpoint only with `lora.save_base`).
`Setup` holds everything else a run needs (its typed `RunConfig`, optimizer, mesh, rules),
built once from the typed config by `make_setup`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from diffgemma.io import model_dirs
from diffgemma.model import lora, quantize, sharding, transformer
from diffgemma.model.config import NUMERICS_FIELDS, ModelConfig
from diffgemma.runs import checkpointing
from diffgemma.training import budget, optimizer, run_config


@dataclasses.dataclass
class Setup:
  """Everything a run needs besides its state: the typed config, optimizer, mesh, shardings."""

  run: run_config.RunConfig
  mesh: jax.sharding.Mesh
  rules: dict
  tx: Any
  schedule: Any

  @property
  def train_cfg(self) -> run_config.TrainConfig:
    return self.run.train

  @property
  def model_cfg(self) -> ModelConfig:
    return self.run.model

  @property
  def loss_cfg(self):
    return self.run.loss

  @property
  def lora_cfg(self) -> lora.LoraConfig:
    return self.run.lora

  @property
  def quantize_cfg(self) -> quantize.QuantizeConfig | None:
    """QLoRA: the frozen base's quantization (None otherwise)."""
    return self.run.quantize

  @property
  def uses_lora(self) -> bool:
    return self.lora_cfg.enabled

  @property
  def grad_accum_steps(self) -> int:
    return self.train_cfg.grad_accum_steps

  @property
  def freezes_vision(self) -> bool:
    """Full fine-tuning of a model with a vision tower under train.freeze_vision: the tower
    and its embedder are not trained (a LoRA run's base is frozen anyway)."""
    return freezes_vision(self.run)


def freezes_vision(run: run_config.RunConfig) -> bool:
  """`Setup.freezes_vision` of a typed run config."""
  return run.train.freeze_vision and not run.lora.enabled and run.model.vision is not None


def make_setup(run: run_config.RunConfig, mesh=None) -> Setup:
  train_cfg, lora_cfg = run.train, run.lora
  full = not lora_cfg.enabled  # a LoRA run trains adapters only: its base is frozen anyway
  tx, schedule = optimizer.make(
      run.optimizer, train_cfg.num_train_steps,
      frozen_router=train_cfg.freeze_router and full,
      lengths=budget.schedule_lengths(train_cfg.fitted_schedule),
      frozen_vision=freezes_vision(run))
  mesh = mesh or sharding.make_mesh(run.sharding)
  return Setup(run, mesh, run.sharding.rules, tx, schedule)


# ----------------------------------------------------------------------------- parameters


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
      if dataclasses.is_dataclass(new):  # the vision tower's section
        new = dataclasses.asdict(new)
      old = config.model.get(field.name)
      if (list(old) if isinstance(old, tuple) else old) != new:
        changes.append(f"{field.name}: {old} -> {new}")
      config.model[field.name] = new
  return changes


def numerics(model_cfg: ModelConfig) -> dict:
  """The model's numerics fields other than param_dtype (they apply to any checkpoint)."""
  return {k: getattr(model_cfg, k) for k in NUMERICS_FIELDS if k != "param_dtype"}


def adopt_checkpoint_architecture(config: ml_collections.ConfigDict, init_from: str) -> None:
  """Replace config.model's architecture by the checkpoint's, without reading weights (an entry
  point's step, before the config is typed)."""
  arch = model_dirs.read_model_config(
      init_from, **{k: config.model[k] for k in NUMERICS_FIELDS if k != "param_dtype"})
  for change in adopt_architecture(config, arch):
    print(f"  model.{change} (from {init_from})")


def load_initial_params(model_cfg: ModelConfig, init_from: str, seed: int, mesh=None,
                        rules=None, dtype: str | None = None):
  """Parameters from a checkpoint directory (transformers, orbax, or a training workdir) whose
  architecture is `model_cfg`'s (the entry point adopted it); read with `model_cfg`'s numerics
  in `dtype` (default its param_dtype); `seed` fills weights the checkpoint lacks. With a mesh,
  each tensor goes straight to its shards."""
  dtype = dtype or model_cfg.param_dtype
  shardings = None
  if mesh is not None:
    arch = model_cfg.replace(param_dtype=dtype)
    shardings = sharding.tree_shardings(transformer.abstract_params(arch), mesh, rules)
  arch, params = model_dirs.load_model(init_from, dtype=dtype, shardings=shardings,
                                       rng=jax.random.PRNGKey(seed), **numerics(model_cfg))
  differs = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in NUMERICS_FIELDS
             and getattr(arch, f.name) != getattr(model_cfg, f.name)]
  if differs:
    raise ValueError(f"{init_from} holds a model whose {', '.join(differs)} differ from the "
                     "run's model config; start the run with --init_from so it adopts them")
  return params


def base_params_shape(setup: Setup):
  """Shapes of the frozen base of a LoRA run (in lora.base_dtype; QLoRA: quantized from the
  model's param_dtype)."""
  if setup.quantize_cfg is not None:
    shapes = transformer.abstract_params(setup.model_cfg)
    return jax.eval_shape(lambda p: quantize.quantize_params(p, setup.quantize_cfg), shapes)
  cfg = setup.model_cfg.replace(param_dtype=setup.lora_cfg.base_dtype)
  return transformer.abstract_params(cfg)


def sharded_shapes(shapes, setup: Setup):
  """`shapes` (ShapeDtypeStructs) with the shardings the config's rules give them."""
  return jax.tree_util.tree_map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes,
      sharding.tree_shardings(shapes, setup.mesh, setup.rules))


def load_frozen_base(setup: Setup):
  """A LoRA run's frozen base, read from its init_from in lora.base_dtype, sharded."""
  init_from = setup.run.init_from
  if not init_from:
    raise ValueError("a LoRA run fine-tunes a base model: pass --init_from=DIR (a checkpoint "
                     "or a training workdir)")
  if setup.quantize_cfg is not None:
    return _load_quantized_base(init_from, setup)
  return load_initial_params(setup.model_cfg, init_from, setup.train_cfg.seed, setup.mesh,
                             setup.rules, dtype=setup.lora_cfg.base_dtype)


def _load_quantized_base(init_from: str, setup: Setup):
  """QLoRA: the base read into host memory in model.param_dtype, then quantized one weight at a
  time onto the mesh (the devices never hold the float base)."""
  try:
    host = jax.local_devices(backend="cpu")[0]
  except RuntimeError:  # no CPU backend (JAX_PLATFORMS excludes it): load on the default device
    host = None
  with jax.default_device(host):
    params = load_initial_params(setup.model_cfg, init_from, setup.train_cfg.seed)
  shapes = jax.eval_shape(lambda p: quantize.quantize_params(p, setup.quantize_cfg), params)
  return quantize.quantize_params(params, setup.quantize_cfg,
                                  sharding.tree_shardings(shapes, setup.mesh, setup.rules))


def model_params(trainable, frozen, lora_cfg: lora.LoraConfig, dropout_rng=None):
  """The params the model runs: the trained tree itself, or (LoRA) the frozen base wrapped with
  the trained adapters."""
  if frozen is None:
    return trainable
  return lora.wrap(frozen, trainable, lora_cfg, dropout_rng)


def without_vision_gradients(params):
  """`params` with the vision tower and its embedder behind stop_gradient: a frozen tower
  (`Setup.freezes_vision`) adds nothing to the gradient norm and runs no backward pass."""
  return {k: jax.lax.stop_gradient(v) if k in transformer.VISION_SUBTREES else v
          for k, v in params.items()}


# ----------------------------------------------------------------------------- state


def init_state(setup: Setup, params=None, frozen=None):
  """The training state: {step, params (the trained tree), opt_state, rng, nonfinite,
  nonfinite_step, seen}.

  Full fine-tuning trains `params` (random unless given). A LoRA run trains fresh adapters on
  the frozen base `frozen`; `params` is then unused. `nonfinite` counts the steps whose loss or
  gradient norm was not finite (their updates were not applied), `nonfinite_step` is the first
  of them (0: none). `seen` is what the run has trained on up to its step (`seen_counts`).
  """
  rng = jax.random.PRNGKey(setup.train_cfg.seed)
  init_rng, train_rng = jax.random.split(rng)
  if setup.uses_lora:
    params = lora.init(frozen, setup.lora_cfg, init_rng)
  elif params is None:
    params = transformer.init_params(setup.model_cfg, init_rng)
  zero = lambda: jnp.zeros((), jnp.int32)  # separate buffers: each may be donated
  return {"step": zero(), "params": params, "opt_state": setup.tx.init(params),
          "rng": train_rng, "nonfinite": zero(), "nonfinite_step": zero(),
          "seen": jnp.zeros((3,), jnp.int32)}


# The state's `seen` entry is int32 [examples, real tokens // 2**30, real tokens % 2**30]: exact
# past 2**31 tokens without 64-bit integers in JAX. A pure function of the step (no wall time:
# a resumed run's state equals the uninterrupted run's).
_TOKENS_SPLIT = 2**30


def seen_counts(state) -> dict:
  """{examples_seen, real_tokens_seen} the state records (one host read)."""
  examples, high, low = (int(x) for x in jax.device_get(state["seen"]))
  return {"examples_seen": examples, "real_tokens_seen": high * _TOKENS_SPLIT + low}


def with_seen(state, counts: dict):
  """The state recording `counts` (`seen_counts`' keys) in its `seen` entry."""
  tokens = int(counts["real_tokens_seen"])
  seen = np.array([counts["examples_seen"], tokens // _TOKENS_SPLIT, tokens % _TOKENS_SPLIT],
                  np.int32)
  return dict(state, seen=jax.device_put(seen, state["seen"].sharding))


def state_shardings(setup: Setup, abstract):
  repl = sharding.replicated(setup.mesh)
  shardings = {key: repl for key in abstract if key not in ("params", "opt_state")}
  for key in ("params", "opt_state"):
    shardings[key] = sharding.tree_shardings(abstract[key], setup.mesh, setup.rules)
  return shardings


def abstract_state(setup: Setup, frozen_shape=None):
  """Shapes, dtypes and shardings of the training state (nothing allocated)."""
  shapes = jax.eval_shape(lambda f: init_state(setup, frozen=f), frozen_shape)
  shardings = state_shardings(setup, shapes)
  return jax.tree_util.tree_map(
      lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)


def new_state(setup: Setup):
  """(state, frozen) of a new run: random, or from its init_from's parameters (whose
  architecture the entry point adopted); a LoRA run's base is read, sharded."""
  params = frozen = None
  if setup.uses_lora:
    frozen = load_frozen_base(setup)
  elif setup.run.init_from:
    params = load_initial_params(setup.model_cfg, setup.run.init_from, setup.train_cfg.seed,
                                 setup.mesh, setup.rules)
  frozen_shape = None if frozen is None else jax.eval_shape(lambda: frozen)
  target = abstract_state(setup, frozen_shape)
  init_fn = jax.jit(lambda p, f: init_state(setup, p, f), donate_argnums=0,
                    out_shardings=jax.tree_util.tree_map(lambda x: x.sharding, target))
  return init_fn(params, frozen), frozen


# Keys of the state that checkpoints written before them lack; they restore as zeros.
_ADDED_KEYS = ("nonfinite", "nonfinite_step", "seen")


def restore_state(workdir: str, setup: Setup, move_damaged: bool = False,
                  step: int | None = None):
  """(state, frozen, step) of the newest readable checkpoint of a run whose setup is given (or
  of checkpoint `step`). A damaged newer checkpoint is skipped with a notice
  (moved aside with `move_damaged`: a trainer holding the lock). A LoRA run's base comes from
  the checkpoint when it was saved there (lora.save_base), else from the run's init_from."""
  frozen = None
  base_shape = base_params_shape(setup) if setup.uses_lora else None
  target = abstract_state(setup, base_shape)
  if setup.uses_lora:
    if setup.lora_cfg.save_base:
      target["base"] = sharded_shapes(base_shape, setup)
    else:
      frozen = load_frozen_base(setup)

  def target_at(s):
    saved = checkpointing.saved_keys(workdir, s)
    return {k: v for k, v in target.items() if k in saved or k not in _ADDED_KEYS}

  if step is None:
    state, step = checkpointing.restore_latest(workdir, target_at, move_damaged)
  else:
    with checkpointing.manager(workdir, read_only=True) as mngr:
      state = checkpointing.restore(mngr, step, target_at(step))
  for key in _ADDED_KEYS:
    if key not in state:
      state[key] = jax.device_put(jnp.zeros(target[key].shape, jnp.int32), target[key].sharding)
  if "base" in state:
    frozen = state.pop("base")
  return state, frozen, int(step)
