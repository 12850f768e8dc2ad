"""Train a DiffusionGemma model.

  python train.py --config=sft_sudoku --workdir=/tmp/sudoku [--config.num_train_steps=500 ...]
  python train.py --config=CONFIG --workdir=DIR --init_from=CHECKPOINT_DIR   # fine-tune

Rerunning on the same workdir resumes exactly (step, optimizer, data position, RNG).
"""

from absl import flags
from ml_collections import config_flags

from diffgemma import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/NAME.py, or just NAME.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, config and logs.")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "Start a new run from these parameters: a transformers checkpoint dir "
    "(DiffusionGemma or Gemma 4), an orbax model dir, or a training workdir. The model "
    "architecture comes from the checkpoint.")


def main(argv):
  del argv
  if _CONFIG.value is None:
    raise cli.UserError("--config is required, e.g. --config=sft_sudoku")
  if not _WORKDIR.value:
    raise cli.UserError("--workdir is required, e.g. --workdir=/tmp/sudoku")
  from diffgemma import trainer  # after flag parsing, so bad flags fail fast

  try:
    trainer.validate_config(_CONFIG.value)
  except (KeyError, TypeError, ValueError) as e:
    raise cli.UserError(f"bad config: {e}") from e
  trainer.train(_CONFIG.value, _WORKDIR.value, init_from=_INIT_FROM.value)


if __name__ == "__main__":
  cli.run(main)
