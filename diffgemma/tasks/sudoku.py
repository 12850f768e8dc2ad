"""The Sudoku task: puzzles as token sequences, the grain training pipeline, held-out puzzle
sets, puzzle metrics, the verifier reward, and the per-step profile of the sampler.

Token ids: PAD 0, EOS 1, BOS 2 (the reference's special-token ids), digit d -> 3 + d. A sequence
is the 81 puzzle cells (prompt) then the 81 solution digits (canvases of the model's length);
the loss mask covers the response. Two prompt formats:
  "digits":     a prompt cell is BLANK (3) or its digit token; position only through RoPE.
  "cell_tokens": a prompt cell is one token per (cell, content) pair, 16 + 10 * cell + content
                 (content 0 = blank): the prompt states where each given sits, so peers (row,
                 column, box) can be found by content rather than decoded from 1-D positions.

Config sections read here: `data` (seed, curriculum, prompt format, loader threads), `eval`
(periodic held-out puzzles), and for an RL stage its own section `rl`: `rl.prompts` (rollout
puzzles) and `rl.reward` (the verifier, partial credit).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import grain
import ml_collections
import numpy as np

from diffgemma.tasks import sudoku_puzzles
from diffgemma.tasks import sudoku_traces
from diffgemma.tasks.base import Layout, Prompts, RlTask
from diffgemma.tasks.sudoku_tokens import (  # noqa: F401 (the task's token helpers)
  PAD,
  EOS,
  BOS,
  BLANK,
  DIGIT_OFFSET,
  CELL_TOKEN_OFFSET,
  CELL_CONTENTS,
  PROMPT_FORMATS,
  PROMPT_LEN,
  CANVAS_LEN,
  vocab_size,
  puzzle_tokens,
  solution_tokens,
  tokens_to_digits,
)

PARTIAL_CREDITS = ("none", "cells", "constraints")


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


def response_tokens(solutions_Nx81, canvas_len: int = CANVAS_LEN) -> np.ndarray:
  """The response slots [N, response_len(canvas_len)] of solutions: digits, then EOS and PAD
  up to a whole number of canvases where the canvas does not tile the 81 cells."""
  answer = solution_tokens(np.asarray(solutions_Nx81).reshape(-1, sudoku_puzzles.NUM_CELLS))
  fill = response_len(canvas_len) - CANVAS_LEN
  if fill:
    end = np.full((len(answer), fill), PAD, answer.dtype)
    end[:, 0] = EOS
    answer = np.concatenate([answer, end], axis=1)
  return answer


def sudoku_example(record: dict, prompt_format: str, canvas_len: int = CANVAS_LEN) -> dict:
  """One training sequence from {"puzzle", "solution"}: tokens, valid and loss mask
  [81 + response_len(canvas_len)]; the loss covers the whole response (digits, EOS, PAD)."""
  answer = response_tokens(record["solution"], canvas_len)[0]
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
    puzzle, solution = sudoku_puzzles.generated_record(self.seed, index, lo, hi)
    return {"puzzle": puzzle, "solution": solution}

  def __repr__(self) -> str:
    return (f"CurriculumSudokuSource(seed={self.seed}, batch_size={self.batch_size}, "
            f"num_steps={self.num_steps}, curriculum={self.curriculum})")


def curriculum(data_cfg) -> GivensCurriculum:
  return GivensCurriculum(data_cfg.start_min_givens, data_cfg.start_max_givens,
                          data_cfg.min_givens, data_cfg.max_givens, data_cfg.curriculum_steps)


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
  source = CurriculumSudokuSource(data_cfg.seed, batch_size, num_steps, curriculum(data_cfg))
  rows = np.arange(start_step * batch_size, num_steps * batch_size).reshape(-1, batch_size)
  rows = rows[:, process_index * local:(process_index + 1) * local].reshape(-1)
  dataset = (grain.MapDataset.range(len(rows)).map(lambda i: source[int(rows[i])])
             .map(functools.partial(sudoku_example, prompt_format=data_cfg.prompt_format,
                                    canvas_len=canvas_len))
             .batch(local, drop_remainder=True))
  # Puzzle generation is Python; worker threads overlap it with the jitted step.
  read = grain.ReadOptions(num_threads=data_cfg.num_threads, prefetch_buffer_size=data_cfg.prefetch)
  return iter(dataset.to_iter_dataset(read))


def puzzle_prompts(puzzles_Nx81, solutions_Nx81, prompt_format: str) -> Prompts:
  """Sampler prompts of puzzles; references [N, 2, 81] int8 (puzzle, solution) per row."""
  tokens = puzzle_tokens(puzzles_Nx81, prompt_format)
  references = np.stack([np.asarray(puzzles_Nx81, np.int8),
                         np.asarray(solutions_Nx81, np.int8)], axis=1)
  return Prompts(tokens, np.ones_like(tokens, bool), references)


def _puzzles_and_solutions(prompts: Prompts) -> tuple[np.ndarray, np.ndarray]:
  references = np.asarray(prompts.references)
  return references[:, 0], references[:, 1]


def _grid_string(grid_81) -> str:
  return "".join(str(int(d)) if d else "." for d in np.asarray(grid_81))


# ----------------------------------------------------------------------------- step profile

STEP_PROFILE_KEYS = ("rows", "blank_accepted", "blank_correct", "blank_accepted_correct",
                     "blank_entropy", "given_entropy")


def step_profile(trajectory, puzzles_Nx81, solutions_Nx81) -> dict:
  """Per denoising step of the first canvas (the Sudoku grid), sums over the rows that ran it:
  rows; blank cells whose draw was accepted, whose argmax is the solution digit, and both; the
  tempered entropy summed over blank cells and over givens (the acceptance spends one entropy
  budget on both). Each value is [N] float64; divide by `rows` for per-puzzle means. Sums, so
  that batches add up. `trajectory`: a recorded one (arrays [K, N, B, C]; entropy included)."""
  valid_NxB = np.asarray(trajectory["valid"][0], bool)
  cells = slice(0, CANVAS_LEN)
  argmax_NxBx81 = tokens_to_digits(np.asarray(trajectory["argmax"][0, :, :, cells]))
  accepted_NxBx81 = np.asarray(trajectory["accepted"][0, :, :, cells], bool)
  entropy_NxBx81 = np.asarray(trajectory["entropy"][0, :, :, cells], np.float64)
  blank_1xBx81 = (np.asarray(puzzles_Nx81) == 0)[None]
  correct_NxBx81 = argmax_NxBx81 == np.asarray(solutions_Nx81)[None]
  ran_NxBx1 = valid_NxB[:, :, None]

  def total(x_NxBx81):
    return np.sum(np.where(ran_NxBx1, x_NxBx81, 0), axis=(1, 2), dtype=np.float64)

  return {"rows": valid_NxB.sum(1).astype(np.float64),
          "blank_accepted": total(accepted_NxBx81 & blank_1xBx81),
          "blank_correct": total(correct_NxBx81 & blank_1xBx81),
          "blank_accepted_correct": total(accepted_NxBx81 & correct_NxBx81 & blank_1xBx81),
          "blank_entropy": total(np.where(blank_1xBx81, entropy_NxBx81, 0)),
          "given_entropy": total(np.where(blank_1xBx81, 0, entropy_NxBx81))}


def format_step_profile(profile: dict) -> str:
  """A step profile (per-puzzle means) as a table: one line per denoising step."""
  lines = ["step  puzzles | blank cells: accepted  correct  both  entropy | givens: entropy"]
  for n, (rows, accepted, correct, both, blank_h, given_h) in enumerate(
      zip(*(profile[key] for key in STEP_PROFILE_KEYS)), start=1):
    lines.append(f"{n:4d}  {int(rows):7d} | {accepted:21.1f}  {correct:7.1f}  {both:4.1f}  "
                 f"{blank_h:7.3f} | {given_h:15.4f}")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- the task


@dataclasses.dataclass(frozen=True)
class PromptConfig:
  """SD·RL rollout prompts: generated puzzles, givens uniform in [min_givens, max_givens]."""

  seed: int = 7
  min_givens: int = 28
  max_givens: int = 46


@dataclasses.dataclass(frozen=True)
class RewardConfig:
  """The verifier's verdict as a score (config section `rl.reward`).

  partial_credit: "none": 1 if solved else 0; "cells": an unsolved grid earns partial_weight x
    the fraction of blank cells equal to the solution; "constraints": partial_weight x the
    fraction of the 27 units (rows, columns, boxes) that hold 1..9 once each and agree with the
    givens in them (no solution needed).
  partial_weight: < 1 keeps every solved grid above every unsolved one.
  """

  partial_credit: str = "none"
  partial_weight: float = 0.5

  def __post_init__(self):
    if self.partial_credit not in PARTIAL_CREDITS:
      raise ValueError(f"unknown rl.reward.partial_credit {self.partial_credit!r}; choose one "
                       f"of {PARTIAL_CREDITS}")
    if not 0.0 <= self.partial_weight <= 1.0:
      raise ValueError(f"rl.reward.partial_weight must be in [0, 1], got "
                       f"{self.partial_weight}")


# A run started from a Sudoku run keeps its prompt format (tasks.tokenization_keys).
TOKENIZATION_KEYS = ("data.prompt_format",)


class SudokuTask(RlTask):
  """Sudoku solving: one prompt of 81 cells, the 81 digits of the solution as canvases."""

  name = "sudoku"
  headline_metric = "puzzle_accuracy"

  def __init__(self, config: ml_collections.ConfigDict):
    data = config.data
    self.data_cfg = data
    self.eval_cfg = config.eval
    self.canvas_length = int(config.model.canvas_length)
    self.prompt_format = data.prompt_format
    self._vocab = vocab_size(self.prompt_format)
    for lo, hi in ((data.start_min_givens, data.start_max_givens),
                   (data.min_givens, data.max_givens),
                   (config.eval.min_givens, config.eval.max_givens)):
      sudoku_puzzles.check_givens_range(lo, hi)
    for key, low in (("data.seed", 0), ("data.curriculum_steps", 0), ("data.num_threads", 0),
                     ("data.prefetch", 0), ("eval.num_puzzles", 0), ("eval.seed", 0)):
      section, name = key.split(".")
      value = config[section][name]
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key} must be an integer, got {value!r}")
      if value < low:
        raise ValueError(f"{key} must be >= {low}, got {value}")
    new_tokens = config.sampler.max_new_tokens
    if new_tokens < CANVAS_LEN:
      raise ValueError(f"sampler.max_new_tokens={new_tokens} cannot hold a Sudoku answer "
                       f"({CANVAS_LEN} digits)")
    if config.model.vocab_size < self._vocab:
      raise ValueError(f"model.vocab_size={config.model.vocab_size} is too small for "
                       f"data.prompt_format={self.prompt_format!r} (needs {self._vocab})")
    self._layout = Layout(PROMPT_LEN, response_len(self.canvas_length) // self.canvas_length,
                          self.canvas_length)
    rl = config.get("rl") or ml_collections.ConfigDict()
    self.prompt_cfg = PromptConfig(**rl.prompts.to_dict()) if "prompts" in rl else PromptConfig()
    sudoku_puzzles.check_givens_range(self.prompt_cfg.min_givens, self.prompt_cfg.max_givens)
    reward = rl.get("reward", "sudoku")
    reward = {"name": reward} if isinstance(reward, str) else reward.to_dict()
    if reward.get("name", "sudoku") != "sudoku":
      raise ValueError(f"unknown rl.reward.name {reward['name']!r} for the Sudoku task; "
                       "choose 'sudoku' (the verifier)")
    unknown = sorted(set(reward) - {"name", "partial_credit", "partial_weight"})
    if unknown:
      raise ValueError(f"unknown key rl.reward.{unknown[0]} for the Sudoku task (reward shaping "
                       "is the stage's: sdrl.shaping)")
    self.reward_cfg = RewardConfig(**{k: reward[k] for k in ("partial_credit", "partial_weight")
                                      if k in reward})

  @property
  def layout(self) -> Layout:
    return self._layout

  @property
  def min_vocab_size(self) -> int:
    return self._vocab

  def train_batches(self, batch_size, num_steps, start_step=0, process_index=0,
                    process_count=1):
    return train_batches(self.data_cfg, batch_size, num_steps, start_step, self.canvas_length,
                         process_index, process_count)

  # ---------------------------------------------------------------- evaluation

  def eval_prompts(self) -> Prompts | None:
    e = self.eval_cfg
    if e.num_puzzles <= 0:
      return None
    puzzles, solutions = sudoku_puzzles.generate_puzzles(e.seed, e.num_puzzles, e.min_givens,
                                                         e.max_givens)
    return puzzle_prompts(puzzles, solutions, self.prompt_format)

  def load_eval_file(self, path: str, limit: int | None = None) -> Prompts:
    puzzles, solutions = sudoku_puzzles.load_csv(path, limit)
    return puzzle_prompts(puzzles, solutions, self.prompt_format)

  def score(self, prompts, tokens_NxL, stats):
    puzzles, solutions = _puzzles_and_solutions(prompts)
    grids = tokens_to_digits(np.asarray(tokens_NxL)[:, :CANVAS_LEN])
    solved = sudoku_puzzles.batch_solved(puzzles, grids)
    metrics = {
        "puzzle_accuracy": float(np.mean(solved)),
        "cell_accuracy": sudoku_puzzles.cell_accuracy(puzzles, grids, solutions, "all"),
        # The early-warning pair: a run on the copy-the-givens plateau gets the givens right
        # and the blanks barely better than chance.
        "given_cell_accuracy": sudoku_puzzles.cell_accuracy(puzzles, grids, solutions, "given"),
        "blank_cell_accuracy": sudoku_puzzles.cell_accuracy(puzzles, grids, solutions, "blank"),
        "num_puzzles": int(len(grids)),
    }
    predictions = [{"puzzle": _grid_string(p), "grid": _grid_string(g), "solved": bool(s)}
                   for p, g, s in zip(puzzles, grids, solved)]
    return metrics, predictions

  def plateau_warning(self, step, metrics):
    e = self.eval_cfg
    check_step = e.get("plateau_check_step", 0)
    if not check_step or step < check_step or "blank_cell_accuracy" not in metrics:
      return None
    blank = metrics["blank_cell_accuracy"]
    if blank >= e.get("plateau_blank_accuracy", 0.0):
      return None
    return (f"warning: at step {step} blank-cell accuracy is {blank:.1%} (a healthy run is "
            f"above {e.plateau_blank_accuracy:.0%} by step {check_step}): the run is still on the "
            "copy plateau (givens copied, blanks guessed); data.prompt_format=digits leaves it "
            "within ~100 steps, else try another --config.seed; "
            "scripts/sudoku_diagnostics.py shows where it stands")

  def profile_trajectory(self, prompts: Prompts, trajectory) -> dict:
    puzzles, solutions = _puzzles_and_solutions(prompts)
    return step_profile(trajectory, puzzles, solutions)

  format_profile = staticmethod(format_step_profile)

  # ---------------------------------------------------------------- text

  def prompt_from_text(self, text: str) -> Prompts:
    puzzle = sudoku_puzzles.parse_puzzle_string(text)  # conflicting givens are an error here
    if sudoku_puzzles.solve(puzzle) is None:  # givens that conflict only through the other cells
      raise sudoku_puzzles.SudokuDataError("puzzle has no solution: no grid completes its "
                                           "givens; check the --puzzle string")
    return puzzle_prompts(puzzle[None], np.zeros_like(puzzle)[None], self.prompt_format)

  def prompt_text(self, prompts, row=0):
    puzzle = _puzzles_and_solutions(prompts)[0][row]
    return f"{int(np.sum(puzzle > 0))} givens\n" + sudoku_puzzles.format_grid(puzzle, puzzle)

  def reply_text(self, tokens, prompts=None, row=0, first_slot=0):
    if first_slot >= CANVAS_LEN:  # canvases after the grid hold its EOS and padding
      return "(after the grid: EOS and padding)"
    tokens = np.asarray(tokens)
    slots = np.full(max(CANVAS_LEN, first_slot + len(tokens)), PAD)
    slots[first_slot:first_slot + len(tokens)] = tokens  # a canvas shown inside the grid
    grid = tokens_to_digits(slots[:CANVAS_LEN])
    puzzle = None if prompts is None else _puzzles_and_solutions(prompts)[0][row]
    text = sudoku_puzzles.format_grid(grid, puzzle)
    if puzzle is not None:
      wrong = int(np.sum((puzzle > 0) & (grid != puzzle)))
      text += f"\n{wrong} givens contradicted" if wrong else ""
    return text

  def verdict(self, prompts, tokens, row=0):
    puzzle = _puzzles_and_solutions(prompts)[0][row]
    grid = tokens_to_digits(np.asarray(tokens)[:CANVAS_LEN])
    if sudoku_puzzles.puzzle_solved(puzzle, grid):
      return "valid solution"
    if sudoku_puzzles.is_valid_solution(grid):
      return "complete and valid but contradicts the givens"
    return "not a valid solution"

  def token_strings(self, tokens: Sequence[int]) -> list[str]:
    digits = tokens_to_digits(np.asarray(tokens, np.int32))
    return [str(int(d)) if d else "." for d in digits]

  # ---------------------------------------------------------------- denoising traces

  trace_suffixes = sudoku_traces.TRACE_SUFFIXES

  def write_trace(self, path, prompts, trajectory, row=0):
    """The grid at every step: an animated GIF, or HTML of its digits."""
    puzzles, solutions = _puzzles_and_solutions(prompts)
    solution = solutions[row] if solutions[row].any() else None  # a typed puzzle has none
    return sudoku_traces.write_sudoku_trace(path, trajectory, puzzles[row], row, solution)

  def log_traces(self, writer, step, prompts, trajectory, rows=(0,)):
    puzzles, solutions = _puzzles_and_solutions(prompts)
    sudoku_traces.log_sudoku_traces(writer, step, trajectory, puzzles, solutions, rows)

  # ---------------------------------------------------------------- SD·RL

  def rollout_prompts(self, iteration: int, num_prompts: int) -> Prompts:
    """Puzzle i of the stream is a pure function of (seed, i): a resumed run sees the same."""
    p = self.prompt_cfg
    first = iteration * num_prompts
    records = [sudoku_puzzles.generated_record(p.seed, i, p.min_givens, p.max_givens)
               for i in range(first, first + num_prompts)]
    puzzles, solutions = (np.stack(x) for x in zip(*records))
    return puzzle_prompts(puzzles, solutions, self.prompt_format)

  def reward(self, prompts, tokens_BxL):
    """Solved (complete, valid, consistent with the givens) = 1; else the partial credit. The
    canvas is the grid: a stray EOS or pad is a blank cell."""
    puzzles, solutions = _puzzles_and_solutions(prompts)
    grids = tokens_to_digits(np.asarray(tokens_BxL)[:, :sudoku_puzzles.NUM_CELLS])
    solved = sudoku_puzzles.batch_solved(puzzles, grids)
    if self.reward_cfg.partial_credit == "cells":
      partial = sudoku_puzzles.blank_cell_accuracy(puzzles, grids, solutions)
    elif self.reward_cfg.partial_credit == "constraints":
      partial = sudoku_puzzles.unit_satisfaction(puzzles, grids)
    else:
      partial = np.zeros(len(grids))
    return np.where(solved, 1.0, self.reward_cfg.partial_weight * partial), solved

  def reference_reply(self, prompts):
    """The solutions laid out as training lays out a response."""
    return response_tokens(_puzzles_and_solutions(prompts)[1],
                           self._layout.canvas_length).astype(np.int32)

  def token_weights(self, prompts, tokens_BxL):
    """The cells of the final grid the verifier finds consistent (an unsolved grid's
    conflicting cells are not distilled toward); tokens after the grid count."""
    puzzles, _ = _puzzles_and_solutions(prompts)
    tokens_BxL = np.asarray(tokens_BxL)
    grids = tokens_to_digits(tokens_BxL[:, :sudoku_puzzles.NUM_CELLS])
    weights = np.ones(tokens_BxL.shape, np.float32)
    weights[:, :sudoku_puzzles.NUM_CELLS] = sudoku_puzzles.consistent_cells(puzzles, grids)
    return weights


def from_config(config: ml_collections.ConfigDict, training: bool = True,
                planning: bool = False) -> SudokuTask:
  del training, planning  # puzzles are generated on demand: nothing to read either way
  return SudokuTask(config)
