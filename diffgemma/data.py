"""Sudoku as token sequences, and the grain pipeline that feeds training.

Token ids: PAD 0, EOS 1, BOS 2 (the reference's special-token ids), digit d -> 3 + d. A sequence
is the 81 puzzle cells (prompt) then the 81 solution digits (one canvas of 81 tokens); the loss
mask covers the canvas. Two prompt formats:
  "digits":     a prompt cell is BLANK (3) or its digit token; position only through RoPE.
  "cell_tokens": a prompt cell is one token per (cell, content) pair, 16 + 10 * cell + content
                 (content 0 = blank): the prompt states where each given sits, so peers (row,
                 column, box) can be found by content rather than decoded from 1-D positions.
"""

from __future__ import annotations

import dataclasses
import functools

import grain
import numpy as np

from diffgemma import sudoku

PAD, EOS, BOS, BLANK = 0, 1, 2, 3
DIGIT_OFFSET = 3  # token of digit d (1..9) is DIGIT_OFFSET + d
CELL_TOKEN_OFFSET = 16  # first (cell, content) token of the "cell_tokens" prompt format
CELL_CONTENTS = 10  # blank + 9 digits
PROMPT_FORMATS = ("digits", "cell_tokens")
PROMPT_LEN = sudoku.NUM_CELLS
CANVAS_LEN = sudoku.NUM_CELLS


def vocab_size(prompt_format: str) -> int:
  """Smallest vocabulary that holds every token of the format."""
  if prompt_format == "digits":
    return DIGIT_OFFSET + sudoku.SIZE + 1
  if prompt_format == "cell_tokens":
    return CELL_TOKEN_OFFSET + CELL_CONTENTS * sudoku.NUM_CELLS
  raise ValueError(f"unknown prompt_format {prompt_format!r}; choose one of {PROMPT_FORMATS}")


def puzzle_tokens(puzzles_Nx81, prompt_format: str) -> np.ndarray:
  """Prompt tokens of puzzles [..., 81] in the given format (see the module docstring)."""
  puzzles = np.asarray(puzzles_Nx81, np.int32)
  if prompt_format == "digits":
    return np.where(puzzles == sudoku.BLANK, BLANK, puzzles + DIGIT_OFFSET)
  vocab_size(prompt_format)  # validates the name
  cells = np.arange(sudoku.NUM_CELLS, dtype=np.int32)
  return CELL_TOKEN_OFFSET + CELL_CONTENTS * cells + puzzles


def solution_tokens(solutions_Nx81) -> np.ndarray:
  return np.asarray(solutions_Nx81, np.int32) + DIGIT_OFFSET


def tokens_to_digits(tokens_Nx81) -> np.ndarray:
  """Canvas tokens back to digits; anything that is not a digit token becomes 0 (blank)."""
  digits = np.asarray(tokens_Nx81, np.int32) - DIGIT_OFFSET
  return np.where((digits >= 1) & (digits <= sudoku.SIZE), digits, 0).astype(np.int8)


