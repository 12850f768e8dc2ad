"""LoRA fine-tuning of DiffusionGemma 26B-A4B on Sudoku, on 2 x 80 GB GPUs (the report's setup).

LoRA on every linear: attention q/k/v/o, dense MLP, router, the stacked experts (a per-expert
low-rank pair) and the self-conditioning block. The base is frozen in bfloat16 and sharded over
both devices (FSDP); adapters and their AdamW state are float32.

  python train.py --config=sft_sudoku_lora --workdir=runs/lora26b --init_from=/ckpt/dg26b
  python train.py --config=sft_sudoku_lora --dry_run        # memory plan on 2 simulated devices
  python train.py --config=sft_sudoku_lora:vision --dry_run --dry_run_images=1

`:vision` gives the model the released vision tower (diffgemma/model/config.py,
`gemma_26b_a4b_vision`), frozen in the base as the text model is, so the plan counts it;
--dry_run_images=1 plans each row with one image at the tower's 280 soft tokens (the prompt
lengthened by its placeholders). A run with --init_from takes the checkpoint's architecture,
its vision tower included, whichever variant it names.
"""

import dataclasses

from configs import sft_sudoku
from diffgemma.model.config import gemma_26b_a4b, gemma_26b_a4b_vision

VARIANTS = {"": gemma_26b_a4b, "vision": gemma_26b_a4b_vision}


def get_config(variant: str = ""):
  if variant not in VARIANTS:
    raise ValueError(f"unknown sft_sudoku_lora variant {variant!r}; choose one of "
                     f"{tuple(VARIANTS)}")
  c = sft_sudoku.get_config()
  c.num_train_steps = 1000
  c.batch_size = 8
  c.grad_accum_steps = 1
  c.max_train_minutes = 0.0  # no wall-clock stop on GPUs
  c.checkpoint_every = 100
  c.device_memory_gib = 80.0  # A100 / H100 80 GB: --dry_run checks the plan against this

  # The released architecture (replaced by the checkpoint's own config with --init_from); the
  # 256-token canvas holds the 81 digits, EOS and padding. Numerics: bfloat16 compute,
  # per-layer rematerialisation, and "tiled_scan" experts: exact on every backend, one expert's
  # weights in memory at a time, and a memory plan that --dry_run can see on a CPU (XLA:CPU
  # lowers ragged_dot to a dense all-experts product). On GPUs, moe_impl="pallas" is the
  # grouped kernel. Tiles of 64 rows: less padding per expert than 256 (RESULTS.md, "Recipe notes").
  c.model = type(c.model)(dataclasses.asdict(VARIANTS[variant](
      param_dtype="bfloat16", compute_dtype="bfloat16", moe_impl="tiled_scan", moe_tile_size=64,
      remat="full")))

  c.lora.enabled = True
  c.lora.rank = 16
  c.lora.alpha = 32.0
  c.lora.dropout = 0.0
  c.lora.base_dtype = "bfloat16"

  c.sharding.fsdp = 2  # two devices; base weights and batch split over both

  c.optimizer.lr = 2e-4
  c.optimizer.warmup_steps = 50
  c.optimizer.weight_decay = 0.0

  c.eval.every_steps = 250
  c.eval.batch_size = 16
  c.sampler.max_new_tokens = 256
  return c
