"""The stage seam: what the one training loop (`diffgemma.training.loop`) asks of a stage.

A stage supplies the loss and the batches of a training run; the update step
(`diffgemma.training.update_step`), checkpoints, logging and the guards are shared. A new stage
is one module in this package that defines a class satisfying `Stage`, plus one line in the
registry (`diffgemma.training.stages.STAGES`); a config selects it with `config.stage`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import ml_collections

ConfigDict = ml_collections.ConfigDict
# {name: (jitted program, abstract arguments)}: programs besides the update step that a run
# compiles, planned by `train.py --dry_run` (e.g. SD·RL's rollout).
Programs = dict[str, tuple[Any, tuple]]


@runtime_checkable
class Stage(Protocol):
  """One training stage. Built as `Stage(settings, task, setup)` from the typed run config:
  `settings` its own section (`Stage.settings`), `setup` the run's typed sections and mesh."""

  name: ClassVar[str]  # the registry name; also the progress bar's label
  # None: a step's key is fold_in(rng, step); else fold_in(fold_in(rng, stream), step).
  update_stream: ClassVar[int | None]
  # Whether a new run needs --init_from (e.g. SD·RL starts from a trained model).
  requires_init_from: ClassVar[bool]

  @staticmethod
  def settings(config: ConfigDict) -> Any:
    """The stage's own section of the config, typed and checked, before anything is written
    (ValueError, one line); it becomes `RunConfig.stage_settings` (None: the stage has none)."""

  def loss_fn(self, params, batch, rng) -> tuple[jax.Array, dict]:
    """(scalar loss, metrics) of one batch; `params` are what the model runs."""

  def start(self, state, frozen, start_step: int, workdir: str) -> None:
    """Once, before the first batch of this invocation (a resumed run starts at start_step)."""

  def next_batch(self, step: int, state, frozen) -> tuple[dict, dict]:
    """(global batch of numpy arrays for step `step`, host-side metrics to log)."""

  def batch_shapes(self) -> dict:
    """ShapeDtypeStructs of one global batch (shardings and --dry_run)."""

  def is_boundary(self, step: int) -> bool:
    """Whether a checkpoint or a stop may fall after `step`."""

  def tokens_per_batch(self) -> int | None:
    """Training tokens of one batch, for tokens/s (None: not meaningful for this stage)."""

  def batch_counts(self, step: int, batch) -> tuple[jax.Array, jax.Array]:
    """(examples, real tokens) the update of `step` trains on, as scalars computed on the
    device from the global `batch` (the loop sums them into examples_seen and
    real_tokens_seen)."""

  def progress_fields(self, metrics: dict) -> dict[str, str]:
    """The few numbers the progress bar shows, formatted."""

  def planned_programs(self, state, frozen) -> Programs:
    """Programs other than the update step a run compiles, for --dry_run ({}: none)."""
