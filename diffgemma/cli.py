"""Shared command-line plumbing: `--config=NAME` resolution and one-line user errors.

Library chatter is kept off the terminal: orbax logs every failed background write (with its
traceback) before the error reaches us, and its asyncio threads print "Event loop is closed"
while a failed process exits. `run` drops those (set DIFFGEMMA_LIBRARY_LOGS=1 to see them), so
a failure is the one `error:` line.
"""

from __future__ import annotations

import logging
import os
import re
import sys

from absl import flags

from diffgemma import errors  # a leaf module: no imports of its own

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
          known = sorted(f[:-3] for f in os.listdir(CONFIG_DIR)
                         if f.endswith(".py") and not f.startswith("_"))
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


def fail(message: str, code: int = 2, on_every_process: bool = False):
  """Print the one line and exit with `code`. `on_every_process`: in a multi-process run, every
  process raises this error at the same point (errors.on_every_process)."""
  errors.print_error(message)
  from diffgemma.runs import distributed  # local: a leaf for flag parsing

  if distributed.is_multi_process():
    distributed.exit_now(code, on_every_process)  # the others learn it; no shutdown barrier
  sys.exit(code)


# A `--config.KEY` override's key: dotted names, each maybe indexed (`layers[0]`).
_OVERRIDE_KEY = re.compile(r"[A-Za-z_]\w*(\[\d+\])*(\.[A-Za-z_]\w*(\[\d+\])*)*")


def _malformed_override(argv: list[str]) -> str | None:
  """The line for the first `--config.KEY=VALUE` argument whose KEY is no dotted name (which
  ml_collections reports as a Python SyntaxError naming no argument), else None."""
  for arg in argv:
    if arg.startswith("--config."):
      key = arg[len("--config."):].partition("=")[0]
      if not _OVERRIDE_KEY.fullmatch(key):
        return f"{arg!r}: write --config.KEY=VALUE, KEY a dotted name such as optimizer.lr"
  return None


def _flag_error_message(e: Exception, argv: list[str]) -> str:
  """One line for an error absl or ml_collections raised while parsing `argv`."""
  if isinstance(e, flags.Error):
    return errors.one_line(e)
  lookup = re.search(r"Attempting to lookup: (\S+)", str(e.args[0]) if e.args else "")
  if isinstance(e, KeyError) and lookup:  # a key below a value (batch_size.x)
    key = lookup.group(1)
    return (f"unknown config key {key!r}: {key.rpartition('.')[0]} is a value, not a section; "
            "see the config file for the keys")
  if isinstance(e, (KeyError, AttributeError)):
    # ml_collections reports an unknown override key as AttributeError(KeyError("'key'...")),
    # sometimes followed by a "Did you mean" hint.
    text = str(e.args[0]) if e.args else ""
    words = re.findall(r"\w+", text)
    key = words[0] if words else text
    overrides = [a.split("=")[0][len("--config."):] for a in argv if a.startswith("--config.")]
    culprit = next((o for o in overrides if o.split(".")[-1] == key),  # the key, else a section
                   next((o for o in overrides if key in o.split(".")), key))
    hint = re.search(r'Did you mean "(\w+)"', text)
    return (f"unknown config key {culprit!r}" +
            (f" (did you mean {hint.group(1)!r}?)" if hint
             else "; see the config file for the keys"))
  return errors.one_line(e)


# {section: {key: raw value}} of the `--SECTION.KEY=VALUE` arguments `run` took out of argv.
_SECTION_OVERRIDES: dict[str, dict[str, str]] = {}


def split_section_overrides(argv: list[str], section: str) -> tuple[list[str], dict[str, str]]:
  """(argv without its `--SECTION.KEY=VALUE` arguments, {KEY: VALUE} of them)."""
  prefix, rest, found = f"--{section}.", [], {}
  for arg in argv:
    if arg.startswith(prefix):
      key, eq, value = arg[len(prefix):].partition("=")
      if not eq or not key:
        fail(f"{arg!r}: write {prefix}KEY=VALUE")
      found[key] = value
    else:
      rest.append(arg)
  return rest, found


def section_overrides(section: str) -> dict[str, str]:
  """The `--SECTION.KEY=VALUE` arguments of this command (raw strings; the section types them)."""
  return dict(_SECTION_OVERRIDES.get(section, {}))


def parse_flags_or_fail(argv: list[str], sections: tuple[str, ...] = ()) -> list[str]:
  """Parse absl flags, turning any flag/config-override problem into a one-line error.
  `sections`: `--SECTION.KEY=VALUE` arguments kept for `section_overrides`, not absl."""
  for section in sections:
    argv, _SECTION_OVERRIDES[section] = split_section_overrides(argv, section)
  malformed = _malformed_override(argv)
  if malformed:
    fail(malformed)
  try:
    return flags.FLAGS(resolve_config_argv(argv))
  except (flags.Error, KeyError, AttributeError, ValueError, TypeError) as e:
    fail(_flag_error_message(e, argv))


