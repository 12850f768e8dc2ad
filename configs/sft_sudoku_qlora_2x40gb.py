"""QLoRA of DiffusionGemma 26B-A4B on Sudoku on TWO 40 GB GPUs (2 x A100-40GB).

The `sft_sudoku_lora` recipe (2 x 80 GB: LoRA rank 16, alpha 32 on every linear, float32
adapters and AdamW state) with the frozen base quantized to int4 as in `sft_sudoku_qlora`
(weight-only, one bfloat16 scale per 128 input rows of each output channel; router and tied
embedding stay bfloat16), split over both devices by tensor parallelism: heads, MLP and expert
hidden units and the vocabulary are halved on each device, so are the activations and logits
that dominate the step's temporaries (FSDP would plan over 40 GiB per device; see
benchmarks/RESULTS.md, "Recipe notes"). Both devices work on the same rows: the batch
of 8 runs as 8 micro-batches of one row (gradient accumulation: the same update as one batch of
8). --dry_run plans it at 30 layers against 40 GiB per device (the figure: docs/scale.md,
benchmarks/RESULTS.md).

  python train.py --config=sft_sudoku_qlora_2x40gb --workdir=runs/qlora26b --init_from=/ckpt/dg26b
  python train.py --config=sft_sudoku_qlora_2x40gb --dry_run      # memory plan on 2 devices
"""

import ml_collections

from configs import sft_sudoku_lora


def get_config():
  c = sft_sudoku_lora.get_config()
  c.device_memory_gib = 40.0
  c.sharding.fsdp = 1
  c.sharding.tensor = 2  # two devices; the quantized base and activations split over both
  c.batch_size = 8
  c.grad_accum_steps = 8  # micro-batches of one row

  c.lora.base_dtype = "int4"  # rank 16, alpha 32: sft_sudoku_lora's
  # quantize.QuantizeConfig fields besides dtype (taken from lora.base_dtype).
  c.quantize = ml_collections.ConfigDict(dict(group_size=128, scale_dtype="bfloat16"))

  c.eval.batch_size = 8
  return c
