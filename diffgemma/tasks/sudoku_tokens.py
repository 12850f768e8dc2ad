"""Sudoku as tokens: the ids of puzzle prompts and solution canvases, and back.

Token ids: PAD 0, EOS 1, BOS 2 (the reference's special-token ids), digit d -> 3 + d. Two prompt
formats:
  "digits":     a prompt cell is BLANK (3) or its digit token; position only through RoPE.
  "cell_tokens": a prompt cell is one token per (cell, content) pair, 16 + 10 * cell + content
                 (content 0 = blank): the prompt states where each given sits, so peers (row,
                 column, box) can be found by content rather than decoded from 1-D positions.
"""

from __future__ import annotations

import numpy as np

from diffgemma.tasks import sudoku_puzzles

PAD, EOS, BOS, BLANK = 0, 1, 2, 3
DIGIT_OFFSET = 3  # token of digit d (1..9) is DIGIT_OFFSET + d
CELL_TOKEN_OFFSET = 16  # first (cell, content) token of the "cell_tokens" prompt format
CELL_CONTENTS = 10  # blank + 9 digits
PROMPT_FORMATS = ("digits", "cell_tokens")
PROMPT_LEN = sudoku_puzzles.NUM_CELLS
CANVAS_LEN = sudoku_puzzles.NUM_CELLS


def vocab_size(prompt_format: str) -> int:
  """Smallest vocabulary that holds every token of the format."""
  if prompt_format == "digits":
    return DIGIT_OFFSET + sudoku_puzzles.SIZE + 1
  if prompt_format == "cell_tokens":
    return CELL_TOKEN_OFFSET + CELL_CONTENTS * sudoku_puzzles.NUM_CELLS
  raise ValueError(f"unknown data.prompt_format {prompt_format!r}; choose one of "
                   f"{PROMPT_FORMATS}")


def puzzle_tokens(puzzles_Nx81, prompt_format: str) -> np.ndarray:
  """Prompt tokens of puzzles [..., 81] in the given format (see the module docstring)."""
  puzzles = np.asarray(puzzles_Nx81, np.int32)
  if prompt_format == "digits":
    return np.where(puzzles == sudoku_puzzles.BLANK, BLANK, puzzles + DIGIT_OFFSET)
  vocab_size(prompt_format)  # validates the name
  cells = np.arange(sudoku_puzzles.NUM_CELLS, dtype=np.int32)
  return CELL_TOKEN_OFFSET + CELL_CONTENTS * cells + puzzles


def solution_tokens(solutions_Nx81) -> np.ndarray:
  return np.asarray(solutions_Nx81, np.int32) + DIGIT_OFFSET


def tokens_to_digits(tokens_Nx81) -> np.ndarray:
  """Canvas tokens back to digits; anything that is not a digit token becomes 0 (blank)."""
  digits = np.asarray(tokens_Nx81, np.int32) - DIGIT_OFFSET
  return np.where((digits >= 1) & (digits <= sudoku_puzzles.SIZE), digits, 0).astype(np.int8)
