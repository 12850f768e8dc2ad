"""Shared command-line plumbing: `--config=NAME` resolution and one-line user errors."""

from __future__ import annotations

import os
import re
import sys

from absl import flags

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


class UserError(Exception):
  """A problem with the user's input; printed as one line without a traceback."""


def resolve_config_argv(argv: list[str]) -> list[str]:
  """Let `--config=NAME` stand for configs/NAME.py (a path still works as a path)."""
  out = []
  for arg in argv:
    if arg.startswith("--config="):
      value = arg[len("--config="):]
      name, _, rest = value.partition(":")
      if not name.endswith(".py") and not os.path.sep in name:
        candidate = os.path.join(CONFIG_DIR, name + ".py")
        if not os.path.exists(candidate):
          known = sorted(f[:-3] for f in os.listdir(CONFIG_DIR) if f.endswith(".py"))
          fail(f"unknown config {name!r}; available: {', '.join(known)}")
        value = candidate + (":" + rest if rest else "")
      elif not os.path.exists(name):
        fail(f"config file {name!r} not found")
      arg = "--config=" + value
    out.append(arg)
  return out


def load_named_config(name: str):
  """configs/NAME.py's get_config(), for tools whose --config is optional."""
  import importlib.util

  spec = importlib.util.spec_from_file_location(name, os.path.join(CONFIG_DIR, name + ".py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def fail(message: str, code: int = 2):
  print(f"error: {message}", file=sys.stderr)
  sys.exit(code)


def parse_flags_or_fail(argv: list[str]) -> list[str]:
  """Parse absl flags, turning any flag/config-override problem into a one-line error."""
  try:
    return flags.FLAGS(resolve_config_argv(argv))
  except flags.Error as e:
    fail(str(e).splitlines()[0])
  except (KeyError, AttributeError) as e:
    # ml_collections reports an unknown override key as AttributeError(KeyError("'key'...")),
    # sometimes followed by a "Did you mean" hint.
    text = str(e.args[0]) if e.args else ""
    words = re.findall(r"\w+", text)
    key = words[0] if words else text
    overrides = [a.split("=")[0][len("--config."):] for a in argv if a.startswith("--config.")]
    culprit = next((o for o in overrides if o.split(".")[-1] == key), key)
    hint = re.search(r'Did you mean "(\w+)"', text)
    fail(f"unknown config key {culprit!r}" +
         (f" (did you mean {hint.group(1)!r}?)" if hint else "; see the config file for the keys"))
  except (KeyError, AttributeError, ValueError, TypeError) as e:
    fail(_one_line(e))


def _one_line(e: BaseException) -> str:
  text = str(e).strip().strip('"').splitlines()
  return (text[0] if text else type(e).__name__)


def run(main, argv=None):
  """Parse flags, run `main(argv)`, and print user errors as one line (exit code 2)."""
  # local: keep flag parsing light
  from diffgemma import checkpointing, hf_weights, safetensors_io, sudoku, tokenizer
  from diffgemma.kernels import platform

  argv = parse_flags_or_fail(list(sys.argv if argv is None else argv))
  user_errors = (UserError, sudoku.SudokuDataError, checkpointing.CheckpointError,
                 hf_weights.WeightMappingError, safetensors_io.CheckpointFormatError,
                 tokenizer.TokenizerError, platform.KernelPlatformError)
  try:
    main(argv)
  except user_errors as e:
    fail(_one_line(e))
  except KeyboardInterrupt:
    fail("interrupted", code=130)
