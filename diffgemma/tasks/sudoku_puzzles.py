"""Sudoku puzzles: generation, solving, validation, partial credit, CSV I/O and grain sources.

Grids are flat numpy arrays of 81 cells in row-major order (`grid_81[9 * row + col]`),
dtype int8, digits 1..9, and 0 for a blank cell. Batches are `[N, 81]`.

Pure numpy + Python on purpose: puzzles are generated on the fly inside data-loader
workers, where JAX would only add start-up cost and device contention.
"""

from __future__ import annotations

import operator
import os
import tempfile
from typing import Iterator, Optional

import numpy as np

from diffgemma import errors

# ---------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------

SIZE = 9  # digits per row / column / box
BOX = 3  # side of a box (and number of bands / stacks)
NUM_CELLS = SIZE * SIZE
BLANK = 0
# No 9x9 Sudoku with fewer than 17 givens has a unique solution (McGuire et al. 2012).
MIN_GIVENS = 17
# make_puzzle gives up after this many fresh solutions. Greedy removal in random order
# almost always reaches <= 28 givens; ~22 needs dozens of tries, lower is hopeless.
MAX_TRIES = 500

_ROW = [cell // SIZE for cell in range(NUM_CELLS)]
_COL = [cell % SIZE for cell in range(NUM_CELLS)]
_BOX = [BOX * (cell // (SIZE * BOX)) + (cell % SIZE) // BOX for cell in range(NUM_CELLS)]

# Candidate sets are 9-bit masks: bit d-1 set <=> digit d still possible.
_ALL_DIGITS = (1 << SIZE) - 1
_POPCOUNT = [bin(mask).count("1") for mask in range(1 << SIZE)]
_BIT_TO_DIGIT = {1 << (d - 1): d for d in range(1, SIZE + 1)}

# A valid grid: (3 * (r % 3) + r // 3 + c) % 9 shifts each row so that rows, columns
# and boxes are all permutations of 0..8. Every other grid we emit is a transform of it.
_ROWS_9x1 = np.arange(SIZE)[:, None]
_COLS_1x9 = np.arange(SIZE)[None, :]
_PATTERN_9x9 = (BOX * (_ROWS_9x1 % BOX) + _ROWS_9x1 // BOX + _COLS_1x9) % SIZE

_DIGITS_1_TO_9 = np.arange(1, SIZE + 1, dtype=np.int8)
_CSV_HEADER = "quizzes,solutions"
_PUZZLE_CHARS_HINT = "(digits 1-9, '.' or '0' for blanks)"


class SudokuDataError(errors.InputError):
  """Malformed user-supplied Sudoku data (CSV file or puzzle string). One-line message."""


class SudokuGenerationError(RuntimeError):
  """The generator could not reach the requested number of givens."""


# ---------------------------------------------------------------------------
# Random full grids
# ---------------------------------------------------------------------------


def _shuffled_lines(rng: np.random.Generator) -> np.ndarray:
  """Random order of 9 rows (or columns) that keeps bands (stacks) together: [9]."""
  bands = rng.permutation(BOX)
  return np.concatenate([BOX * band + rng.permutation(BOX) for band in bands])


def random_solution(rng: np.random.Generator) -> np.ndarray:
  """Random valid full grid, int8[81].

  Applies validity-preserving transforms to a fixed pattern grid: digit relabelling,
  row permutation within bands + band permutation, the same for columns/stacks, and
  an optional transpose. This covers ~3e12 grids per equivalence class, which is
  "uniform enough" for training and costs microseconds instead of a search.
  """
  digits = rng.permutation(_DIGITS_1_TO_9)
  rows = _shuffled_lines(rng)
  cols = _shuffled_lines(rng)
  grid_9x9 = digits[_PATTERN_9x9[np.ix_(rows, cols)]]
  if rng.integers(2):
    grid_9x9 = grid_9x9.T
  return np.ascontiguousarray(grid_9x9).reshape(NUM_CELLS).astype(np.int8)


# ---------------------------------------------------------------------------
# Solver: bitmask naked singles + MRV backtracking, on plain Python ints
# ---------------------------------------------------------------------------


def _with_digit(rows: list, cols: list, boxes: list, cell: int, bit: int) -> tuple:
  """Copies of the unit masks with digit `bit` placed at `cell` (search branches own theirs)."""
  rows, cols, boxes = rows[:], cols[:], boxes[:]
  rows[_ROW[cell]] |= bit
  cols[_COL[cell]] |= bit
  boxes[_BOX[cell]] |= bit
  return rows, cols, boxes


def _search(
  rows: list,
  cols: list,
  boxes: list,
  empties: list,
  placed: list,
  limit: int,
  found: Optional[list],
) -> int:
  """Count solutions (stopping at `limit`) of the state given by the unit masks.

  rows/cols/boxes: [9] masks of digits already used in each unit; mutated in place,
    so callers pass copies they can throw away.
  empties: cells still blank. Not mutated.
  placed: (cell, bit) assignments made so far; restored to its length on return.
  found: if not None, a copy of `placed` is appended for every solution found.
  """
  mark = len(placed)
  # Naked singles to a fixpoint, choosing the branching cell (fewest candidates) on
  # the last sweep. Placing singles in the same sweep is safe: later cells see the
  # updated masks, and earlier ones are re-examined on the next sweep.
  while True:
    progress = False
    best_count = SIZE + 1
    best_cell = best_cands = -1
    remaining = []
    for cell in empties:
      r, c, b = _ROW[cell], _COL[cell], _BOX[cell]
      cands = _ALL_DIGITS ^ (rows[r] | cols[c] | boxes[b])  # used is a subset of all
      if not cands:
        del placed[mark:]
        return 0
      count = _POPCOUNT[cands]
      if count == 1:
        rows[r] |= cands
        cols[c] |= cands
        boxes[b] |= cands
        placed.append((cell, cands))
        progress = True
      else:
        remaining.append(cell)
        if count < best_count:
          best_count, best_cell, best_cands = count, cell, cands
    empties = remaining
    if not progress:
      break

  if not empties:
    if found is not None:
      found.append(list(placed))
    del placed[mark:]
    return 1

  rest = [cell for cell in empties if cell != best_cell]
  total = 0
  cands = best_cands
  while cands and total < limit:
    bit = cands & -cands
    cands ^= bit
    sub_rows, sub_cols, sub_boxes = _with_digit(rows, cols, boxes, best_cell, bit)
    placed.append((best_cell, bit))
    total += _search(sub_rows, sub_cols, sub_boxes, rest, placed, limit - total, found)
    placed.pop()
  del placed[mark:]
  return total


def _unit_masks(cells: list) -> Optional[tuple]:
  """(rows, cols, boxes, empties) for a list of 81 digits; None if givens clash."""
  rows, cols, boxes = [0] * SIZE, [0] * SIZE, [0] * SIZE
  empties = []
  for cell, digit in enumerate(cells):
    if digit == BLANK:
      empties.append(cell)
      continue
    bit = 1 << (digit - 1)
    r, c, b = _ROW[cell], _COL[cell], _BOX[cell]
    if (rows[r] | cols[c] | boxes[b]) & bit:
      return None
    rows[r] |= bit
    cols[c] |= bit
    boxes[b] |= bit
  return rows, cols, boxes, empties


def _as_cells(puzzle_81) -> list:
  """Checks a puzzle is 81 digits in 0..9 and returns it as a Python list."""
  puzzle_81 = np.asarray(puzzle_81)
  if puzzle_81.shape != (NUM_CELLS,):
    raise ValueError(f"expected a puzzle of shape ({NUM_CELLS},), got {puzzle_81.shape}")
  if puzzle_81.min() < BLANK or puzzle_81.max() > SIZE:
    raise ValueError("puzzle cells must be 0 (blank) or digits 1..9")
  return [int(x) for x in puzzle_81]


def count_solutions(puzzle_81, limit: int = 2) -> int:
  """Number of solutions of `puzzle_81` (int[81], 0 = blank), counted up to `limit`.

  `limit=2` is all a uniqueness check needs, and stops the search early.
  """
  state = _unit_masks(_as_cells(puzzle_81))
  if state is None:
    return 0
  rows, cols, boxes, empties = state
  return _search(rows, cols, boxes, empties, [], limit, None)


def solve(puzzle_81) -> Optional[np.ndarray]:
  """A solution of `puzzle_81` as int8[81] (the first one found), or None if unsolvable."""
  cells = _as_cells(puzzle_81)
  state = _unit_masks(cells)
  if state is None:
    return None
  rows, cols, boxes, empties = state
  found = []
  if not _search(rows, cols, boxes, empties, [], 1, found):
    return None
  for cell, bit in found[0]:
    cells[cell] = _BIT_TO_DIGIT[bit]
  return np.array(cells, dtype=np.int8)


# ---------------------------------------------------------------------------
# Puzzle generation
# ---------------------------------------------------------------------------


def _has_other_solution(rows, cols, boxes, empties, cell, digit_bit) -> bool:
  """Whether blank `cell` can take a digit other than `digit_bit` in some solution.

  The puzzle before blanking `cell` was unique, so the new puzzle is unique iff no
  solution puts something else there. Searching only those branches (limit 1) is much
  cheaper than re-finding the known solution and then exhausting the rest.
  """
  r, c, b = _ROW[cell], _COL[cell], _BOX[cell]
  others = (_ALL_DIGITS ^ (rows[r] | cols[c] | boxes[b])) & ~digit_bit
  while others:
    bit = others & -others
    others ^= bit
    sub_rows, sub_cols, sub_boxes = _with_digit(rows, cols, boxes, cell, bit)
    if _search(sub_rows, sub_cols, sub_boxes, empties, [], 1, None):
      return True
  return False


def _carve(solution_81: np.ndarray, num_givens: int, order_81: np.ndarray) -> Optional[np.ndarray]:
  """Blank cells of a full grid in `order_81` while the puzzle stays unique.

  Returns the int8[81] puzzle with exactly `num_givens` givens, or None if this order
  hits a minimal puzzle (every remaining given is needed) before getting there.
  """
  cells = [int(x) for x in solution_81]
  rows, cols, boxes = [_ALL_DIGITS] * SIZE, [_ALL_DIGITS] * SIZE, [_ALL_DIGITS] * SIZE
  empties = []
  givens = NUM_CELLS
  for position, cell in enumerate(order_81.tolist()):
    to_remove = givens - num_givens
    if to_remove == 0:
      break
    if to_remove > NUM_CELLS - position:
      return None  # not enough cells left in the order: give up early
    bit = 1 << (cells[cell] - 1)
    r, c, b = _ROW[cell], _COL[cell], _BOX[cell]
    rows[r] ^= bit
    cols[c] ^= bit
    boxes[b] ^= bit
    if _has_other_solution(rows, cols, boxes, empties, cell, bit):
      rows[r] |= bit  # this given is needed: put it back
      cols[c] |= bit
      boxes[b] |= bit
    else:
      cells[cell] = BLANK
      empties.append(cell)
      givens -= 1
  if givens != num_givens:
    return None
  return np.array(cells, dtype=np.int8)


def make_puzzle(
  rng: np.random.Generator, num_givens: int, max_tries: int = MAX_TRIES
) -> tuple[np.ndarray, np.ndarray]:
  """A puzzle with exactly `num_givens` givens and a unique solution.

  Returns (puzzle_81, solution_81), both int8[81]; blanks are 0 in the puzzle.
  Raises SudokuGenerationError after `max_tries` fresh (solution, order) pairs fail,
  which in practice only happens for num_givens below ~22.
  """
  num_givens = operator.index(num_givens)
  if not MIN_GIVENS <= num_givens <= NUM_CELLS:
    raise ValueError(f"num_givens must be in [{MIN_GIVENS}, {NUM_CELLS}], got {num_givens}")
  for _ in range(max_tries):
    solution_81 = random_solution(rng)
    puzzle_81 = _carve(solution_81, num_givens, rng.permutation(NUM_CELLS))
    if puzzle_81 is not None:
      return puzzle_81, solution_81
  raise SudokuGenerationError(
    f"could not make a unique puzzle with {num_givens} givens in {max_tries} tries; "
    f"greedy removal rarely gets below ~22 givens"
  )


def check_givens_range(min_givens: int, max_givens: int) -> None:
  if not MIN_GIVENS <= min_givens <= max_givens <= NUM_CELLS:
    raise ValueError(
      f"need {MIN_GIVENS} <= min_givens <= max_givens <= {NUM_CELLS}, "
      f"got min_givens={min_givens}, max_givens={max_givens}"
    )


def generated_record(
  seed: int, index: int, min_givens: int, max_givens: int
) -> tuple[np.ndarray, np.ndarray]:
  """Puzzle number `index` of the stream `seed`: (puzzle_81, solution_81), int8.

  Depends only on (seed, index, min_givens, max_givens), so any position of the
  stream can be regenerated without replaying the ones before it.
  """
  rng = np.random.default_rng([seed, index])
  num_givens = int(rng.integers(min_givens, max_givens + 1))
  return make_puzzle(rng, num_givens)


def generate_puzzles(
  seed: int, num: int, min_givens: int, max_givens: int
) -> tuple[np.ndarray, np.ndarray]:
  """`num` puzzles with givens uniform in [min_givens, max_givens] (inclusive).

  Returns (puzzles_Nx81, solutions_Nx81), int8. Record i equals
  `generated_record(seed, i, ...)` and `GeneratedSudokuSource(..., seed, ...)[i]`.
  """
  check_givens_range(min_givens, max_givens)
  puzzles_Nx81 = np.zeros((num, NUM_CELLS), dtype=np.int8)
  solutions_Nx81 = np.zeros((num, NUM_CELLS), dtype=np.int8)
  for i in range(num):
    puzzles_Nx81[i], solutions_Nx81[i] = generated_record(seed, i, min_givens, max_givens)
  return puzzles_Nx81, solutions_Nx81


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _as_batch(grids_Nx81, name: str = "grids") -> np.ndarray:
  grids_Nx81 = np.asarray(grids_Nx81)
  if grids_Nx81.ndim != 2 or grids_Nx81.shape[1] != NUM_CELLS:
    raise ValueError(f"expected {name} of shape [N, {NUM_CELLS}], got {grids_Nx81.shape}")
  return grids_Nx81


def batch_valid(grids_Nx81) -> np.ndarray:
  """bool[N]: every row, column and box of grid i is a permutation of 1..9."""
  grids_Nx9x9 = _as_batch(grids_Nx81).reshape(-1, SIZE, SIZE)
  # Boxes become rows: [N, band, row-in-band, stack, col-in-stack] -> [N, band, stack, ...].
  boxes_Nx9x9 = (
    grids_Nx9x9.reshape(-1, BOX, BOX, BOX, BOX).transpose(0, 1, 3, 2, 4).reshape(-1, SIZE, SIZE)
  )
  # Sorting a unit gives exactly 1..9 iff it is a permutation (also rejects 0 / >9).
  rows_ok = (np.sort(grids_Nx9x9, axis=2) == _DIGITS_1_TO_9).all(axis=(1, 2))
  cols_ok = (np.sort(grids_Nx9x9, axis=1) == _DIGITS_1_TO_9[:, None]).all(axis=(1, 2))
  boxes_ok = (np.sort(boxes_Nx9x9, axis=2) == _DIGITS_1_TO_9).all(axis=(1, 2))
  return rows_ok & cols_ok & boxes_ok


def batch_consistent(puzzles_Nx81, grids_Nx81) -> np.ndarray:
  """bool[N]: grid i agrees with every given (non-zero cell) of puzzle i."""
  puzzles_Nx81 = _as_batch(puzzles_Nx81, "puzzles")
  grids_Nx81 = _as_batch(grids_Nx81)
  return ((puzzles_Nx81 == BLANK) | (puzzles_Nx81 == grids_Nx81)).all(axis=1)


def batch_solved(puzzles_Nx81, grids_Nx81) -> np.ndarray:
  """bool[N]: grid i is complete, valid and consistent with puzzle i."""
  return batch_valid(grids_Nx81) & batch_consistent(puzzles_Nx81, grids_Nx81)


def is_valid_solution(grid_81) -> bool:
  """Every row, column and box of int[81] `grid_81` is a permutation of 1..9."""
  return bool(batch_valid(np.asarray(grid_81)[None])[0])


def puzzle_solved(puzzle_81, grid_81) -> bool:
  """`grid_81` is complete, valid and consistent with `puzzle_81`."""
  return bool(batch_solved(np.asarray(puzzle_81)[None], np.asarray(grid_81)[None])[0])


def cell_accuracy(puzzles_Nx81, grids_Nx81, solutions_Nx81, cells: str = "all") -> float:
  """Fraction of the chosen cells (over the whole batch) where grid == solution.

  cells: "all" (all 81 of each puzzle), "blank" (the cells a puzzle leaves open: copying the
  givens is trivial, so this is the score that says whether a model solves) or "given".
  Returns 1.0 when no cell is chosen (nothing could be wrong).
  """
  puzzles_Nx81 = _as_batch(puzzles_Nx81, "puzzles")
  chosen_Nx81 = {"all": np.ones(puzzles_Nx81.shape, bool), "blank": puzzles_Nx81 == BLANK,
                 "given": puzzles_Nx81 != BLANK}[cells]
  num_chosen = int(chosen_Nx81.sum())
  if num_chosen == 0:
    return 1.0
  correct_Nx81 = _as_batch(grids_Nx81) == _as_batch(solutions_Nx81, "solutions")
  return float((correct_Nx81 & chosen_Nx81).sum()) / num_chosen


# ---------------------------------------------------------------------------
# Partial credit (SD·RL rewards): the units and cells a grid gets right
# ---------------------------------------------------------------------------


def _units_Nx27x9(grids_Nx81):
  """The 27 units of each grid as rows of 9 cells: 9 rows, 9 columns, 9 boxes."""
  g_Nx9x9 = np.asarray(grids_Nx81).reshape(-1, SIZE, SIZE)
  b = BOX
  boxes = g_Nx9x9.reshape(-1, b, b, b, b).transpose(0, 1, 3, 2, 4).reshape(-1, SIZE, SIZE)
  return np.concatenate([g_Nx9x9, g_Nx9x9.transpose(0, 2, 1), boxes], axis=1)


def unit_satisfaction(puzzles_Nx81, grids_Nx81):
  """float[N]: fraction of the 27 units that hold 1..9 once each and keep their givens."""
  grid_units = _units_Nx27x9(grids_Nx81)
  given_units = _units_Nx27x9(puzzles_Nx81)
  digits = np.arange(1, SIZE + 1)
  permutation = (np.sort(grid_units, axis=-1) == digits).all(-1)
  keeps_givens = ((given_units == BLANK) | (given_units == grid_units)).all(-1)
  return (permutation & keeps_givens).mean(-1)


def consistent_cells(puzzles_Nx81, grids_Nx81):
  """bool[N, 81]: cells holding a digit that keeps the cell's given (if any) and occurs once in
  its row, its column and its box. A solved grid is consistent everywhere; needs no solution."""
  g_Nx9x9 = np.asarray(grids_Nx81).reshape(-1, SIZE, SIZE)
  n, b = len(g_Nx9x9), BOX
  onehot_Nx9x9xD = g_Nx9x9[..., None] == np.arange(1, SIZE + 1)
  in_row = onehot_Nx9x9xD.sum(2, keepdims=True)
  in_col = onehot_Nx9x9xD.sum(1, keepdims=True)
  box_NxbxbxbxbxD = onehot_Nx9x9xD.reshape(n, b, b, b, b, -1)
  in_box = box_NxbxbxbxbxD.sum((2, 4), keepdims=True)
  in_box = np.broadcast_to(in_box, box_NxbxbxbxbxD.shape).reshape(onehot_Nx9x9xD.shape)
  once = ((in_row == 1) & (in_col == 1) & (in_box == 1) & onehot_Nx9x9xD).any(-1)
  puzzles = np.asarray(puzzles_Nx81)
  keeps_given = (puzzles == BLANK) | (puzzles == np.asarray(grids_Nx81))
  return once.reshape(n, -1) & keeps_given


def blank_cell_accuracy(puzzles_Nx81, grids_Nx81, solutions_Nx81):
  """float[N]: per puzzle, the fraction of its blank cells where the grid equals the solution."""
  blank = np.asarray(puzzles_Nx81) == BLANK
  correct = np.asarray(grids_Nx81) == np.asarray(solutions_Nx81)
  return (correct & blank).sum(-1) / np.maximum(blank.sum(-1), 1)


# ---------------------------------------------------------------------------
# Text formats
# ---------------------------------------------------------------------------


def conflicting_givens(puzzle_81) -> Optional[str]:
  """The first pair of givens that break a rule (the same digit twice in a row, column or box),
  described in one line, or None if the givens are consistent. Cells are 1-based."""
  cells = _as_cells(puzzle_81)
  units = (("row", _ROW), ("column", _COL), ("box", _BOX))
  for name, unit_of in units:
    seen = {}
    for cell in range(NUM_CELLS):
      digit = cells[cell]
      if digit == BLANK:
        continue
      key = (unit_of[cell], digit)
      if key in seen:
        first = seen[key]
        return (f"digit {digit} is given twice in {name} {unit_of[cell] + 1} (row "
                f"{_ROW[first] + 1} column {_COL[first] + 1}, and row {_ROW[cell] + 1} column "
                f"{_COL[cell] + 1})")
      seen[key] = cell
  return None


def parse_puzzle_string(s: str) -> np.ndarray:
  """Parse 81 characters (digits, '.' or '0' for blanks; whitespace ignored) to int8[81].

  SudokuDataError (one line) if the string is malformed or its givens already conflict."""
  chars = "".join(s.split())  # also drops inner whitespace, so 9-line pastes work
  if len(chars) != NUM_CELLS:
    raise SudokuDataError(
      f"puzzle has {len(chars)} characters, expected {NUM_CELLS} {_PUZZLE_CHARS_HINT}"
    )
  for position, ch in enumerate(chars):
    if ch not in ".0123456789":
      raise SudokuDataError(
        f"puzzle has invalid character {ch!r} at position {position + 1} {_PUZZLE_CHARS_HINT}"
      )
  puzzle_81 = np.array([0 if ch == "." else int(ch) for ch in chars], dtype=np.int8)
  conflict = conflicting_givens(puzzle_81)
  if conflict is not None:
    raise SudokuDataError(f"puzzle cannot be solved: {conflict}")
  return puzzle_81


def format_grid(grid_81, puzzle_81=None) -> str:
  """9x9 text rendering with box separators; '.' for 0 (unknown / blank).

  With `puzzle_81`, the puzzle's givens are shown in brackets, e.g. `[5]`, so the
  filled-in cells stand out.
  """
  grid_81 = np.asarray(grid_81).reshape(NUM_CELLS)
  givens_81 = (
    np.zeros(NUM_CELLS, dtype=bool)
    if puzzle_81 is None
    else np.asarray(puzzle_81).reshape(NUM_CELLS) != BLANK
  )

  def cell_text(cell: int) -> str:
    digit = int(grid_81[cell])
    text = "." if digit == BLANK else str(digit)
    if puzzle_81 is None:
      return text
    return f"[{text}]" if givens_81[cell] else f" {text} "

  joiner = " " if puzzle_81 is None else ""
  lines = []
  for row in range(SIZE):
    stacks = [
      joiner.join(cell_text(SIZE * row + col) for col in range(s, s + BOX))
      for s in range(0, SIZE, BOX)
    ]
    if row and row % BOX == 0:
      lines.append("-+-".join("-" * len(stack) for stack in stacks))
    lines.append(" | ".join(stacks).rstrip())
  return "\n".join(lines)


# ---------------------------------------------------------------------------
# Kaggle CSV ("quizzes,solutions", 81-digit strings, 0 = blank)
# ---------------------------------------------------------------------------


def _first_bad_pair(puzzles_Nx81: np.ndarray, solutions_Nx81: np.ndarray) -> Optional[tuple]:
  """(row index, problem) of the first invalid (quiz, solution) pair, or None."""
  valid_N = batch_valid(solutions_Nx81)
  consistent_N = batch_consistent(puzzles_Nx81, solutions_Nx81)
  bad = np.flatnonzero(~(valid_N & consistent_N))
  if bad.size == 0:
    return None
  i = int(bad[0])
  if not valid_N[i]:
    return i, "solution is not a valid sudoku grid"
  cell = int(np.flatnonzero((puzzles_Nx81[i] != BLANK) & (puzzles_Nx81[i] != solutions_Nx81[i]))[0])
  return i, (
    f"solution disagrees with the quiz at row {cell // SIZE + 1}, column {cell % SIZE + 1}"
  )


def _describe_non_digit(field: bytes) -> str:
  position, byte = next((i, x) for i, x in enumerate(field) if not 48 <= x <= 57)
  shown = repr(chr(byte)) if byte < 128 else f"byte 0x{byte:02x}"
  return f"non-digit character {shown} at position {position + 1}"


def _iter_csv_rows(path: str, limit: Optional[int]) -> Iterator[tuple]:
  """Yields (line_number, quiz_bytes, solution_bytes) after per-line format checks."""
  with open(path, "rb") as f:
    header = f.readline()
    if not header:
      raise SudokuDataError(f"{path}: file is empty, expected header '{_CSV_HEADER}'")
    header = header.removeprefix(b"\xef\xbb\xbf").strip()  # tolerate a UTF-8 BOM
    if header != _CSV_HEADER.encode():
      got = header[:60].decode("ascii", errors="replace")
      raise SudokuDataError(f"{path} line 1: expected header '{_CSV_HEADER}', got {got!r}")
    num_rows = 0
    for line_number, line in enumerate(f, start=2):
      if limit is not None and num_rows >= limit:
        return
      line = line.strip()
      if not line:
        continue  # tolerate blank lines (e.g. a trailing one)
      fields = line.split(b",")
      if len(fields) != 2:
        raise SudokuDataError(
          f"{path} line {line_number}: expected 2 fields (quiz,solution), got {len(fields)}"
        )
      for name, field in zip(("quiz", "solution"), fields):
        if len(field) != NUM_CELLS:
          raise SudokuDataError(
            f"{path} line {line_number}: {name} has {len(field)} characters, expected {NUM_CELLS}"
          )
        if not field.isdigit():  # bytes.isdigit is ASCII-only
          raise SudokuDataError(
            f"{path} line {line_number}: {name} has {_describe_non_digit(field)}"
          )
      num_rows += 1
      yield line_number, fields[0], fields[1]


def _digits_to_array(strings: list) -> np.ndarray:
  """ASCII digit strings, 81 bytes each -> int8[N, 81]."""
  flat = np.frombuffer(b"".join(strings), dtype=np.uint8) - ord("0")
  return flat.astype(np.int8).reshape(len(strings), NUM_CELLS)


def load_csv(path, limit: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
  """Read a Kaggle-style CSV into (puzzles_Nx81, solutions_Nx81), int8.

  Reads at most `limit` data rows. Raises SudokuDataError (one line, with the file
  and line number) for anything malformed, including solutions that are not valid
  grids or disagree with their quiz.
  """
  path = os.fspath(path)
  if limit is not None and limit < 0:
    raise ValueError(f"limit must be >= 0, got {limit}")
  if os.path.isdir(path):
    raise SudokuDataError(f"{path} is a directory, expected a CSV file")
  if not os.path.isfile(path):
    raise SudokuDataError(f"no such file: {path}")
  line_numbers, quizzes, solutions = [], [], []
  for line_number, quiz, solution in _iter_csv_rows(path, limit):
    line_numbers.append(line_number)
    quizzes.append(quiz)
    solutions.append(solution)
  puzzles_Nx81 = _digits_to_array(quizzes)
  solutions_Nx81 = _digits_to_array(solutions)
  bad = _first_bad_pair(puzzles_Nx81, solutions_Nx81)
  if bad is not None:
    index, problem = bad
    raise SudokuDataError(f"{path} line {line_numbers[index]}: {problem}")
  return puzzles_Nx81, solutions_Nx81


def write_csv(path, puzzles_Nx81, solutions_Nx81) -> None:
  """Write a Kaggle-style CSV atomically (temp file in the same directory + os.replace).

  Rejects data that load_csv would reject, so every written file round-trips.
  """
  path = os.fspath(path)
  puzzles_Nx81 = _as_batch(puzzles_Nx81, "puzzles")
  solutions_Nx81 = _as_batch(solutions_Nx81, "solutions")
  if puzzles_Nx81.shape != solutions_Nx81.shape:
    raise ValueError(
      f"puzzles {puzzles_Nx81.shape} and solutions {solutions_Nx81.shape} differ in shape"
    )
  if puzzles_Nx81.size and (puzzles_Nx81.min() < BLANK or puzzles_Nx81.max() > SIZE):
    raise ValueError("puzzle cells must be 0 (blank) or digits 1..9")
  bad = _first_bad_pair(puzzles_Nx81, solutions_Nx81)
  if bad is not None:
    index, problem = bad
    raise SudokuDataError(f"write_csv row {index}: {problem}")

  # One [N, 81 + 1 + 81 + 1] byte table: quiz, ',', solution, '\n'.
  num = puzzles_Nx81.shape[0]
  table = np.empty((num, 2 * NUM_CELLS + 2), dtype=np.uint8)
  table[:, :NUM_CELLS] = puzzles_Nx81 + ord("0")
  table[:, NUM_CELLS] = ord(",")
  table[:, NUM_CELLS + 1 : -1] = solutions_Nx81 + ord("0")
  table[:, -1] = ord("\n")

  directory = os.path.dirname(os.path.abspath(path))
  fd, tmp_path = tempfile.mkstemp(
    dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp"
  )
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(f"{_CSV_HEADER}\n".encode())
      f.write(table.tobytes())
    os.chmod(tmp_path, 0o644)  # mkstemp creates 0600; data files should be readable
    os.replace(tmp_path, path)
  except BaseException:
    if os.path.exists(tmp_path):
      os.unlink(tmp_path)
    raise


# ---------------------------------------------------------------------------
# grain data sources (duck-typed grain.sources.RandomAccessDataSource)
# ---------------------------------------------------------------------------


def _check_index(index, length: int) -> int:
  index = operator.index(index)  # grain may pass numpy integers
  if not 0 <= index < length:
    raise IndexError(f"index {index} out of range for {length} records")
  return index


class GeneratedSudokuSource:
  """Random-access source of freshly generated puzzles.

  Record i is `generated_record(seed, i, min_givens, max_givens)` as
  {"puzzle": int8[81], "solution": int8[81]}: a pure function of the index, so
  training can resume from any data position and workers need no shared state.
  """

  def __init__(self, num_records: int, seed: int, min_givens: int, max_givens: int):
    check_givens_range(min_givens, max_givens)
    if num_records < 0:
      raise ValueError(f"num_records must be >= 0, got {num_records}")
    self.num_records = num_records
    self.seed = seed
    self.min_givens = min_givens
    self.max_givens = max_givens

  def __len__(self) -> int:
    return self.num_records

  def __getitem__(self, index) -> dict:
    index = _check_index(index, self.num_records)
    puzzle_81, solution_81 = generated_record(self.seed, index, self.min_givens, self.max_givens)
    return {"puzzle": puzzle_81, "solution": solution_81}

  def __repr__(self) -> str:  # grain uses repr to validate checkpoints
    return (
      f"GeneratedSudokuSource(num_records={self.num_records}, seed={self.seed}, "
      f"min_givens={self.min_givens}, max_givens={self.max_givens})"
    )


class CsvSudokuSource:
  """Random-access source over a Kaggle-style CSV, loaded (and validated) up front."""

  def __init__(self, path, limit: Optional[int] = None):
    self.path = os.fspath(path)
    self.limit = limit
    self.puzzles_Nx81, self.solutions_Nx81 = load_csv(self.path, limit)

  def __len__(self) -> int:
    return self.puzzles_Nx81.shape[0]

  def __getitem__(self, index) -> dict:
    index = _check_index(index, len(self))
    # Copies, so a consumer that mutates a record cannot corrupt the source.
    return {
      "puzzle": self.puzzles_Nx81[index].copy(),
      "solution": self.solutions_Nx81[index].copy(),
    }

  def __repr__(self) -> str:
    return f"CsvSudokuSource(path={self.path!r}, limit={self.limit}, num_records={len(self)})"
