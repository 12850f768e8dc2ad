"""The tests' tiny SD·RL config (tests.helpers.tiny_configs) as a config file, for runs of
train.py in a subprocess.

  python train.py --config=tests/tiny_sdrl_config.py --workdir=DIR --init_from=SFT_DIR
"""

from tests.helpers import tiny_configs


def get_config():
  return tiny_configs()[1]
