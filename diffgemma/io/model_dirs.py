"""Model checkpoints in and out: transformers directories (DiffusionGemma, Gemma 4) and ours.

Three kinds of directory hold a model:
  * a transformers checkpoint: `config.json` + `model.safetensors` or sharded
    `model-*.safetensors` with `model.safetensors.index.json` (DiffusionGemma, or a Gemma 4 AR
    model whose backbone starts a new diffusion model);
  * an orbax model directory written by `save_orbax` (`config.json` naming our format, plus
    `params/`);
  * a training workdir (`config.json` + `checkpoints/`): its latest parameters.
`load_model` reads any of them; `save_hf` and `save_orbax` write the first two. Writers build
the directory under a temporary name beside the destination and rename it at the end, so an
interrupted or failed write leaves nothing at the destination.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from diffgemma.io import hf_weights
from diffgemma.io.safetensors_dir import CheckpointFormatError, SafetensorsDir, write_dir
from diffgemma.model import lora, transformer
from diffgemma.model.config import ModelConfig
from diffgemma.runs import checkpointing

CONFIG_FILE = "config.json"
ORBAX_PARAMS_DIR = "params"
ORBAX_FORMAT = "diffgemma-orbax-v1"
# Tokenizer, generation and image processor files travel with the weights on conversion.
COMPANION_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "processor_config.json", "preprocessor_config.json")
HF, ORBAX, WORKDIR = "hf", "orbax", "workdir"


def directory_kind(path: str) -> str:
  """HF, ORBAX or WORKDIR; a one-line CheckpointFormatError if `path` is none of them."""
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isdir(path):
    raise CheckpointFormatError(f"checkpoint directory {path!r} not found")
  if not os.path.exists(config_path):
    raise CheckpointFormatError(f"no {CONFIG_FILE} in {path!r}: not a model checkpoint directory")
  if os.path.isdir(os.path.join(path, "checkpoints")):
    return WORKDIR
  config = _read_json(config_path)
  if config.get("format") == ORBAX_FORMAT:
    return ORBAX
  return HF


def _log_to_stderr(message: str) -> None:
  print(message, file=sys.stderr)


def load_model(path: str, dtype: str | None = None, shardings=None, rng=None,
               log: Callable[[str], None] = _log_to_stderr, **overrides: Any):
  """(ModelConfig, params) from a checkpoint directory of any kind.

  Args:
    dtype: parameter dtype to cast to ("bfloat16", "float32"); None keeps the checkpoint's.
    shardings: optional pytree of `jax.sharding.Sharding` matching the params (or a callable
      path -> Sharding): each tensor goes straight to its devices, so a large checkpoint never
      has two copies in host memory.
    rng: initialises the self-conditioning block when importing a Gemma 4 AR checkpoint.
    overrides: ModelConfig fields to set (numerics such as compute_dtype or moe_impl, or
      canvas_length for a Gemma 4 import, which has none).
  """
  kind = directory_kind(path)
  if kind == WORKDIR:
    cfg, params, _ = load_workdir(path, dtype, shardings)
    return cfg.replace(**overrides), params
  config = _read_json(os.path.join(path, CONFIG_FILE))
  if kind == ORBAX:
    return _load_orbax(path, config, dtype, shardings, overrides)
  return _load_hf(path, config, dtype, shardings, rng, log, overrides)


GENERATION_CONFIG_FILE = "generation_config.json"


def declared_eos_ids(path: str) -> tuple[int, ...]:
  """The stop ids a checkpoint directory declares, as transformers' generate reads them: the
  `eos_token_id` (an int or a list) of generation_config.json, else of config.json
  (text_config's, else the top level's); () when it declares none or is not a model directory."""
  for name in (GENERATION_CONFIG_FILE, CONFIG_FILE):
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      continue
    config = _read_json(file)
    declared = (config.get("text_config") or config).get("eos_token_id")
    if declared is None and name == CONFIG_FILE:
      declared = config.get("eos_token_id")
    if declared is not None:
      ids = declared if isinstance(declared, list) else [declared]
      return tuple(dict.fromkeys(int(i) for i in ids if int(i) >= 0))
  return ()


def read_model_config(path: str, dtype: str | None = None, **overrides: Any) -> ModelConfig:
  """The ModelConfig of a checkpoint directory of any kind, without reading weights (to plan
  the parameters' shardings before `load_model` places them)."""
  kind = directory_kind(path)
  if kind == WORKDIR:
    cfg, _, _ = _workdir_sections(path)
  elif kind == ORBAX:
    cfg = _orbax_model_config(path, _read_json(os.path.join(path, CONFIG_FILE)))
  else:
    config = _read_json(os.path.join(path, CONFIG_FILE))
    cfg = hf_weights.config_from_hf(config, param_dtype=dtype or "float32", **overrides)
  return cfg.replace(**({"param_dtype": dtype} if dtype else {}), **overrides)


def load_workdir(path: str, dtype: str | None = None, shardings=None, step: int | None = None):
  """(ModelConfig, params, step) of a training workdir's checkpoint (the latest by default),
  reading the parameters alone: never the optimizer state. A LoRA run's adapters come merged
  into its base (the base read from the checkpoint with `lora.save_base`, else from the run's
  init_from), in the base's dtype."""
  cfg, lora_cfg, init_from = _workdir_sections(path)

  def placed(shapes):
    def target(p, leaf):
      sh = _sharding_at(shardings, _path_keys(p)) if not lora_cfg.enabled else None
      return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh or
                                  jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    return jax.tree_util.tree_map_with_path(target, shapes)

  def read(target):
    """The subtree `target` of checkpoint `step`, else of the newest readable checkpoint."""
    if step is not None:
      return checkpointing.restore_subtree(path, step, target), step
    return checkpointing.restore_latest(
        path, read=lambda s: checkpointing.restore_subtree(path, s, target))

  if not lora_cfg.enabled:
    restored, step = read({"params": placed(transformer.abstract_params(cfg))})
    params = restored["params"]
  else:
    base_cfg = cfg.replace(param_dtype=lora_cfg.base_dtype)
    base_shape = transformer.abstract_params(base_cfg)
    adapter_shape = jax.eval_shape(lambda b: lora.init(b, lora_cfg, jax.random.PRNGKey(0)),
                                   base_shape)
    target = {"params": placed(adapter_shape)}
    if lora_cfg.save_base:
      target["base"] = placed(base_shape)
    restored, step = read(target)
    base = restored.get("base")
    if base is None:
      if not init_from:
        raise checkpointing.CheckpointError(
            f"LoRA run {path!r} has no saved base and no init_from in its config.json")
      _, base = load_model(init_from, dtype=lora_cfg.base_dtype)
    params = lora.merge(base, restored["params"], lora_cfg)
    params = _place_tree(params, shardings)
  params_dtype = jnp.dtype(jax.tree_util.tree_leaves(params)[0].dtype).name
  cfg = cfg.replace(param_dtype=params_dtype)
  if dtype is not None and dtype != params_dtype:
    params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
    cfg = cfg.replace(param_dtype=dtype)
  return cfg, params, int(step)


def _workdir_sections(path: str) -> tuple[ModelConfig, lora.LoraConfig, str | None]:
  """A training workdir's model, its LoRA settings and its init_from, from its config.json:
  the sections that say what its checkpoints hold (the rest of the run's config is the
  trainer's business)."""
  saved = checkpointing.load_config(path)
  try:
    return (ModelConfig(**saved.model.to_dict()),
            lora.run_lora_config(saved.lora.to_dict() if "lora" in saved else None,
                                 saved.get("freeze_router", False)),
            saved.get("init_from") or None)
  except (AttributeError, KeyError, TypeError, ValueError) as e:
    raise checkpointing.CheckpointError(
        f"{os.path.join(path, CONFIG_FILE)}: bad model or lora section: {e}") from None


def _orbax_model_config(path: str, config: dict) -> ModelConfig:
  try:
    return ModelConfig(**{**config["model"], "layer_types": tuple(config["model"]["layer_types"])})
  except (KeyError, TypeError) as e:
    raise CheckpointFormatError(f"{os.path.join(path, CONFIG_FILE)} is malformed: {e}") from None


def _load_hf(path, config, dtype, shardings, rng, log, overrides):
  source = hf_weights.checkpoint_kind(config)
  stored_dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
  dtype = dtype or (stored_dtype if stored_dtype in ("float32", "bfloat16", "float16")
                    else "float32")
  cfg = hf_weights.config_from_hf(config, param_dtype=dtype, **overrides)
  tensors = SafetensorsDir(path)
  skipped = sum(hf_weights.is_audio(n) for n in tensors)
  if skipped:
    log(f"note: skipped {skipped} audio tensors of {path} (DiffusionGemma reads text and images)")
  self_conditioning = None
  if source == hf_weights.GEMMA4:
    rng = jax.random.PRNGKey(0) if rng is None else rng
    self_conditioning = _place_tree(transformer.init_self_conditioning(cfg, rng), shardings,
                                    prefix=("self_conditioning",))
    log(f"note: {path} is a Gemma 4 AR checkpoint: backbone loaded, self-conditioning block "
        "freshly initialised")
  params = hf_weights.params_from_hf(
      tensors, cfg, transformer.abstract_params(cfg), kind=source, dtype=jnp.dtype(dtype),
      place=lambda p, arr: _place(arr, _sharding_at(shardings, p)),
      self_conditioning=self_conditioning)
  return cfg, params


def _load_orbax(path, config, dtype, shardings, overrides):
  import orbax.checkpoint as ocp

  cfg = _orbax_model_config(path, config)
  stored = transformer.abstract_params(cfg)
  target_dtype = jnp.dtype(dtype) if dtype else None

  def target(p, leaf):
    sharding = _sharding_at(shardings, _path_keys(p)) or jax.sharding.SingleDeviceSharding(
        jax.devices()[0])
    return jax.ShapeDtypeStruct(leaf.shape, target_dtype or leaf.dtype, sharding=sharding)

  abstract = jax.tree_util.tree_map_with_path(target, stored)
  params_dir = os.path.join(os.path.abspath(path), ORBAX_PARAMS_DIR)
  if not os.path.isdir(params_dir):
    raise CheckpointFormatError(f"missing {params_dir} (orbax parameters)")
  with ocp.StandardCheckpointer() as ckptr:
    params = ckptr.restore(params_dir, abstract)
  if dtype:
    cfg = cfg.replace(param_dtype=dtype)
  return cfg.replace(**overrides), params


def save_hf(cfg: ModelConfig, params, dest: str, dtype: str | None = None,
            max_shard_bytes: int | None = None, companions_from: str | None = None) -> list[str]:
  """Write transformers' DiffusionGemma layout (config.json + safetensors) to `dest`.

  `DiffusionGemmaForBlockDiffusion.from_pretrained(dest)` loads it. Returns the file names.
  """
  check_params(cfg, params)
  out_dtype = dtype or cfg.param_dtype
  specs = list(hf_weights.hf_tensor_specs(cfg, params, np.dtype(jnp.dtype(out_dtype))))
  with atomic_directory(dest) as tmp:
    kwargs = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    files = write_dir(specs, tmp, **kwargs)
    _write_json(os.path.join(tmp, CONFIG_FILE), hf_weights.config_to_hf(cfg, out_dtype))
    files += [CONFIG_FILE] + _copy_companions(companions_from, tmp)
  return files


def save_orbax(cfg: ModelConfig, params, dest: str, dtype: str | None = None,
               companions_from: str | None = None) -> None:
  """Write our format: config.json (the ModelConfig) + params/ (an orbax checkpoint)."""
  import orbax.checkpoint as ocp

  check_params(cfg, params)
  if dtype:
    params = jax.tree_util.tree_map(lambda x: jnp.asarray(x).astype(dtype), params)
    cfg = cfg.replace(param_dtype=dtype)
  with atomic_directory(dest) as tmp:
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save(os.path.join(os.path.abspath(tmp), ORBAX_PARAMS_DIR), params)
      ckptr.wait_until_finished()
    _write_json(os.path.join(tmp, CONFIG_FILE),
                {"format": ORBAX_FORMAT, "model": dataclasses.asdict(cfg)})
    _copy_companions(companions_from, tmp)


def check_params(cfg: ModelConfig, params) -> None:
  """Raise WeightMappingError naming the first leaf whose shape does not fit `cfg`."""
  expected = transformer.abstract_params(cfg)
  flat, _ = jax.tree_util.tree_flatten_with_path(expected)
  got = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  for path, leaf in flat:
    if path not in got:
      raise hf_weights.WeightMappingError(f"parameter {jax.tree_util.keystr(path)} is missing")
    if tuple(got[path].shape) != tuple(leaf.shape):
      raise hf_weights.WeightMappingError(
          f"parameter {jax.tree_util.keystr(path)} has shape {tuple(got[path].shape)}, the "
          f"config expects {tuple(leaf.shape)}")


@contextlib.contextmanager
def atomic_directory(dest: str):
  """Yield a temporary directory beside `dest`; rename it to `dest` only if the body succeeds.

  `dest` must not exist (or be an empty directory): nothing already there is overwritten.
  """
  dest = os.path.abspath(dest)
  if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
    raise CheckpointFormatError(f"destination {dest} already exists and is not empty; "
                                "choose a new directory")
  parent = os.path.dirname(dest)
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dest)}.tmp-", dir=parent)
  try:
    yield tmp
    if os.path.isdir(dest):
      os.rmdir(dest)  # empty, checked above
    os.rename(tmp, dest)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _copy_companions(source: str | None, dest: str) -> list[str]:
  if not source or not os.path.isdir(source):
    return []
  copied = []
  for name in COMPANION_FILES:
    if os.path.exists(os.path.join(source, name)):
      shutil.copy2(os.path.join(source, name), os.path.join(dest, name))
      copied.append(name)
  return copied


def _place(arr: np.ndarray, sharding):
  """A host array onto its devices; with a sharding, each device reads only its slice."""
  if sharding is None:
    return jnp.asarray(arr)
  return jax.make_array_from_callback(arr.shape, sharding, lambda index: arr[index])


def _place_tree(tree, shardings, prefix: tuple = ()):
  """device_put each leaf onto the sharding at prefix + its path (no-op without shardings)."""
  if shardings is None:
    return tree
  return jax.tree_util.tree_map_with_path(
      lambda p, x: jax.device_put(x, _sharding_at(shardings, prefix + _path_keys(p))), tree)


def _sharding_at(shardings, path):
  if shardings is None:
    return None
  if callable(shardings):
    return shardings(tuple(path))
  for key in path:
    shardings = shardings[key]
  return shardings


def _path_keys(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def _read_json(path: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError:
    raise CheckpointFormatError(f"{path} is not valid JSON") from None


def _write_json(path: str, obj) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=2)
