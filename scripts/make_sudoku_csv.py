"""Write freshly generated Sudoku puzzles (unique solutions) as a Kaggle-format CSV.

  python scripts/make_sudoku_csv.py --out=/tmp/easy.csv --num=300 --min_givens=38 \
      --max_givens=46 --seed=2026
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402

from diffgemma import cli  # noqa: E402
from diffgemma.tasks import sudoku_puzzles as sudoku  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "Output CSV path.")
_NUM = flags.DEFINE_integer("num", 300, "Number of puzzles.")
_MIN = flags.DEFINE_integer("min_givens", 38, "Fewest givens.")
_MAX = flags.DEFINE_integer("max_givens", 46, "Most givens.")
_SEED = flags.DEFINE_integer("seed", 2026, "Generator seed (training uses other seeds).")


def main(argv):
  del argv
  if not _OUT.value:
    raise cli.UserError("--out is required, e.g. --out=/tmp/puzzles.csv")
  if _NUM.value < 1:
    raise cli.UserError(f"--num must be >= 1, got {_NUM.value}")
  if _SEED.value < 0:
    raise cli.UserError(f"--seed must be >= 0, got {_SEED.value}")
  try:
    sudoku.check_givens_range(_MIN.value, _MAX.value)
  except ValueError as e:
    raise cli.UserError(f"--min_givens/--max_givens: {e}") from None
  directory = os.path.dirname(os.path.abspath(_OUT.value))
  if not os.path.isdir(directory):
    raise cli.UserError(f"directory {directory} of --out does not exist")
  try:
    puzzles, solutions = sudoku.generate_puzzles(_SEED.value, _NUM.value, _MIN.value, _MAX.value)
  except sudoku.SudokuGenerationError as e:
    raise cli.UserError(f"{e}; raise --min_givens") from None
  try:
    sudoku.write_csv(_OUT.value, puzzles, solutions)
  except OSError as e:
    raise cli.UserError(f"cannot write {_OUT.value}: {e.strerror or e}") from None
  print(f"wrote {len(puzzles)} puzzles ({_MIN.value}-{_MAX.value} givens) to {_OUT.value}")


if __name__ == "__main__":
  cli.run(main)