def response_len(canvas_len: int) -> int:
  """Length of the response part of a sequence for a model with this canvas length.

  A canvas that tiles the 81 solution digits exactly (81, 27, 9, ...) holds just the digits;
  any other canvas length gets the digits, EOS, then PAD up to a whole number of canvases (as
  the released 256-token-canvas model sees a short answer).
  """
  if canvas_len < 1:
    raise ValueError(f"canvas_length must be >= 1, got {canvas_len}")
  if CANVAS_LEN % canvas_len == 0:
    return CANVAS_LEN
  return -(-(CANVAS_LEN + 1) // canvas_len) * canvas_len


def sudoku_example(record: dict, prompt_format: str, canvas_len: int = CANVAS_LEN) -> dict:
  """One training sequence from {"puzzle", "solution"}: tokens, valid and loss mask
  [81 + response_len(canvas_len)]; the loss covers the whole response (digits, EOS, PAD)."""
  answer = solution_tokens(record["solution"])
  fill = response_len(canvas_len) - CANVAS_LEN
  if fill:
    answer = np.concatenate([answer, [EOS], np.full(fill - 1, PAD)])
  tokens = np.concatenate([puzzle_tokens(record["puzzle"], prompt_format), answer])
  loss_mask = np.arange(len(tokens)) >= PROMPT_LEN
  return {"tokens": tokens.astype(np.int32), "valid": np.ones_like(loss_mask),
          "loss_mask": loss_mask}


@dataclasses.dataclass(frozen=True)
class GivensCurriculum:
  """Givens range per training step: linear from the start range to the end range over
  `steps` steps (easy puzzles first), then the end range."""

  start_min: int
  start_max: int
  end_min: int
  end_max: int
  steps: int

  def at(self, step: int) -> tuple[int, int]:
    frac = 1.0 if self.steps <= 0 else min(step / self.steps, 1.0)
    lo = round(self.start_min + frac * (self.end_min - self.start_min))
    hi = round(self.start_max + frac * (self.end_max - self.start_max))
    return lo, max(lo, hi)


class CurriculumSudokuSource:
  """Random access to generated puzzles; record i belongs to step i // batch_size and takes its
  givens range from the curriculum. A pure function of the index, so resuming is exact."""

  def __init__(self, seed: int, batch_size: int, num_steps: int, curriculum: GivensCurriculum):
    self.seed, self.batch_size, self.num_steps = seed, batch_size, num_steps
    self.curriculum = curriculum

  def __len__(self) -> int:
    return self.batch_size * self.num_steps

  def __getitem__(self, index) -> dict:
    index = int(index)
    lo, hi = self.curriculum.at(index // self.batch_size)
    puzzle, solution = sudoku.generated_record(self.seed, index, lo, hi)
    return {"puzzle": puzzle, "solution": solution}

  def __repr__(self) -> str:
    return (f"CurriculumSudokuSource(seed={self.seed}, batch_size={self.batch_size}, "
            f"num_steps={self.num_steps}, curriculum={self.curriculum})")


def train_batches(data_cfg, batch_size: int, num_steps: int, start_step: int = 0,
                  canvas_len: int = CANVAS_LEN, process_index: int = 0, process_count: int = 1):
  """Iterator of training batches for steps start_step .. num_steps-1 (dicts of [B, L] arrays).

  The data position is the step: batch s is records [s*B, (s+1)*B) of a deterministic source,
  so a resumed run sees exactly the batches it would have seen. On several hosts, process i
  gets rows [i*B/n, (i+1)*B/n) of each global batch.
  """
  if batch_size % process_count:
    raise ValueError(f"batch_size={batch_size} is not divisible by {process_count} processes")
  local = batch_size // process_count
  curriculum = GivensCurriculum(
      data_cfg.start_min_givens, data_cfg.start_max_givens, data_cfg.min_givens,
      data_cfg.max_givens, data_cfg.curriculum_steps)
  source = CurriculumSudokuSource(data_cfg.seed, batch_size, num_steps, curriculum)
  rows = np.arange(start_step * batch_size, num_steps * batch_size).reshape(-1, batch_size)
  rows = rows[:, process_index * local:(process_index + 1) * local].reshape(-1)
  dataset = (grain.MapDataset.range(len(rows)).map(lambda i: source[int(rows[i])])
             .map(functools.partial(sudoku_example, prompt_format=data_cfg.prompt_format,
                                    canvas_len=canvas_len))
             .batch(local, drop_remainder=True))
  # Puzzle generation is Python; worker threads overlap it with the jitted step.
  read = grain.ReadOptions(num_threads=data_cfg.num_threads, prefetch_buffer_size=data_cfg.prefetch)
  return iter(dataset.to_iter_dataset(read))


def eval_arrays(puzzles_Nx81, prompt_format: str) -> dict:
  """Prompt tokens and valid mask for the sampler, [N, 81]."""
  tokens = puzzle_tokens(puzzles_Nx81, prompt_format)
  return {"prompt": tokens, "valid": np.ones_like(tokens, bool)}
