"""The base every recipe derives from: run bookkeeping, a small DiffusionGemma, the objective,
the optimizer, LoRA (off), sharding and the sampler, each section built from its dataclass, so
every field of every section is a key a recipe or the command line can set.

A recipe (configs/sft_sudoku.py, configs/sft_chat.py, ...) calls `get_config()` and sets what its
task needs: the task and data sections, the model's vocabulary and positions, the objective's
terms, evaluation. Every key is overridable from the command line (--config.KEY=VALUE).
"""

import dataclasses

import ml_collections

from diffgemma.model.config import ModelConfig
from diffgemma.model.lora import LoraConfig
from diffgemma.model.sharding import ShardingConfig
from diffgemma.runs import checkpointing
from diffgemma.sampling.sampler import SamplerConfig
from diffgemma.training.losses import LossConfig
from diffgemma.training.optimizer import OptimizerConfig


def section(typed) -> ml_collections.ConfigDict:
  """A config section holding every field of the typed section `typed` (a dataclass)."""
  return ml_collections.ConfigDict(dataclasses.asdict(typed))


def small_model(**fields) -> ml_collections.ConfigDict:
  """A DiffusionGemma of a few million parameters for a 2-core CPU (every ModelConfig field is a
  config key); `fields` set the task's vocabulary, positions and canvas."""
  base = dict(
      hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
      num_kv_heads=4, head_dim=32, global_head_dim=32, num_global_kv_heads=2,
      # q/k norms start at head_dim**-0.25 so attention logits start at unit scale (training
      # from scratch).
      qk_norm_init=32 ** -0.25,
      sliding_window=1024, num_experts=8, top_k_experts=2, moe_intermediate_size=128,
      param_dtype="float32", compute_dtype="float32", moe_impl="tiled", moe_tile_size=128)
  model = section(ModelConfig(**{**base, **fields}))
  if "layer_types" not in fields:  # () is the default pattern for any num_layers, so that
    model.layer_types = ()         # --config.model.num_layers=N alone gives a valid model
  return model


def get_config():
  c = ml_collections.ConfigDict()
  # The training stage (diffgemma.training.stages): "sft" | "sdrl".
  c.stage = "sft"
  c.seed = 0
  c.num_train_steps = 4000
  c.min_useful_steps = 0  # with num_train_steps=0: a fitted count below this is warned about
  c.batch_size = 16  # more updates per CPU minute beat bigger batches here (see README)
  c.max_train_minutes = 30.0  # stop (and checkpoint) after this much wall-clock time; 0 = off
  c.log_every = 20
  c.checkpoint_every = 250
  c.keep_checkpoints = 2
  # A checkpoint's background write still going after this many seconds (a hung file system)
  # ends the run in one line (see checkpointing.DEFAULT_TIMEOUT_S for the default's reasons).
  c.checkpoint_timeout_s = checkpointing.DEFAULT_TIMEOUT_S
  # A step whose loss or gradient norm is not finite: "stop" the run there (nothing of it is
  # saved), or "skip" it (no update) at most max_nonfinite_skips times.
  c.on_nonfinite = "stop"
  c.max_nonfinite_skips = 10

  c.model = small_model()

  # Objective (diffgemma.training.losses.LossConfig, whose docstring explains each key; the
  # layout P, K, C comes from the task): the decoder's denoising CE alone by default.
  c.loss = section(LossConfig(encoder_weight=0.0))

  c.grad_accum_steps = 1  # split each batch into this many micro-batches (same result, less memory)
  c.freeze_router = False  # NeMo's SFT default is True: no router updates (LoRA: no router adapter)
  # A model with a vision tower (from --init_from): full fine-tuning leaves it unchanged.
  c.freeze_vision = True

  # LoRA (diffgemma.model.lora.LoraConfig): off here; see configs/sft_sudoku_lora*.py.
  c.lora = section(LoraConfig())

  # Device mesh and logical axis rules (diffgemma.model.sharding.ShardingConfig): fsdp=-1 spreads
  # the batch and the weights over all local devices (one CPU: nothing to split).
  c.sharding = section(ShardingConfig())

  # AdamW with a cosine schedule (diffgemma.training.optimizer.OptimizerConfig); name "adafactor"
  # factors the second moments, state_dtype "bfloat16" halves the moments' memory.
  c.optimizer = section(OptimizerConfig())

  # Sampler (report Table 2 defaults; diffgemma.sampling.sampler.SamplerConfig); a recipe sets
  # max_new_tokens to its reply budget.
  c.sampler = section(SamplerConfig())
  return c