def parse_config(config_path: str, overrides: list[str]):
  """The ConfigDict that `--config=config_path` plus `overrides` (["--config.KEY=VALUE", ...])
  give train.py, parsed by the same ml_collections flag machinery (values typed by the
  config's fields); any problem is a UserError with the one line train.py would print."""
  from ml_collections import config_flags

  argv = ["parse_config", f"--config={config_path}", *overrides]
  malformed = _malformed_override(argv)
  if malformed:
    raise UserError(malformed)
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file("config", None, "", flag_values=values,
                                           sys_argv=argv)
  try:
    values(argv)
  except (flags.Error, KeyError, AttributeError, ValueError, TypeError) as e:
    raise UserError(_flag_error_message(e, argv)) from None
  return holder.value


def _in_checkpoint_library(tb) -> bool:
  """Whether a traceback passes through orbax or tensorstore."""
  while tb is not None:
    name = tb.tb_frame.f_code.co_filename
    if f"{os.sep}orbax{os.sep}" in name or f"{os.sep}tensorstore{os.sep}" in name:
      return True
    tb = tb.tb_next
  return False


class _LibraryLogFilter(logging.Filter):
  """Drops log records (below CRITICAL) of the checkpoint library, and asyncio's: only orbax
  runs event loops here, and asyncio reports each of its failed reads and writes again ("Task
  exception was never retrieved") when the task is collected."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.levelno >= logging.CRITICAL:
      return True
    if f"{os.sep}orbax{os.sep}" in record.pathname or record.name == "asyncio":
      return False
    return not (record.exc_info and _in_checkpoint_library(record.exc_info[2]))


def _from_checkpoint_library(unraisable) -> bool:
  """An exception nobody could catch, raised by the checkpoint library's background I/O: a
  tensorstore callback into an event loop orbax already closed after a failed write."""
  e = unraisable.exc_value
  if isinstance(e, RuntimeError) and "Event loop is closed" in str(e):
    return True
  return _in_checkpoint_library(unraisable.exc_traceback)


def quiet_library_logs() -> None:
  """Drop the checkpoint library's log records and uncatchable background exceptions (a
  failed write is reported by the one error line it leads to)."""
  if os.environ.get("DIFFGEMMA_LIBRARY_LOGS"):
    return
  log_filter = _LibraryLogFilter()
  for logger in (logging.getLogger(), logging.getLogger("absl"), logging.getLogger("asyncio")):
    logger.addFilter(log_filter)
    for handler in logger.handlers:
      handler.addFilter(log_filter)
  if logging.lastResort is not None:  # prints records when no handler is configured
    logging.lastResort.addFilter(log_filter)
  default_hook = sys.unraisablehook
  sys.unraisablehook = lambda u: None if _from_checkpoint_library(u) else default_hook(u)


def _quiet_exit() -> None:
  """Past the error line, exceptions that background threads raise while the interpreter
  shuts down (orbax's event loops after a failed write) are not the user's business."""
  if not os.environ.get("DIFFGEMMA_LIBRARY_LOGS"):
    sys.unraisablehook = lambda unraisable: None


def user_error_types() -> tuple[type[BaseException], ...]:
  """The exceptions `run` reports as one `error:` line with exit status 2: bad input, a bad
  config, an unusable checkpoint, tokenizer or workdir."""
  # local: keep flag parsing light
  from diffgemma.io import hf_weights, safetensors_dir, tokenizer
  from diffgemma.model.kernels import platform
  from diffgemma.runs import checkpointing, resume_config, guard, workdir_lock

  return (UserError, errors.InputError, errors.ConfigError,
          checkpointing.CheckpointError, hf_weights.WeightMappingError,
          safetensors_dir.CheckpointFormatError, tokenizer.TokenizerError,
          workdir_lock.WorkdirLockError, resume_config.ResumeConfigError,
          guard.RunFailure, platform.KernelPlatformError)


def run(main, argv=None, sections: tuple[str, ...] = ()):
  """Parse flags, run `main(argv)`, and print user errors as one line (exit code 2; a run that
  stopped on purpose, e.g. on a non-finite loss: 3). `sections`: config sections the command
  takes as `--SECTION.KEY=VALUE` (e.g. eval.py's "sampler"; see `section_overrides`)."""
  from diffgemma.runs import distributed  # local: keep flag parsing light

  argv = parse_flags_or_fail(list(sys.argv if argv is None else argv), sections)
  quiet_library_logs()
  user_errors = user_error_types()
  try:
    try:
      main(argv)
    except Exception as e:
      if distributed.is_multi_process() and not isinstance(e, (*user_errors, errors.RunStopped)):
        distributed.wait_for_lost()  # a peer gone mid-collective: the watchdog names it
      raise
  except user_errors as e:
    _quiet_exit()
    fail(errors.one_line(e), on_every_process=errors.raised_on_every_process(e))
  except errors.RunStopped as e:
    fail(errors.one_line(e), code=3)
  except KeyboardInterrupt:
    _quiet_exit()
    fail("interrupted", code=130)
  except BaseException:
    if not distributed.is_multi_process():
      raise
    import traceback

    traceback.print_exc()
    distributed.exit_now(1)
