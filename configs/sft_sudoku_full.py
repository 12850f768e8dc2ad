"""Full fine-tuning of DiffusionGemma 26B-A4B on Sudoku, on 8 x 80 GB GPUs.

  python train.py --config=sft_sudoku_full --workdir=runs/full26b --init_from=/ckpt/dg26b
  python train.py --config=sft_sudoku_full --dry_run --dry_run_devices=8   # the memory plan

Every weight is trained (no adapters); the rest is configs/sft_sudoku_lora.py's. The
measurements behind each choice: benchmarks/RESULTS.md, "Recipe notes".
"""

from configs import sft_sudoku_lora


def get_config():
  c = sft_sudoku_lora.get_config()
  c.lora.enabled = False
  c.freeze_router = True  # NeMo's SFT default: keeps the pre-trained load balance
  c.batch_size = 16  # the self-conditioned half is then one row per device
  c.grad_accum_steps = 1
  c.model.param_dtype = "float32"  # bfloat16 weights would round lr=1e-5 updates away
  c.model.moe_impl = "expert_parallel"  # FSDP-split experts planned 217 GiB per device
  c.sharding.fsdp = 8
  c.sharding.rules.experts = "fsdp"
  c.optimizer.update({"name": "adamw", "state_dtype": "float32", "lr": 1e-5,
                      "warmup_steps": 50, "weight_decay": 0.0})
  return c
