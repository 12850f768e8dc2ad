"""SFT of a small DiffusionGemma on generated Sudoku: the CPU default.

python train.py --config=sft_sudoku --workdir=/tmp/sudoku [--config.optimizer.lr=3e-3 ...]
"""

import dataclasses

import ml_collections

from diffgemma.model.config import ModelConfig
from diffgemma.model.lora import LoraConfig
from diffgemma.model.sharding import ShardingConfig


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.num_train_steps = 4000  # see README "Expected result" for minutes per machine
  c.batch_size = 16  # more updates per CPU minute beat bigger batches here (see README)
  c.max_train_minutes = 30.0  # stop (and checkpoint) after this much wall-clock time; 0 = off
  c.log_every = 20
  c.checkpoint_every = 250
  c.keep_checkpoints = 2
  # A step whose loss or gradient norm is not finite: "stop" the run there (nothing of it is
  # saved), or "skip" it (no update) at most max_nonfinite_skips times.
  c.on_nonfinite = "stop"
  c.max_nonfinite_skips = 10

  # Model: DiffusionGemma architecture at Sudoku size; every ModelConfig field is a config key.
  c.model = ml_collections.ConfigDict(dataclasses.asdict(ModelConfig(
      # 832 ids although the "digits" prompt uses 13: noise draws uniform ids, so a corrupted
      # cell almost always holds an id that never appears clean.
      vocab_size=832, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
      num_kv_heads=4, head_dim=32, global_head_dim=32, num_global_kv_heads=2,
      # theta ~ (9 / 2 pi)**(head_dim / 2): one RoPE frequency turns once per 9 positions, so the
      # cells of a grid column share a phase; q/k norms start at head_dim**-0.25 so attention
      # logits start at unit scale (training from scratch).
      sliding_rope_theta=314.6, qk_norm_init=32 ** -0.25,
      sliding_window=1024, num_experts=8, top_k_experts=2, moe_intermediate_size=128,
      canvas_length=81, param_dtype="float32", compute_dtype="float32",
      moe_impl="tiled", moe_tile_size=128)))

  # Objective (diffgemma.training.losses.LossConfig; prompt_len comes from the task).
  c.loss = ml_collections.ConfigDict(dict(
      encoder_weight=0.0, decoder_weight=1.0, encoder_loss_on_prompt=False,
      noise_schedule="linear", t_eps=1e-3, self_conditioning_prob=0.5,
      decoder_weighting="flat"))

  c.grad_accum_steps = 1  # split each batch into this many micro-batches (same result, less memory)
  c.freeze_router = False  # NeMo's SFT default is True: no router updates (LoRA: no router adapter)

  # LoRA (diffgemma.model.lora.LoraConfig): off here; see configs/sft_sudoku_lora*.py.
  c.lora = ml_collections.ConfigDict(dataclasses.asdict(LoraConfig()))

  # Device mesh and logical axis rules (diffgemma.model.sharding.ShardingConfig): fsdp=-1 spreads the
  # batch and the weights over all local devices (one CPU: nothing to split).
  c.sharding = ml_collections.ConfigDict(dataclasses.asdict(ShardingConfig()))

  c.optimizer = ml_collections.ConfigDict(dict(
      lr=3e-3, warmup_steps=50, schedule="cosine", end_lr_fraction=0.05, weight_decay=0.01,
      b1=0.9, b2=0.99, grad_clip=1.0,
      # "adamw" | "adafactor" (factored second moments); moments stored in "float32" | "bfloat16".
      name="adamw", state_dtype="float32"))

  # Training data: freshly generated puzzles, givens range moving from easy to the target mix.
  c.data = ml_collections.ConfigDict(dict(
      seed=1, start_min_givens=40, start_max_givens=50, min_givens=28, max_givens=46,
      curriculum_steps=1000, num_threads=1, prefetch=4,
      # "digits": a given is the same token as that digit on the canvas, so copying it needs only
      # the canvas -> prompt attention; "cell_tokens" must also learn 729 rare prompt embeddings
      # and its runs sat on the copy plateau for 700-1100+ steps (benchmarks/RESULTS.md).
      prompt_format="digits"))

  # Sampler (report Table 2 defaults; diffgemma.sampling.sampler.SamplerConfig).
  c.sampler = ml_collections.ConfigDict(dict(
      max_denoising_steps=48, entropy_bound=0.1, t_max=0.8, t_min=0.4,
      confidence_threshold=0.005, stability_threshold=1, max_new_tokens=81, mode="diffusion",
      fused_step=False, top_k=0))

  # Periodic evaluation on held-out generated puzzles (seed differs from training data).
  c.eval = ml_collections.ConfigDict(dict(
      every_steps=500, num_puzzles=64, min_givens=38, max_givens=46, seed=12345, batch_size=64,
      trace_examples=2,  # denoising traces of the first examples, drawn in TensorBoard
      # Early warning: the first eval at or after plateau_check_step warns when blank-cell
      # accuracy is not above plateau_blank_accuracy (a run still copying the givens); 0 = off.
      plateau_check_step=500, plateau_blank_accuracy=0.2))
  return c
