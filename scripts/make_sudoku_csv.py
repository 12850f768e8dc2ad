"""Write freshly generated Sudoku puzzles (unique solutions) as a Kaggle-format CSV.

  python scripts/make_sudoku_csv.py --out=/tmp/easy.csv --num=300 --min_givens=38 \
      --max_givens=46 --seed=2026
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from diffgemma.tasks import sudoku_puzzles as sudoku  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "Output CSV path.", required=True)
_NUM = flags.DEFINE_integer("num", 300, "Number of puzzles.")
_MIN = flags.DEFINE_integer("min_givens", 38, "Fewest givens.")
_MAX = flags.DEFINE_integer("max_givens", 46, "Most givens.")
_SEED = flags.DEFINE_integer("seed", 2026, "Generator seed (training uses other seeds).")


def main(argv):
  del argv
  puzzles, solutions = sudoku.generate_puzzles(_SEED.value, _NUM.value, _MIN.value, _MAX.value)
  sudoku.write_csv(_OUT.value, puzzles, solutions)
  print(f"wrote {len(puzzles)} puzzles ({_MIN.value}-{_MAX.value} givens) to {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
