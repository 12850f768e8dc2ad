"""A trained model with its task, for evaluation and sampling: parameters only, never the
optimizer state."""

from __future__ import annotations

import dataclasses

import ml_collections

from diffgemma import checkpoint_io, checkpointing, errors, run_config, run_state, sampler
from diffgemma.config import ModelConfig
from diffgemma.tasks import make_task
from diffgemma.tasks.base import Task


@dataclasses.dataclass
class Run:
  config: ml_collections.ConfigDict
  model_cfg: ModelConfig
  sampler_cfg: sampler.SamplerConfig
  params: dict
  step: int
  task: Task


def load_run(workdir: str, eval_overrides: dict | None = None, **sampler_overrides) -> Run:
  """Config, task and latest parameters of a workdir (CheckpointError if there is none); a
  LoRA run's adapters come merged into its base. `eval_overrides` set config.eval keys (e.g.
  a chat task's metric) before the task is built."""
  config = _with_eval_overrides(checkpointing.load_config(workdir), eval_overrides)
  task = _task(config, workdir)  # a bad task config fails before the weights load
  model_cfg, params, step = checkpoint_io.load_workdir(workdir)
  return Run(config, model_cfg, _sampler(config, task, sampler_overrides), params, step, task)


def load_checkpoint_as_run(init_from: str, config, eval_overrides: dict | None = None,
                           **sampler_overrides) -> Run:
  """A model checkpoint directory (transformers, orbax or workdir) evaluated under `config`'s
  task and sampler settings; the architecture comes from the checkpoint (step 0)."""
  config = _with_eval_overrides(ml_collections.ConfigDict(config.to_dict()), eval_overrides)
  with config.unlocked():
    config.init_from = init_from  # a chat task's default tokenizer
  params = run_state.load_initial_params(config, init_from)
  task = _task(config, init_from)
  return Run(config, run_config.model_config(config), _sampler(config, task, sampler_overrides),
             params, 0, task)


def _with_eval_overrides(config, overrides):
  for key, value in (overrides or {}).items():
    if key not in config.eval:
      raise errors.ConfigError(f"--{key} does not apply to this run's task "
                               f"({config.get('task', {}).get('name', 'sudoku')})")
    with config.unlocked():
      config.eval[key] = value
  return config


def _task(config, where: str) -> Task:
  try:
    task = make_task(config)
    if config.model.vocab_size < task.min_vocab_size:
      raise ValueError(f"model.vocab_size={config.model.vocab_size} is too small for the task "
                       f"(needs {task.min_vocab_size})")
    return task
  except errors.InputError:
    raise
  except (KeyError, TypeError, ValueError) as e:
    raise checkpointing.CheckpointError(f"{where} does not fit the config: {e}") from None


def _sampler(config, task: Task, overrides) -> sampler.SamplerConfig:
  cfg = run_config.sampler_config(config, task.stop_token_ids)
  return cfg.replace(**overrides) if overrides else cfg
