"""The tests' tiny Sudoku SFT config as a config file, for runs of train.py in a subprocess.

  python train.py --config=tests/tiny_sudoku_config.py --workdir=DIR [--config.KEY=VALUE ...]
"""

from tests.helpers import tiny_sudoku_config


def get_config():
  return tiny_sudoku_config()
