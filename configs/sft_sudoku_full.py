"""Full fine-tuning of DiffusionGemma 26B-A4B on Sudoku, on 8 x 80 GB GPUs.

  python train.py --config=sft_sudoku_full --workdir=runs/full26b --init_from=/ckpt/dg26b
  python train.py --config=sft_sudoku_full --dry_run --dry_run_devices=8   # the memory plan

Every weight is trained (no adapters). The recipe, and why (measurements in
benchmarks/RESULTS.md, "Full fine-tuning of the 26B-A4B on 8 devices"):

- Float32 weights, bfloat16 compute: the float32 parameters are the master copy the optimizer
  updates, and each layer casts them to bfloat16 where they are used. An AdamW step moves a
  weight by about lr = 1e-5, far below bfloat16's spacing near typical weights (2^-8 of their
  size), so bfloat16 weights would round most updates away.
- Expert parallelism (moe_impl="expert_parallel", experts split over the fsdp axis): each
  device owns 16 of the 128 experts of every layer, gathers the layer's tokens, computes its
  experts for all of them and sends the outputs back. Expert weights are never gathered, and
  each device computes the gradient of its own experts only. With FSDP-split experts
  ("tiled_scan") every device computed its tokens' gradient of all 128 experts in float32 and
  XLA summed them with a full-size all-reduce: 217 GiB per device planned, against 80.
- AdamW with float32 moments, the standard full fine-tuning optimizer with no precision
  compromise. Weights and state take 35.3 GiB per device of the 76.2 GiB plan. If a GPU needs
  more room, --config.optimizer.state_dtype=bfloat16 halves the moments (-11.8 GiB), and
  --config.optimizer.name=adafactor --config.optimizer.b1=0 factors them (-23.5 GiB). At 2
  layers neither choice changes anything but the optimizer state.
- Everything else is configs/sft_sudoku_lora.py's: bfloat16 compute, remat per layer, 64-row
  expert tiles, the 256-token canvas. The router is frozen (freeze_router, NeMo's SFT default):
  a short fine-tune then cannot shift the load balance the experts were pre-trained with.
- Batch 16 (2 rows per device): the self-conditioned half of a batch is then 8 rows, one per
  device; at batch 8 those 4 rows would be replicated on every device.
"""

from configs import sft_sudoku_lora


def get_config():
  c = sft_sudoku_lora.get_config()
  c.lora.enabled = False
  c.freeze_router = True
  c.batch_size = 16
  c.grad_accum_steps = 1
  c.model.param_dtype = "float32"
  c.model.moe_impl = "expert_parallel"
  c.sharding.fsdp = 8
  c.sharding.rules.experts = "fsdp"
  c.optimizer.update({"name": "adamw", "state_dtype": "float32", "lr": 1e-5,
                      "warmup_steps": 50, "weight_decay": 0.0})
  return c
