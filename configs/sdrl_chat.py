"""SD·RL on a chat task after SFT (docs/design.md, "SD·RL"; diffgemma/training/stages/sdrl.py).

  python train.py --config=sdrl_chat --workdir=runs/count_sdrl --init_from=runs/count \
      --config.data.train=/tmp/count.jsonl [--config.rl.reward_fn=my_module:my_reward]

Rollout prompts are the training file's conversations (each example's history), G replies
each; the reward is graded by default (`rl.reward="prefix"`: the share of the reference
the reply gets right from its start, charged for every character past the reference's end; see
diffgemma/tasks/text_metrics.py), so that a group whose replies are all wrong still ranks them.
It can be the task's answer metric against the data's reply ("exact", "choice", "gsm8k",
"regex": 1 or 0), or a function of yours named by `rl.reward_fn`
("package.module:function", called as function(prompt, reply, reference) -> float in [0, 1];
prompt: the last user turn's text, reply: the generated text up to its first stop token,
reference: the data's reply; importable from PYTHONPATH). The model, objective, data, sampler and
eval sections are sft_chat's (`--config=sdrl_chat:sort` for the sort layout); the architecture
comes from --init_from.
"""

import ml_collections

from configs import sft_chat


def get_config(variant: str = "count"):
  c = sft_chat.get_config(variant)
  # The SFT anchor's batches stay one example per row: anchor_batch_size examples an update.
  c.data.update(max_row_tokens=0, max_row_examples=0)
  c.batch_size = 16
  c.num_train_steps = 400  # optimizer updates; the time limit usually ends the run first
  c.max_train_minutes = 30.0
  c.log_every = 1
  c.checkpoint_every = 20
  c.optimizer.update({"lr": 2e-4, "schedule": "constant", "warmup_steps": 10})
  c.eval.update({"every_steps": 100, "num_examples": 64})

  c.stage = "sdrl"
  c.sdrl = ml_collections.ConfigDict({
      "mode": "both",  # "both" | "distill" (all advantages 1) | "rl" (corruptions, not states)
      "group_size": 4,  # G samples per prompt
      "prompts_per_rollout": 8,
      "updates_per_rollout": 1,
      "states_per_trajectory": 4,
      "state_selection": "uniform",  # "uniform" | "first_k" | "last_k" | "all"
      "advantage_norm": "group_std",  # "group_std" | "group_mean" | "none"
      "advantage_eps": 1e-6,
      "negative_advantage_weight": 0.25,  # < 1: agreed tokens still distil toward fewer steps
      "advantage_clip": 0.0,  # 0 = off
      "reward_weight": 1.0,  # state weight A + reward_weight * r
      "cell_weighting": "none",  # a chat task gives no token weights
      # "final": each state toward its trajectory's final canvas; "verified": toward a right
      # canvas (its own when the verifier says correct, else the task's reference reply).
      "target": "final",
      "certainty_weight": 0.0,  # entropy of right predictions on the states (dParallel)
      "anchor": "sft",  # "none" | "kl" | "sft" (the SFT loss on the training data)
      "anchor_weight": 1.0,
      "anchor_batch_size": 16,
      "shaping": {
          "step_penalty": 0.0,  # x steps per canvas / max denoising steps
          "length_penalty": 0.0,  # x generated tokens / max_new_tokens
      },
      # Sampler during rollouts (trajectories are always recorded); evaluation uses c.sampler.
      "rollout_sampler": c.sampler.to_dict(),
  })
  # The task's own section for an RL stage: rollouts are the training data's prompts.
  c.rl = ml_collections.ConfigDict({
      # "prefix" (graded) | a metric: "exact" | "choice" | "gsm8k" | "regex" (1 or 0)
      "reward": "prefix",
      "reward_fn": "",  # "package.module:function" replaces the metric
  })
  # Rollouts stop at 16 steps per canvas, with the evaluation sampler's temperatures on those
  # steps (the schedule is linear in the step; see configs/sdrl_sudoku.py).
  rollout_steps = 16
  c.sdrl.rollout_sampler.max_denoising_steps = rollout_steps
  c.sdrl.rollout_sampler.t_min = c.sampler.t_max - (
      (c.sampler.t_max - c.sampler.t_min) * rollout_steps / c.sampler.max_denoising_steps)
  return c
