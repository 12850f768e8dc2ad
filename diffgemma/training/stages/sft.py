"""The SFT stage: the task's training batches and the SFT objective, fed to the update step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from diffgemma.runs import guard
from diffgemma.training.training_state import Setup
from diffgemma.tasks.base import PackedLayout, Task
from diffgemma.training import losses


class SftStage:
  """Supervised fine-tuning: the task's batches and `losses.sft_loss` on its layout, or on its
  packed rows when the task packs (`Task.packing`; a batch is then B rows); with its images,
  for a task that reads them (`Task.image_slots`; image data is never packed)."""

  name = "sft"
  update_stream = None

  requires_init_from = False

  @staticmethod
  def settings(config: ml_collections.ConfigDict) -> None:
    del config  # SFT has no section of its own: training.run_config and the task check its keys

  def __init__(self, settings: None, task: Task, setup: Setup):
    del settings
    self.task, self.setup = task, setup
    self.batch_size = setup.train_cfg.batch_size
    self.num_steps = setup.train_cfg.num_train_steps
    self.layout = task.packing or task.layout
    self._batches = None

  def loss_fn(self, params, batch, rng):
    return losses.sft_loss(params, self.setup.model_cfg, self.setup.loss_cfg, self.layout,
                           batch, rng)

  def batch_shapes(self):
    return {**losses.sft_batch_shapes(self.layout, self.batch_size),
            **losses.image_batch_shapes(self.task.image_slots, self.batch_size)}

  def start(self, state, frozen, start_step: int, workdir: str):
    del state, frozen
    self._workdir = workdir
    self._batches = self.task.train_batches(self.batch_size, self.num_steps, start_step,
                                            jax.process_index(), jax.process_count())

  def next_batch(self, step, state, frozen):
    del state, frozen
    batch = guard.next_batch(self._batches, step + 1, self._workdir)
    return {k: np.asarray(v) for k, v in batch.items()}, {}

  def is_boundary(self, step: int) -> bool:
    del step
    return True

  def planned_programs(self, state, frozen) -> dict:
    del state, frozen
    return {}

  def tokens_per_batch(self) -> int:
    return self.batch_size * self.layout.seq_len

  def batch_counts(self, step, batch):
    """The batch's examples (rows holding a valid token; packed: the rows' examples) and its
    valid tokens (prompt and canvases, padding left out)."""
    del step
    if isinstance(self.layout, PackedLayout):
      examples = jnp.sum(batch["num_canvases"] > 0, dtype=jnp.int32)
    else:
      examples = jnp.sum(jnp.any(batch["valid"], axis=1), dtype=jnp.int32)
    return examples, jnp.sum(batch["valid"], dtype=jnp.int32)

  @staticmethod
  def progress_fields(metrics):
    return {"loss": f"{metrics['loss']:.4f}", "acc": f"{metrics['decoder_token_accuracy']:.3f}"}
