"""SD·RL on Sudoku after SFT: the 2-core CPU default (docs/design.md, "SD·RL"; diffgemma/training/stages/sdrl.py).

python train.py --config=sdrl_sudoku --workdir=runs/sdrl --init_from=runs/sudoku

The model, objective pieces (loss.*: t_eps, noise schedule, self-conditioning share of the "rl"
mode and the "sft" anchor), data (the "sft" anchor's batches), sampler (evaluation) and eval
sections are sft_sudoku's; the architecture comes from --init_from.
"""

import ml_collections

from configs import sft_sudoku


def get_config():
  c = sft_sudoku.get_config()
  c.num_train_steps = 400  # optimizer updates; the time limit usually ends the run first
  c.max_train_minutes = 30.0
  c.log_every = 1
  c.checkpoint_every = 20
  # Small steps: in trials lr 1e-3 and 5e-4 cost most of the SFT accuracy within ~20 updates.
  c.optimizer.update({"lr": 2e-4, "schedule": "constant", "warmup_steps": 10})
  c.data.curriculum_steps = 0  # the "sft" anchor trains on the target givens mix directly
  c.eval.update({"every_steps": 100, "num_puzzles": 64})

  c.stage = "sdrl"
  c.sdrl = ml_collections.ConfigDict({
      # "both" | "distill" (all advantages 1) | "rl" (corruptions, not states). With the
      # verified target and certainty below, distillation won the 15-minute rounds against more
      # SFT (docs/sudoku.md, "SD·RL on Sudoku").
      "mode": "distill",
      "group_size": 4,  # G samples per prompt
      "prompts_per_rollout": 8,  # more prompts per update: it must generalise, not memorise
      "updates_per_rollout": 1,  # optimizer steps per rollout batch
      "states_per_trajectory": 4,
      "state_selection": "uniform",  # "uniform" | "first_k" | "last_k" | "all"
      "advantage_norm": "group_std",  # "group_std" | "group_mean" | "none"
      "advantage_eps": 1e-6,
      # Below 1, the group's weights sum to more than zero: cells every sample agrees on are
      # still distilled toward fewer steps.
      "negative_advantage_weight": 0.25,
      "advantage_clip": 0.0,  # 0 = off
      # State weight A + reward_weight * r: all-solved groups (A = 0) still distil toward fewer
      # steps; 0 = the advantage alone.
      "reward_weight": 1.0,
      # "consistent": distil only the final grid's cells that the verifier finds consistent.
      "cell_weighting": "none",
      # "final": each state toward its trajectory's final canvas; "verified": toward a right
      # canvas (its own when the verifier says correct, else the task's reference reply).
      "target": "verified",
      "certainty_weight": 1.0,  # entropy of right predictions on the states (dParallel)
      # "none" | "kl" (to the initial parameters, on the trained states) | "sft" (the SFT loss on
      # c.data's puzzles): the anchor keeps the few points of accuracy fine-tuning starts lose.
      "anchor": "sft",
      "anchor_weight": 1.0,
      "anchor_batch_size": 16,
      "shaping": {
          "step_penalty": 0.0,  # x steps per canvas / max denoising steps
          "length_penalty": 0.0,  # x generated tokens / max_new_tokens
      },
      # Sampler during rollouts (trajectories are always recorded); evaluation uses c.sampler.
      "rollout_sampler": c.sampler.to_dict(),
  })
  # The task's own section for an RL stage: what to roll out and how to score it.
  c.rl = ml_collections.ConfigDict({
      "reward": {
          "name": "sudoku",  # the task's verifier (Sudoku: valid, complete, keeps the givens)
          "partial_credit": "none",  # "none" | "cells" | "constraints"
          "partial_weight": 0.5,
      },
      # Rollout prompts: generated puzzles (seed differs from SFT data and held-out sets).
      "prompts": {"seed": 7, "min_givens": 28, "max_givens": 46},
  })
  # Rollouts stop at 16 steps with the evaluation sampler's temperatures on those steps
  # (t_n = t_min + (t_max - t_min) * n / N is linear in the step: t_min' = t_max - (t_max -
  # t_min) * 16 / 48). A rollout batch runs until its slowest row stops; rows past 16 steps
  # rarely solve their puzzle, and the cut bounds a rollout (and its replay) at 16 decoder
  # passes instead of 48. Change t_min with max_denoising_steps.
  rollout_steps = 16
  c.sdrl.rollout_sampler.max_denoising_steps = rollout_steps
  c.sdrl.rollout_sampler.t_min = c.sampler.t_max - (
      (c.sampler.t_max - c.sampler.t_min) * rollout_steps / c.sampler.max_denoising_steps)
  return c
