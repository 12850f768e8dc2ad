"""The base every recipe derives from: run bookkeeping, a small DiffusionGemma, the objective,
the optimizer, LoRA (off), sharding and the sampler, each section with its defaults.

A recipe (configs/sft_sudoku.py, configs/sft_chat.py, ...) calls `get_config()` and sets what its
task needs: the task and data sections, the model's vocabulary and positions, the objective's
terms, evaluation. Every key is overridable from the command line (--config.KEY=VALUE).
"""

import dataclasses

import ml_collections

from diffgemma.model.config import ModelConfig
from diffgemma.model.lora import LoraConfig
from diffgemma.model.sharding import ShardingConfig


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
  return ml_collections.ConfigDict(dataclasses.asdict(ModelConfig(**{**base, **fields})))


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
  # A step whose loss or gradient norm is not finite: "stop" the run there (nothing of it is
  # saved), or "skip" it (no update) at most max_nonfinite_skips times.
  c.on_nonfinite = "stop"
  c.max_nonfinite_skips = 10

  c.model = small_model()

  # Objective (diffgemma.training.losses.LossConfig; the layout P, K, C comes from the task).
  # normalization: each loss term's batch mean, "token" (every scored token alike; NeMo
  # AutoModel's) or "example" (each example's token mean, then the mean over examples).
  # t_distribution: "uniform" t ~ U(t_eps, 1) or "sqrt" (more t near 1); fill_noise: the EOS fill
  # after a reply corrupted "as_reply" or "always"; end_weight: the CE weight of each reply's end
  # token (a chat reply's end-of-turn) against 1 for the rest (LossConfig's docstring).
  c.loss = ml_collections.ConfigDict(dict(
      encoder_weight=0.0, decoder_weight=1.0, noise_schedule="linear", t_eps=1e-3,
      self_conditioning_prob=0.5, decoder_weighting="flat", normalization="token",
      t_distribution="uniform", fill_noise="as_reply", end_weight=1.0))

  c.grad_accum_steps = 1  # split each batch into this many micro-batches (same result, less memory)
  c.freeze_router = False  # NeMo's SFT default is True: no router updates (LoRA: no router adapter)

  # LoRA (diffgemma.model.lora.LoraConfig): off here; see configs/sft_sudoku_lora*.py.
  c.lora = ml_collections.ConfigDict(dataclasses.asdict(LoraConfig()))

  # Device mesh and logical axis rules (diffgemma.model.sharding.ShardingConfig): fsdp=-1 spreads
  # the batch and the weights over all local devices (one CPU: nothing to split).
  c.sharding = ml_collections.ConfigDict(dataclasses.asdict(ShardingConfig()))

  c.optimizer = ml_collections.ConfigDict(dict(
      lr=3e-3, warmup_steps=50, schedule="cosine", end_lr_fraction=0.05, weight_decay=0.01,
      b1=0.9, b2=0.99, grad_clip=1.0,
      # "adamw" | "adafactor" (factored second moments); moments stored in "float32" | "bfloat16".
      name="adamw", state_dtype="float32"))

  # Sampler (report Table 2 defaults; diffgemma.sampling.sampler.SamplerConfig); a recipe sets
  # max_new_tokens to its reply budget.
  c.sampler = ml_collections.ConfigDict(dict(
      max_denoising_steps=48, entropy_bound=0.1, t_max=0.8, t_min=0.4,
      confidence_threshold=0.005, stability_threshold=1, max_new_tokens=256, mode="diffusion",
      fused_step=False, top_k=0))
  return c
