"""Tests for diffgemma.sudoku: generator, solver, validators, CSV I/O, grain sources."""

import os

import numpy as np
import pytest

from diffgemma.tasks import sudoku
from diffgemma.tasks import sudoku_puzzles

# A well-known valid grid (Wikipedia's example solution).
KNOWN_GRID_STR = "534678912672195348198342567859761423426853791713924856961537284287419635345286179"
KNOWN_GRID = np.array([int(ch) for ch in KNOWN_GRID_STR], dtype=np.int8)


# ---------------------------------------------------------------------------
# Independent reference code (deliberately unlike the module: sets, 2-D lists)
# ---------------------------------------------------------------------------


def ref_is_valid(grid_81) -> bool:
  g = [[int(grid_81[9 * r + c]) for c in range(9)] for r in range(9)]
  units = [g[r] for r in range(9)]
  units += [[g[r][c] for r in range(9)] for c in range(9)]
  units += [
    [g[br + i][bc + j] for i in range(3) for j in range(3)] for br in (0, 3, 6) for bc in (0, 3, 6)
  ]
  return all(sorted(unit) == list(range(1, 10)) for unit in units)


def ref_count_solutions(puzzle_81, limit=2) -> int:
  """Plain backtracking on a 9x9 list; tries the most constrained cell, no propagation."""
  g = [[int(puzzle_81[9 * r + c]) for c in range(9)] for r in range(9)]

  def candidates(r, c):
    used = set(g[r]) | {g[i][c] for i in range(9)}
    br, bc = 3 * (r // 3), 3 * (c // 3)
    used |= {g[br + i][bc + j] for i in range(3) for j in range(3)}
    return [d for d in range(1, 10) if d not in used]

  def count(limit):
    empty = [(r, c) for r in range(9) for c in range(9) if g[r][c] == 0]
    if not empty:
      return 1
    r, c = min(empty, key=lambda rc: len(candidates(*rc)))
    total = 0
    for d in candidates(r, c):
      g[r][c] = d
      total += count(limit - total)
      g[r][c] = 0
      if total >= limit:
        break
    return total

  return count(limit)


# ---------------------------------------------------------------------------
# Generator and solver
# ---------------------------------------------------------------------------


def test_random_solution_valid_for_many_seeds():
  grids = [sudoku_puzzles.random_solution(np.random.default_rng(seed)) for seed in range(200)]
  assert all(g.shape == (81,) and g.dtype == np.int8 for g in grids)
  assert all(ref_is_valid(g) for g in grids)
  assert len({g.tobytes() for g in grids}) == len(grids)  # transforms actually vary


@pytest.mark.parametrize("num_givens", [24, 30, 36, 45, 60])
def test_make_puzzle_exact_givens_unique_and_consistent(num_givens):
  puzzle, solution = sudoku_puzzles.make_puzzle(np.random.default_rng(num_givens), num_givens)
  assert puzzle.dtype == solution.dtype == np.int8
  assert int((puzzle != 0).sum()) == num_givens
  assert ref_is_valid(solution)
  given = puzzle != 0
  assert (puzzle[given] == solution[given]).all()
  assert ref_count_solutions(puzzle) == 1


def test_make_puzzle_deterministic_for_seed():
  a = sudoku_puzzles.make_puzzle(np.random.default_rng(7), 32)
  b = sudoku_puzzles.make_puzzle(np.random.default_rng(7), 32)
  c = sudoku_puzzles.make_puzzle(np.random.default_rng(8), 32)
  np.testing.assert_array_equal(a[0], b[0])
  np.testing.assert_array_equal(a[1], b[1])
  assert not np.array_equal(a[0], c[0])


def test_make_puzzle_rejects_bad_givens_and_gives_up_cleanly():
  with pytest.raises(ValueError):
    sudoku_puzzles.make_puzzle(np.random.default_rng(0), sudoku_puzzles.MIN_GIVENS - 1)
  with pytest.raises(sudoku_puzzles.SudokuGenerationError, match="17 givens in 2 tries"):
    sudoku_puzzles.make_puzzle(np.random.default_rng(0), 17, max_tries=2)


def test_generate_puzzles_range_and_determinism():
  puzzles, solutions = sudoku_puzzles.generate_puzzles(seed=3, num=30, min_givens=28, max_givens=31)
  assert puzzles.shape == solutions.shape == (30, 81)
  assert puzzles.dtype == solutions.dtype == np.int8
  givens = (puzzles != 0).sum(axis=1)
  assert set(givens.tolist()) == {28, 29, 30, 31}
  assert sudoku_puzzles.batch_solved(puzzles, solutions).all()
  again, _ = sudoku_puzzles.generate_puzzles(seed=3, num=30, min_givens=28, max_givens=31)
  np.testing.assert_array_equal(puzzles, again)
  other, _ = sudoku_puzzles.generate_puzzles(seed=4, num=30, min_givens=28, max_givens=31)
  assert not np.array_equal(puzzles, other)
  with pytest.raises(ValueError):
    sudoku_puzzles.generate_puzzles(seed=0, num=1, min_givens=40, max_givens=30)


def test_solver_counts_and_solves():
  puzzle, solution = sudoku_puzzles.make_puzzle(np.random.default_rng(1), 25)
  assert sudoku_puzzles.count_solutions(puzzle) == 1
  np.testing.assert_array_equal(sudoku_puzzles.solve(puzzle), solution)
  assert sudoku_puzzles.count_solutions(np.zeros(81, dtype=np.int8)) == 2
  assert sudoku_puzzles.count_solutions(np.zeros(81, dtype=np.int8), limit=5) == 5
  assert ref_is_valid(sudoku_puzzles.solve(np.zeros(81, dtype=np.int8)))
  clash = np.zeros(81, dtype=np.int8)
  clash[0] = clash[1] = 5
  assert sudoku_puzzles.count_solutions(clash) == 0
  assert sudoku_puzzles.solve(clash) is None
  # Too few givens: the reference agrees there are several solutions.
  sparse = KNOWN_GRID.copy()
  sparse[np.random.default_rng(0).permutation(81)[:60]] = 0
  assert sudoku_puzzles.count_solutions(sparse) == ref_count_solutions(sparse) == 2


# ---------------------------------------------------------------------------
# Validators
# ---------------------------------------------------------------------------


def _swapped_pair() -> np.ndarray:
  grid = KNOWN_GRID.copy()
  grid[0], grid[1] = grid[1], grid[0]  # breaks columns (rows stay permutations)
  return grid


def _latin_square() -> np.ndarray:
  # Rows and columns are permutations, but boxes repeat digits.
  return np.array([(r + c) % 9 + 1 for r in range(9) for c in range(9)], dtype=np.int8)


def test_validators_on_known_cases():
  assert sudoku_puzzles.is_valid_solution(KNOWN_GRID)
  assert not sudoku_puzzles.is_valid_solution(_swapped_pair())
  latin = _latin_square()
  assert not ref_is_valid(latin) and not sudoku_puzzles.is_valid_solution(latin)
  blanked = KNOWN_GRID.copy()
  blanked[40] = 0
  assert not sudoku_puzzles.is_valid_solution(blanked)

  puzzle = KNOWN_GRID.copy()
  puzzle[::2] = 0
  assert sudoku_puzzles.batch_consistent(puzzle[None], KNOWN_GRID[None]).tolist() == [True]
  assert sudoku_puzzles.puzzle_solved(puzzle, KNOWN_GRID)
  wrong_given = puzzle.copy()
  wrong_given[1] = 1 + wrong_given[1] % 9
  assert sudoku_puzzles.batch_consistent(wrong_given[None], KNOWN_GRID[None]).tolist() == [False]
  assert not sudoku_puzzles.puzzle_solved(wrong_given, KNOWN_GRID)
  assert not sudoku_puzzles.puzzle_solved(puzzle, blanked)  # incomplete


def test_batch_versions_agree_with_scalar():
  rng = np.random.default_rng(0)
  grids = [
    KNOWN_GRID,
    _swapped_pair(),
    _latin_square(),
    np.zeros(81, np.int8),
    sudoku_puzzles.random_solution(rng),
    rng.integers(0, 10, 81).astype(np.int8),
  ]
  puzzles = []
  for grid in grids:
    puzzle = KNOWN_GRID.copy()
    puzzle[rng.random(81) < 0.7] = 0
    puzzles.append(puzzle)
  grids_Nx81, puzzles_Nx81 = np.stack(grids), np.stack(puzzles)
  assert sudoku_puzzles.batch_valid(grids_Nx81).tolist() == [
      sudoku_puzzles.is_valid_solution(g) for g in grids]
  assert sudoku_puzzles.batch_valid(grids_Nx81).tolist() == [ref_is_valid(g) for g in grids]
  assert sudoku_puzzles.batch_solved(puzzles_Nx81, grids_Nx81).tolist() == [
    sudoku_puzzles.puzzle_solved(p, g) for p, g in zip(puzzles, grids)
  ]
  assert sudoku_puzzles.batch_solved(puzzles_Nx81, grids_Nx81)[0]


def test_cell_accuracy_hand_computed():
  solutions = np.stack([KNOWN_GRID, KNOWN_GRID])
  puzzles = solutions.copy()
  puzzles[0, :3] = 0  # 3 blanks
  puzzles[1, :1] = 0  # 1 blank
  grids = solutions.copy()
  grids[0, 0] = 0  # wrong blank
  grids[0, 1] = 9  # wrong blank (true digit is 3)
  grids[1, 50] = 1  # wrong given: counts among all cells, not among blanks
  assert sudoku_puzzles.cell_accuracy(puzzles, grids, solutions) == pytest.approx(159 / 162)
  assert sudoku_puzzles.cell_accuracy(puzzles, grids, solutions, "all") == pytest.approx(159 / 162)
  assert sudoku_puzzles.cell_accuracy(puzzles, grids, solutions, "blank") == pytest.approx(2 / 4)
  assert (sudoku_puzzles.cell_accuracy(puzzles, grids, solutions, "given")
          == pytest.approx(157 / 158))
  assert sudoku_puzzles.cell_accuracy(solutions, grids, solutions, "blank") == 1.0  # no blanks
  assert sudoku_puzzles.cell_accuracy(solutions, grids, solutions) == pytest.approx(159 / 162)


# ---------------------------------------------------------------------------
# Text formats and CSV
# ---------------------------------------------------------------------------


def test_parse_puzzle_string():
  dots = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"
  parsed = sudoku_puzzles.parse_puzzle_string(dots)
  assert parsed.dtype == np.int8 and parsed.shape == (81,)
  np.testing.assert_array_equal(parsed, sudoku_puzzles.parse_puzzle_string(dots.replace(".", "0")))
  assert int((parsed != 0).sum()) == 30
  multiline = "\n".join(dots[i : i + 9] for i in range(0, 81, 9)) + "\n"
  np.testing.assert_array_equal(sudoku_puzzles.parse_puzzle_string(multiline), parsed)
  with pytest.raises(sudoku_puzzles.SudokuDataError, match="80 characters, expected 81"):
    sudoku_puzzles.parse_puzzle_string(dots[:-1])
  with pytest.raises(sudoku_puzzles.SudokuDataError, match="invalid character 'x' at position 3"):
    sudoku_puzzles.parse_puzzle_string("53x" + dots[3:])


def test_format_grid():
  text = sudoku_puzzles.format_grid(sudoku_puzzles.parse_puzzle_string("." * 80 + "9"))
  lines = text.splitlines()
  assert len(lines) == 11 and lines[3].startswith("------+")
  assert lines[0] == ". . . | . . . | . . ." and lines[-1].endswith("9")
  puzzle = KNOWN_GRID.copy()
  puzzle[1:] = 0
  marked = sudoku_puzzles.format_grid(KNOWN_GRID, puzzle)
  assert marked.count("[") == 1 and marked.startswith("[5] 3")


def _write_raw(tmp_path, text, name="data.csv"):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def test_csv_round_trip(tmp_path):
  puzzles, solutions = sudoku_puzzles.generate_puzzles(seed=0, num=5, min_givens=30, max_givens=40)
  path = str(tmp_path / "out.csv")
  sudoku_puzzles.write_csv(path, puzzles, solutions)
  assert open(path).readline() == "quizzes,solutions\n"
  assert os.listdir(tmp_path) == ["out.csv"]  # no temp file left behind
  loaded_p, loaded_s = sudoku_puzzles.load_csv(path)
  np.testing.assert_array_equal(loaded_p, puzzles)
  np.testing.assert_array_equal(loaded_s, solutions)
  assert loaded_p.dtype == np.int8
  assert sudoku_puzzles.load_csv(path, limit=2)[0].shape == (2, 81)


GOOD_QUIZ = "0" + KNOWN_GRID_STR[1:]
BAD_SOLUTION = KNOWN_GRID_STR[1] + KNOWN_GRID_STR[0] + KNOWN_GRID_STR[2:]


@pytest.mark.parametrize(
  "body, expected",
  [
    ("quiz,sol\n", "line 1: expected header 'quizzes,solutions'"),
    ("", "file is empty"),
    (
      f"quizzes,solutions\n{GOOD_QUIZ},{KNOWN_GRID_STR}\n{GOOD_QUIZ}\n",
      "line 3: expected 2 fields",
    ),
    (f"quizzes,solutions\n{GOOD_QUIZ},{KNOWN_GRID_STR},1\n", "line 2: expected 2 fields"),
    (
      f"quizzes,solutions\n{GOOD_QUIZ[:80]},{KNOWN_GRID_STR}\n",
      "line 2: quiz has 80 characters, expected 81",
    ),
    (
      f"quizzes,solutions\n{GOOD_QUIZ},{KNOWN_GRID_STR}5\n",
      "line 2: solution has 82 characters, expected 81",
    ),
    (
      f"quizzes,solutions\n{GOOD_QUIZ[:9]}.{GOOD_QUIZ[10:]},{KNOWN_GRID_STR}\n",
      "line 2: quiz has non-digit character '.' at position 10",
    ),
    (
      f"quizzes,solutions\n{GOOD_QUIZ},{KNOWN_GRID_STR}\n{GOOD_QUIZ},{BAD_SOLUTION}\n",
      "line 3: solution is not a valid sudoku grid",
    ),
    (
      f"quizzes,solutions\n{'1' + GOOD_QUIZ[1:]},{KNOWN_GRID_STR}\n",
      "line 2: solution disagrees with the quiz at row 1, column 1",
    ),
  ],
)
def test_load_csv_malformed(tmp_path, body, expected):
  path = _write_raw(tmp_path, body)
  with pytest.raises(sudoku_puzzles.SudokuDataError) as info:
    sudoku_puzzles.load_csv(path)
  message = str(info.value)
  assert "\n" not in message
  assert expected in message
  assert message.startswith(path)


def test_load_csv_missing_file(tmp_path):
  missing = str(tmp_path / "nope.csv")
  with pytest.raises(sudoku_puzzles.SudokuDataError, match="^no such file: .*nope.csv$"):
    sudoku_puzzles.load_csv(missing)


def test_write_csv_rejects_invalid(tmp_path):
  with pytest.raises(sudoku_puzzles.SudokuDataError, match="row 0: solution is not a valid"):
    sudoku_puzzles.write_csv(str(tmp_path / "x.csv"), KNOWN_GRID[None], _latin_square()[None])
  assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------
# grain sources
# ---------------------------------------------------------------------------


def test_generated_source_is_deterministic_per_index():
  source = sudoku_puzzles.GeneratedSudokuSource(num_records=1000, seed=5, min_givens=30,
                                                max_givens=40)
  assert len(source) == 1000
  first = source[123]
  assert set(first) == {"puzzle", "solution"}
  again = sudoku_puzzles.GeneratedSudokuSource(1000, 5, 30, 40)[np.int64(123)]
  np.testing.assert_array_equal(first["puzzle"], again["puzzle"])
  np.testing.assert_array_equal(first["solution"], again["solution"])
  assert not np.array_equal(source[124]["puzzle"], first["puzzle"])
  assert 30 <= int((first["puzzle"] != 0).sum()) <= 40
  # Same records as the batch generator.
  puzzles, _ = sudoku_puzzles.generate_puzzles(seed=5, num=2, min_givens=30, max_givens=40)
  np.testing.assert_array_equal(source[1]["puzzle"], puzzles[1])
  with pytest.raises(IndexError):
    source[1000]


def test_sources_work_with_grain(tmp_path):
  import grain.sources as grain_sources

  generated = sudoku_puzzles.GeneratedSudokuSource(10, 0, 40, 45)
  assert isinstance(generated, grain_sources.RandomAccessDataSource)
  path = str(tmp_path / "d.csv")
  puzzles, solutions = sudoku_puzzles.generate_puzzles(seed=0, num=3, min_givens=40, max_givens=45)
  sudoku_puzzles.write_csv(path, puzzles, solutions)
  csv_source = sudoku_puzzles.CsvSudokuSource(path)
  assert isinstance(csv_source, grain_sources.RandomAccessDataSource)
  assert len(csv_source) == 3
  np.testing.assert_array_equal(csv_source[2]["solution"], solutions[2])
  assert "d.csv" in repr(csv_source)


def test_step_profile_against_a_loop():
  """`step_profile` on a random trajectory (one canvas, rows stopping at different
  steps) equals per-cell loops over the steps each row ran."""
  rng = np.random.default_rng(0)
  n, b, c = 4, 3, sudoku.CANVAS_LEN + 2
  puzzles, solutions = sudoku_puzzles.generate_puzzles(3, b, 30, 40)
  steps_run = [4, 1, 2]
  valid_NxB = np.array([[s < run for run in steps_run] for s in range(n)])
  # Argmax tokens: the solution digit where a coin says so, else another token.
  right = rng.random((n, b, c)) < 0.6
  solution_tokens = np.concatenate([solutions + sudoku.DIGIT_OFFSET,
                                    np.zeros((b, c - sudoku.CANVAS_LEN), np.int64)], axis=1)
  argmax = np.where(right, solution_tokens[None], rng.integers(0, sudoku.DIGIT_OFFSET, (n, b, c)))
  traj = {"argmax": argmax[None], "accepted": (rng.random((n, b, c)) < 0.5)[None],
          "entropy": rng.random((n, b, c))[None].astype(np.float32), "valid": valid_NxB[None]}
  got = sudoku.step_profile(traj, puzzles, solutions)
  for s in range(n):
    want = dict.fromkeys(sudoku.STEP_PROFILE_KEYS, 0.0)
    for row in range(b):
      if not valid_NxB[s, row]:
        continue
      want["rows"] += 1
      for cell in range(sudoku.CANVAS_LEN):
        digit = argmax[s, row, cell] - sudoku.DIGIT_OFFSET
        correct = digit == solutions[row, cell]
        accepted = traj["accepted"][0, s, row, cell]
        entropy = float(traj["entropy"][0, s, row, cell])
        if puzzles[row, cell] == 0:
          want["blank_accepted"] += accepted
          want["blank_correct"] += correct
          want["blank_accepted_correct"] += accepted and correct
          want["blank_entropy"] += entropy
        else:
          want["given_entropy"] += entropy
    for key in sudoku.STEP_PROFILE_KEYS:
      np.testing.assert_allclose(got[key][s], want[key], rtol=1e-6, err_msg=f"{key}, step {s}")


def test_plateau_warning_fires_only_from_the_check_step_below_the_threshold():
  """SudokuTask.plateau_warning on hand-made eval metrics: one line from
  eval.plateau_check_step on while blank-cell accuracy is below eval.plateau_blank_accuracy;
  nothing before that step, for a healthy run, without the metric, or with the check off."""
  from configs import sft_sudoku

  config = sft_sudoku.get_config()
  config.eval.plateau_check_step = 1000
  config.eval.plateau_blank_accuracy = 0.5
  task = sudoku.SudokuTask(config)
  stuck = {"blank_cell_accuracy": 0.2, "given_cell_accuracy": 0.9}
  healthy = {"blank_cell_accuracy": 0.6, "given_cell_accuracy": 1.0}
  assert task.plateau_warning(999, stuck) is None  # too early to tell
  warning = task.plateau_warning(1000, stuck)
  assert warning.startswith("warning: at step 1000 blank-cell accuracy is 20.0%")
  assert "\n" not in warning and "50%" in warning
  assert task.plateau_warning(1500, stuck) is not None  # still stuck later
  assert task.plateau_warning(1500, healthy) is None
  assert task.plateau_warning(1500, {"given_cell_accuracy": 0.9}) is None  # no blank metric
  config.eval.plateau_check_step = 0  # off
  assert sudoku.SudokuTask(config).plateau_warning(1500, stuck) is None
