"""Write freshly generated Sudoku puzzles (unique solutions) as a Kaggle-format CSV.

  python scripts/make_sudoku_csv.py --out=/tmp/easy.csv --num=300 --min_givens=38 \
      --max_givens=46 --seed=2026

Or solve puzzles of your own (a published set such as Norvig's top95: one puzzle per line, 81
characters of digits with '.' or '0' for a blank, anything after them ignored) into the same
format, for eval.py:

  python scripts/make_sudoku_csv.py --from_lines=top95.txt --num=10 --out=/tmp/top10.csv
"""

import os

import numpy as np
from absl import flags

from diffgemma import cli, errors
from diffgemma.tasks import sudoku_puzzles

_OUT = flags.DEFINE_string("out", None, "Output CSV path.")
_NUM = flags.DEFINE_integer("num", 300, "Number of puzzles.")
_MIN = flags.DEFINE_integer("min_givens", 38, "Fewest givens.")
_MAX = flags.DEFINE_integer("max_givens", 46, "Most givens.")
_SEED = flags.DEFINE_integer("seed", 2026, "Generator seed (training uses other seeds).")
_FROM_LINES = flags.DEFINE_string(
    "from_lines", None, "Solve the first --num puzzles of this file (81 characters per line, "
    "'.' or '0' blank) instead of generating puzzles.")


def read_puzzle_lines(path: str, num: int):
  """(puzzles_Nx81, solutions_Nx81) int8 from the first `num` puzzle lines of `path`, each
  solved by search; a line that is not a puzzle with exactly one solution is a UserError."""
  puzzles, solutions = [], []
  with open(path) as f:
    for line_number, line in enumerate(f, 1):
      text = line.strip()
      if not text:
        continue
      cells = text.split()[0].replace(".", "0")
      if len(cells) != 81 or not cells.isdigit():
        raise cli.UserError(f"{path} line {line_number}: expected 81 digits or '.', got "
                            f"{cells[:90]!r}")
      puzzle = np.array([int(ch) for ch in cells], np.int8)
      if sudoku_puzzles.count_solutions(puzzle) != 1:
        raise cli.UserError(f"{path} line {line_number}: the puzzle has no unique solution")
      puzzles.append(puzzle)
      solutions.append(sudoku_puzzles.solve(puzzle))
      if len(puzzles) == num:
        break
  if not puzzles:
    raise cli.UserError(f"{path} holds no puzzle lines")
  return np.stack(puzzles), np.stack(solutions)


def main(argv):
  del argv
  if not _OUT.value:
    raise cli.UserError("--out is required, e.g. --out=/tmp/puzzles.csv")
  errors.check_output_file(_OUT.value, "out")
  if _NUM.value < 1:
    raise cli.UserError(f"--num must be >= 1, got {_NUM.value}")
  if _SEED.value < 0:
    raise cli.UserError(f"--seed must be >= 0, got {_SEED.value}")
  if _FROM_LINES.value:
    if not os.path.isfile(_FROM_LINES.value):
      raise cli.UserError(f"no such file: {_FROM_LINES.value} (--from_lines)")
    puzzles, solutions = read_puzzle_lines(_FROM_LINES.value, _NUM.value)
    _write(puzzles, solutions)
    print(f"wrote {len(puzzles)} puzzles of {_FROM_LINES.value}, solved, to {_OUT.value}")
    return
  try:
    sudoku_puzzles.check_givens_range(_MIN.value, _MAX.value)
  except ValueError as e:
    raise cli.UserError(f"--min_givens/--max_givens: {e}") from None
  try:
    puzzles, solutions = sudoku_puzzles.generate_puzzles(_SEED.value, _NUM.value, _MIN.value,
                                                         _MAX.value)
  except sudoku_puzzles.SudokuGenerationError as e:
    raise cli.UserError(f"{e}; raise --min_givens") from None
  _write(puzzles, solutions)
  print(f"wrote {len(puzzles)} puzzles ({_MIN.value}-{_MAX.value} givens) to {_OUT.value}")


def _write(puzzles, solutions):
  errors.prepare_output_file(_OUT.value, "out")  # its missing folders
  try:
    sudoku_puzzles.write_csv(_OUT.value, puzzles, solutions)
  except OSError as e:
    raise cli.UserError(f"cannot write {_OUT.value}: {e.strerror or e}") from None


if __name__ == "__main__":
  cli.run(main)
