"""Task verifiers for SD·RL (DESIGN.md §5): pluggable reward functions and reward shaping.

A reward function maps a rollout batch to a score in [0, 1] per row and a `correct` flag (the
task's accuracy): `fn(tokens_BxL, task, cfg, stop_token_ids, pad) -> (score_B, correct_B)`, where
`task` holds the rows' references (Sudoku: "puzzle" and "solution" [B, 81] digits; text: "target"
[B, T] token ids, pad after the answer). `compute` adds the optional step and length penalties.

Everything here is numpy: rewards are computed on the host between the jitted rollout and update.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from diffgemma import data, sudoku

PARTIAL_CREDITS = ("none", "cells", "constraints")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """Which verifier, and how its verdict becomes a scalar reward.

  name: a key of REWARDS.
  partial_credit: Sudoku only. "none": 1 if solved else 0; "cells": an unsolved grid earns
    partial_weight x the fraction of blank cells equal to the solution; "constraints": an
    unsolved grid earns partial_weight x the fraction of the 27 units (rows, columns, boxes)
    that hold 1..9 once each and agree with the givens in them (no solution needed).
  partial_weight: < 1 keeps every solved grid above every unsolved one.
  step_penalty: subtracted x (steps per canvas / max denoising steps): favours short trajectories.
  length_penalty: subtracted x (generated tokens / max_new_tokens): favours short answers.
  """

  name: str = "sudoku"
  partial_credit: str = "none"
  partial_weight: float = 0.5
  step_penalty: float = 0.0
  length_penalty: float = 0.0

  def __post_init__(self):
    if self.name not in REWARDS:
      raise ValueError(f"unknown reward name {self.name!r}; choose one of {tuple(REWARDS)}")
    if self.partial_credit not in PARTIAL_CREDITS:
      raise ValueError(f"unknown reward partial_credit {self.partial_credit!r}; choose one of "
                       f"{PARTIAL_CREDITS}")
    if self.partial_credit != "none" and self.name != "sudoku":
      raise ValueError(f"reward partial_credit={self.partial_credit!r} needs name='sudoku'")
    if not 0.0 <= self.partial_weight <= 1.0:
      raise ValueError(f"reward partial_weight must be in [0, 1], got {self.partial_weight}")
    if self.step_penalty < 0 or self.length_penalty < 0:
      raise ValueError("reward step_penalty and length_penalty must be >= 0")


# ----------------------------------------------------------------------------- Sudoku


def _units_Nx27x9(grids_Nx81):
  """The 27 units of each grid as rows of 9 cells: 9 rows, 9 columns, 9 boxes."""
  g_Nx9x9 = np.asarray(grids_Nx81).reshape(-1, sudoku.SIZE, sudoku.SIZE)
  b = sudoku.BOX
  boxes = g_Nx9x9.reshape(-1, b, b, b, b).transpose(0, 1, 3, 2, 4).reshape(-1, 9, 9)
  return np.concatenate([g_Nx9x9, g_Nx9x9.transpose(0, 2, 1), boxes], axis=1)


def unit_satisfaction(puzzles_Nx81, grids_Nx81):
  """float[N]: fraction of the 27 units that hold 1..9 once each and keep their givens."""
  grid_units = _units_Nx27x9(grids_Nx81)
  given_units = _units_Nx27x9(puzzles_Nx81)
  digits = np.arange(1, sudoku.SIZE + 1)
  permutation = (np.sort(grid_units, axis=-1) == digits).all(-1)
  keeps_givens = ((given_units == sudoku.BLANK) | (given_units == grid_units)).all(-1)
  return (permutation & keeps_givens).mean(-1)


def consistent_cells(puzzles_Nx81, grids_Nx81):
  """bool[N, 81]: cells holding a digit that keeps the cell's given (if any) and occurs once in
  its row, its column and its box. A solved grid is consistent everywhere; needs no solution."""
  g_Nx9x9 = np.asarray(grids_Nx81).reshape(-1, sudoku.SIZE, sudoku.SIZE)
  n, b = len(g_Nx9x9), sudoku.BOX
  onehot_Nx9x9xD = g_Nx9x9[..., None] == np.arange(1, sudoku.SIZE + 1)
  in_row = onehot_Nx9x9xD.sum(2, keepdims=True)
  in_col = onehot_Nx9x9xD.sum(1, keepdims=True)
  box_NxbxbxbxbxD = onehot_Nx9x9xD.reshape(n, b, b, b, b, -1)
  in_box = box_NxbxbxbxbxD.sum((2, 4), keepdims=True)
  in_box = np.broadcast_to(in_box, box_NxbxbxbxbxD.shape).reshape(onehot_Nx9x9xD.shape)
  once = ((in_row == 1) & (in_col == 1) & (in_box == 1) & onehot_Nx9x9xD).any(-1)
  puzzles = np.asarray(puzzles_Nx81)
  keeps_given = (puzzles == sudoku.BLANK) | (puzzles == np.asarray(grids_Nx81))
  return once.reshape(n, -1) & keeps_given


def consistent_token_mask(tokens_BxL, task: dict):
  """float-able bool[B, L]: `consistent_cells` on the grid of each row's first 81 tokens; the
  tokens after the grid (none in the Sudoku task's single canvas) count as consistent."""
  tokens_BxL = np.asarray(tokens_BxL)
  grids = data.tokens_to_digits(tokens_BxL[:, :sudoku.NUM_CELLS])
  mask = np.ones(tokens_BxL.shape, bool)
  mask[:, :sudoku.NUM_CELLS] = consistent_cells(task["puzzle"], grids)
  return mask


def blank_cell_accuracy(puzzles_Nx81, grids_Nx81, solutions_Nx81):
  """float[N]: per puzzle, the fraction of its blank cells where the grid equals the solution."""
  blank = np.asarray(puzzles_Nx81) == sudoku.BLANK
  correct = np.asarray(grids_Nx81) == np.asarray(solutions_Nx81)
  return (correct & blank).sum(-1) / np.maximum(blank.sum(-1), 1)


def sudoku_reward(tokens_BxL, task: dict, cfg: RewardConfig, stop_token_ids, pad: int):
  """Solved (complete, valid, consistent with the givens) = 1; else the partial credit."""
  del stop_token_ids, pad  # the canvas is the grid; a stray EOS or pad is a blank cell
  grids = data.tokens_to_digits(np.asarray(tokens_BxL)[:, :sudoku.NUM_CELLS])
  solved = sudoku.batch_solved(task["puzzle"], grids)
  if cfg.partial_credit == "cells":
    partial = blank_cell_accuracy(task["puzzle"], grids, task["solution"])
  elif cfg.partial_credit == "constraints":
    partial = unit_satisfaction(task["puzzle"], grids)
  else:
    partial = np.zeros(len(grids))
  return np.where(solved, 1.0, cfg.partial_weight * partial), solved


# ----------------------------------------------------------------------------- text


def answer_tokens(tokens_L, stop_token_ids, pad: int):
  """The answer of one row: its tokens before the first stop id, pads dropped."""
  tokens_L = np.asarray(tokens_L)
  stops = np.flatnonzero(np.isin(tokens_L, stop_token_ids))
  if stops.size:
    tokens_L = tokens_L[:stops[0]]
  return tokens_L[tokens_L != pad]


def exact_match_reward(tokens_BxL, task: dict, cfg: RewardConfig, stop_token_ids, pad: int):
  """1 where the generated answer (up to the first stop id) equals the target's, token for
  token."""
  del cfg
  match = np.array([
      np.array_equal(answer_tokens(row, stop_token_ids, pad),
                     answer_tokens(target, stop_token_ids, pad))
      for row, target in zip(np.asarray(tokens_BxL), np.asarray(task["target"]))])
  return match.astype(np.float64), match


REWARDS = {"sudoku": sudoku_reward, "exact_match": exact_match_reward}


def compute(cfg: RewardConfig, tokens_BxL, task: dict, steps_per_canvas_B, num_tokens_B,
            max_denoising_steps: int, max_new_tokens: int, stop_token_ids, pad: int):
  """Rewards of a rollout batch: {"reward", "score", "correct"}, float/bool arrays [B].

  reward = score - step_penalty * steps_per_canvas / max_denoising_steps
                 - length_penalty * num_tokens / max_new_tokens.
  """
  score, correct = REWARDS[cfg.name](tokens_BxL, task, cfg, stop_token_ids, pad)
  reward = (score
            - cfg.step_penalty * np.asarray(steps_per_canvas_B) / max_denoising_steps
            - cfg.length_penalty * np.asarray(num_tokens_B) / max_new_tokens)
  return {"reward": reward.astype(np.float32), "score": score.astype(np.float32),
          "correct": np.asarray(correct, bool)}
