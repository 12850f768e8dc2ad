"""QLoRA of DiffusionGemma 26B-A4B on Sudoku on ONE 48 GB GPU (L40S, A6000, RTX 6000 Ada).

The `sft_sudoku_lora` recipe (adapters on every linear, float32 adapters and AdamW state, the
same alpha / rank = 2) at rank 8 on a frozen base quantized to int4 (weight-only: values two to
a byte, one bfloat16 scale per 128 input rows of each output channel; the router and the tied
embedding stay in bfloat16; see diffgemma/model/quantize.py). The batch of 8 runs as 8
micro-batches of one row (gradient accumulation: same update, one row's activations). The
plans behind rank 8 and int4: benchmarks/RESULTS.md, "Recipe notes".

  python train.py --config=sft_sudoku_qlora --workdir=runs/qlora26b --init_from=/ckpt/dg26b
  python train.py --config=sft_sudoku_qlora --dry_run          # memory plan on one device

On the GPU, --config.model.moe_impl=pallas selects the grouped expert kernel (it dequantizes a
layer's experts at once, 1 GB of bfloat16 transient); "tiled_scan" dequantizes one expert at a
time and is what --dry_run plans on a CPU.
"""

import ml_collections

from configs import sft_sudoku_lora


def get_config():
  c = sft_sudoku_lora.get_config()
  c.device_memory_gib = 48.0
  c.sharding.fsdp = 1  # one device
  c.batch_size = 8
  c.grad_accum_steps = 8  # micro-batches of one row

  c.lora.base_dtype = "int4"
  c.lora.rank = 8  # rank 16 plans 48.1 GiB, too close to 48
  c.lora.alpha = 16.0
  # quantize.QuantizeConfig fields besides dtype (taken from lora.base_dtype).
  c.quantize = ml_collections.ConfigDict(dict(group_size=128, scale_dtype="bfloat16"))

  c.eval.batch_size = 8
  return c
