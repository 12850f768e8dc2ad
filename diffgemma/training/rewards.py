"""Reward shaping for SD·RL: a task's verifier score turned into the scalar reward.

The score in [0, 1] and the `correct` flag of each rollout row come from the task
(`Task.reward`: Sudoku's verifier, a chat task's answer metric or a user function); shaping adds
what is generic: optional penalties on the denoising steps and on the reply length.

Everything here is numpy: rewards are computed on the host between the jitted rollout and update.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class ShapingConfig:
  """Config section `sdrl.shaping`. step_penalty: subtracted x (steps per canvas / max denoising steps): favours short
  trajectories. length_penalty: subtracted x (generated tokens / max_new_tokens): favours short
  answers."""

  step_penalty: float = 0.0
  length_penalty: float = 0.0

  def __post_init__(self):
    if self.step_penalty < 0 or self.length_penalty < 0:
      raise ValueError("sdrl.shaping.step_penalty and length_penalty must be >= 0, got "
                       f"{self.step_penalty} and {self.length_penalty}")


def shape(cfg: ShapingConfig, score_B, correct_B, steps_per_canvas_B, num_tokens_B,
          max_denoising_steps: int, max_new_tokens: int) -> dict:
  """{"reward", "score", "correct"} arrays [B]:
  reward = score - step_penalty * steps_per_canvas / max_denoising_steps
                 - length_penalty * num_tokens / max_new_tokens."""
  score = np.asarray(score_B, np.float64)
  reward = (score
            - cfg.step_penalty * np.asarray(steps_per_canvas_B) / max_denoising_steps
            - cfg.length_penalty * np.asarray(num_tokens_B) / max_new_tokens)
  return {"reward": reward.astype(np.float32), "score": score.astype(np.float32),
          "correct": np.asarray(correct_B, bool)}
