"""A trained model with its task, for evaluation and sampling: parameters only, never the
optimizer state.

`open_run` / `open_checkpoint` read configs only and build the task, so a tool can check its
input (a puzzle, a data file) before `Run.load` reads the weights.
"""

from __future__ import annotations

import dataclasses

import ml_collections

from diffgemma import errors
from diffgemma.io import model_dirs
from diffgemma.model.config import ModelConfig
from diffgemma.runs import checkpointing
from diffgemma.training import run_config, training_state
from diffgemma.sampling import sampler
from diffgemma.tasks import make_task
from diffgemma.tasks.base import Task


@dataclasses.dataclass
class Run:
  """A model's config (as saved, and typed once: `run_cfg`), task and sampler; `load` fills
  model_cfg, params and step."""

  config: ml_collections.ConfigDict
  run_cfg: run_config.RunConfig
  task: Task
  sampler_cfg: sampler.SamplerConfig
  source: str  # the workdir or checkpoint directory
  is_workdir: bool
  model_cfg: ModelConfig | None = None
  params: dict | None = None
  step: int | None = None

  def untrained_ar_head(self) -> str | None:
    """One warning line when the sampler decodes left to right (`mode="ar"` or an AR fallback)
    through an encoder next-token head this run never trained (`loss.encoder_weight=0` and no
    `init_from` that could have brought a trained one), else None. Such a head writes near
    chance (benchmarks/RESULTS.md: AR on the Sudoku default keeps 10% of the givens)."""
    uses_ar = (self.sampler_cfg.mode == sampler.AR
               or self.sampler_cfg.ar_fallback != sampler.FALLBACK_OFF)
    if not uses_ar or not self.is_workdir or self.run_cfg.init_from:
      return None
    if self.run_cfg.loss.uses_encoder_loss:
      return None
    return (f"warning: {self.source} never trained the encoder's next-token head "
            "(loss.encoder_weight=0 or encoder_scope=off), which AR decoding and AR fallback "
            "read; expect near-chance AR tokens (train with loss.encoder_weight > 0)")

  def load(self) -> Run:
    """Read the parameters (a workdir's latest checkpoint; a LoRA run's adapters merged into
    its base), once."""
    if self.params is None:
      if self.is_workdir:
        self.model_cfg, self.params, self.step = model_dirs.load_workdir(self.source)
      else:
        self.params = training_state.load_initial_params(self.run_cfg.model, self.source,
                                                         self.run_cfg.train.seed)
        self.model_cfg, self.step = self.run_cfg.model, 0
    return self


def open_run(workdir: str, eval_overrides: dict | None = None, **sampler_overrides) -> Run:
  """A training run's config and task (CheckpointError if `workdir` holds no run).
  `eval_overrides` set config.eval keys (e.g. a chat task's metric) before the task is built."""
  config = _with_eval_overrides(checkpointing.load_config(workdir), eval_overrides)
  run_cfg = _typed(config, workdir)
  task = _task(config, workdir)
  return Run(config, run_cfg, task, _sampler(run_cfg, task, sampler_overrides), workdir, True)


def open_checkpoint(init_from: str, config, eval_overrides: dict | None = None,
                    **sampler_overrides) -> Run:
  """A model checkpoint directory (transformers, orbax or workdir) under `config`'s task and
  sampler settings; the architecture comes from the checkpoint's config (step 0)."""
  config = _with_eval_overrides(ml_collections.ConfigDict(config.to_dict()), eval_overrides)
  with config.unlocked():
    config.init_from = init_from  # a chat task's default tokenizer
  training_state.adopt_checkpoint_architecture(config, init_from)
  run_cfg = _typed(config, init_from)
  task = _task(config, init_from)
  return Run(config, run_cfg, task, _sampler(run_cfg, task, sampler_overrides), init_from,
             False)


def load_run(workdir: str, eval_overrides: dict | None = None, **sampler_overrides) -> Run:
  """`open_run`, then its latest parameters."""
  return open_run(workdir, eval_overrides, **sampler_overrides).load()


def _with_eval_overrides(config, overrides):
  for key, value in (overrides or {}).items():
    if key not in config.eval:
      raise errors.ConfigError(f"--{key} does not apply to this run's task "
                               f"({config.get('task', {}).get('name', 'sudoku')})")
    with config.unlocked():
      config.eval[key] = value
  return config


def _typed(config, where: str) -> run_config.RunConfig:
  """The one conversion of the run's config (its stage's section is a training matter)."""
  try:
    return run_config.build(config)
  except (KeyError, TypeError, ValueError) as e:
    raise checkpointing.CheckpointError(f"{where}: bad config: {errors.one_line(e)}") from None


def _task(config, where: str) -> Task:
  try:
    return make_task(config, training=False)
  except errors.InputError:
    raise
  except (KeyError, TypeError, ValueError) as e:
    raise checkpointing.CheckpointError(f"{where} does not fit the config: {e}") from None


def _sampler(run_cfg: run_config.RunConfig, task: Task, overrides) -> sampler.SamplerConfig:
  cfg = run_cfg.sampler.with_stops(task.stop_token_ids)
  try:
    return cfg.replace(**overrides) if overrides else cfg
  except (TypeError, ValueError) as e:
    raise errors.ConfigError(f"bad sampler override: {e}") from None
