"""LoRA on the CPU: adapt a trained `sft_sudoku` model to harder puzzles (fewer givens).

The base was trained on 28-46 givens; this run trains rank-8 adapters on every linear for
24-30 givens and evaluates there. Same recipe as `sft_sudoku_lora`, at Sudoku-model size.

  python train.py --config=sft_sudoku_lora_tiny --workdir=runs/lora_tiny \
      --init_from=runs/sudoku_b16
"""

from configs import sft_sudoku


def get_config():
  c = sft_sudoku.get_config()
  c.num_train_steps = 600
  c.batch_size = 16
  c.max_train_minutes = 15.0
  c.checkpoint_every = 100
  c.eval.every_steps = 300

  c.lora.enabled = True
  c.lora.rank = 8
  c.lora.alpha = 16.0
  c.lora.dropout = 0.0
  c.lora.base_dtype = "float32"  # the CPU computes in float32 anyway

  # fsdp=-1 (inherited): all local devices; `--dry_run --dry_run_devices=2` plans it on two.

  c.optimizer.lr = 2e-3
  c.optimizer.warmup_steps = 20
  c.optimizer.weight_decay = 0.0

  # Harder than the base's training range (28-46): fewer givens.
  c.data.seed = 7
  c.data.start_min_givens = 24
  c.data.start_max_givens = 30
  c.data.min_givens = 24
  c.data.max_givens = 30
  c.data.curriculum_steps = 0
  c.eval.min_givens = 24
  c.eval.max_givens = 30
  return c
