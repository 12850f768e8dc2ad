"""SD·RL of DiffusionGemma 26B-A4B with LoRA on Sudoku, on 2 x 80 GB GPUs.

  python train.py --config=sdrl_sudoku_lora --workdir=runs/sdrl26b --init_from=/ckpt/dg26b
  python train.py --config=sdrl_sudoku_lora --dry_run   # both programs on 2 simulated devices

Model, numerics, LoRA and sharding are configs/sft_sudoku_lora.py's (rank-16 adapters on every
linear over a frozen bfloat16 base split over both devices); the SD·RL section is
configs/sdrl_sudoku.py's with advantage-weighted final targets (the objective its 30-layer
plan was compiled for) and an SFT anchor, its sizes chosen so that both programs fit in 80 GB
(the plans: benchmarks/RESULTS.md, "Recipe notes"). Rollouts stop at 16 denoising steps (as
sdrl_sudoku), bounding a rollout at 16 decoder passes.
"""

from configs import sdrl_sudoku, sft_sudoku_lora


def get_config():
  c = sft_sudoku_lora.get_config()
  rl = sdrl_sudoku.get_config()
  c.num_train_steps = 400
  c.log_every = 1
  c.checkpoint_every = 20  # a multiple of sdrl.updates_per_rollout
  c.optimizer.update({k: rl.optimizer[k] for k in ("lr", "schedule", "warmup_steps")})
  c.data.curriculum_steps = 0  # the "sft" anchor trains on the target givens mix directly
  c.eval.update({"every_steps": 100, "num_puzzles": 64})

  c.stage = "sdrl"
  c.sdrl = rl.sdrl
  c.rl = rl.rl  # the task's rollout prompts and reward
  # The objective the 30-layer plan was compiled for. sdrl_sudoku's (--config.sdrl.mode=distill
  # --config.sdrl.target=verified --config.sdrl.certainty_weight=1) plans 1.4 GiB more per device
  # at 2 layers (benchmarks/RESULTS.md, "SD·RL on Sudoku: three seeds").
  c.sdrl.update({"mode": "both", "target": "final", "certainty_weight": 0.0})
  # 8 rollout rows: the [C, V] float32 logits of each row (256 MiB), not the weights, grow.
  c.sdrl.update({"group_size": 4, "prompts_per_rollout": 2, "states_per_trajectory": 4,
                 "anchor_batch_size": 8})
  c.grad_accum_steps = 8  # divides the 8 rollout and anchor rows; 4 planned 93.4 GiB, over 80
  # The rollout sampler: this model's evaluation sampler (256-token canvas), cut at 16 steps
  # with the temperatures those steps have in the 48-step schedule (as sdrl_sudoku).
  cut = {k: rl.sdrl.rollout_sampler[k] for k in ("max_denoising_steps", "t_min")}
  c.sdrl.rollout_sampler = dict(c.sampler.to_dict(), **cut)
  return c
