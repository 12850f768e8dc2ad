"""The one command-line path of every command: `--config=NAME` resolution, `--help`, the
overrides (`--config.KEY=VALUE`, `--SECTION.KEY=VALUE`, `KEY=V1,V2,...` value lists) and one-line
user errors.

Library chatter is kept off the terminal: orbax logs every failed background write (with its
traceback) before the error reaches us, and its asyncio threads print "Event loop is closed"
while a failed process exits. `run` drops those (set DIFFGEMMA_LIBRARY_LOGS=1 to see them), so
a failure is the one `error:` line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
from typing import Any

from absl import flags

from diffgemma import errors  # a leaf module: no imports of its own
from diffgemma.errors import UserError  # what the commands raise: `cli.UserError`

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")

# absl's help flags; `run` answers them itself (absl's own exit with status 1).
HELP_FLAGS = ("-h", "-?", "--help", "-help", "--helpshort", "-helpshort")
HELPFULL_FLAGS = ("--helpfull", "-helpfull")


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
  return load_module(os.path.join(CONFIG_DIR, name + ".py")).get_config()


def load_module(path: str):
  """The Python file at `path` run as a module (by path: a repository file the installed
  package does not hold, e.g. a test helper a benchmark reuses)."""
  import importlib.util

  name = os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module  # where its dataclasses look up their annotations
  spec.loader.exec_module(module)
  return module


def fail(message: str, code: int = 2, on_every_process: bool = False,
         leave_threads: bool = False):
  """Print the one line and exit with `code`. `on_every_process`: in a multi-process run, every
  process raises this error at the same point (errors.on_every_process). `leave_threads`: end
  the process without joining its other threads (errors.leave_threads)."""
  errors.print_error(message)
  from diffgemma.runs import distributed  # local: a leaf for flag parsing

  if distributed.is_multi_process():
    distributed.exit_now(code, on_every_process)  # the others learn it; no shutdown barrier
  if leave_threads:
    sys.stdout.flush()
    os._exit(code)
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


def section_overrides(section: str, cls) -> dict[str, Any]:
  """The `--SECTION.KEY=VALUE` arguments of this command, typed by the dataclass `cls` of the
  section (`typed_overrides`)."""
  return typed_overrides(_SECTION_OVERRIDES.get(section, {}), cls, section)


def help_requested(argv: list[str]) -> str | None:
  """"full" (--helpfull), "short" (--help, -h) or None, from the flags before a `--`."""
  ours = argv[1:argv.index("--")] if "--" in argv else argv[1:]
  if any(a in HELPFULL_FLAGS for a in ours):
    return "full"
  return "short" if any(a in HELP_FLAGS for a in ours) else None


def command_help(full: bool, values: flags.FlagValues = flags.FLAGS) -> str:
  """The command's docstring and its flags (in `values`) with their help text, absl's format:
  the flags of the script and of diffgemma; `full`: every flag, absl's and the libraries'."""
  main = sys.modules.get("__main__")
  text = ((main.__doc__ or "").strip() + "\n\n") if main is not None else ""
  if full:
    return text + values.get_help()
  modules = values.flags_by_module_dict()
  own = [m for m in modules if m == sys.argv[0]] + sorted(
      m for m in modules if m.startswith("diffgemma."))
  shown = "\n\n".join(values.module_help(m) for m in own)
  return text + (shown or "(no flags)") + "\n\nTry --helpfull to get a list of all flags."


def config_listing(config) -> str:
  """A ConfigDict as sorted `KEY = VALUE` lines, the keys as `--config.KEY=VALUE` names them."""
  from diffgemma.runs import resume_config

  flat = resume_config.flatten(config.to_dict())
  return "\n".join(f"  {key} = {flat[key]!r}" for key in sorted(flat))


def print_help_and_exit(argv: list[str], full: bool, sections: tuple[str, ...] = ()) -> None:
  """Print `command_help`; with a `--config=...` that the command takes as a ConfigDict, also
  the resolved config (its overrides applied). Exit status 0."""
  print(command_help(full))
  given = any(a.startswith("--config=") for a in argv)
  if given and "config" in flags.FLAGS:
    rest = [a for a in argv if a not in HELP_FLAGS + HELPFULL_FLAGS]
    parse_flags_or_fail(rest, sections)
    config = flags.FLAGS["config"].value
    if hasattr(config, "to_dict"):
      spec = next(a for a in argv if a.startswith("--config=")).split("=", 1)[1]
      print(f"\nconfig {spec} (any key: --config.KEY=VALUE):\n{config_listing(config)}")
  sys.exit(0)


# ----------------------------------------------------------------------------- overrides

LIST_FLAGS = ("grid", "scan")  # the flags that take KEY=V1,V2,... (scripts/sweep.py, eval.py)


def parse_assignment(text: str, flag: str, section: str = "config") -> tuple[str, str]:
  """"KEY=VALUE" of a `--FLAG KEY=VALUE` argument -> (KEY, VALUE), a leading "SECTION." taken
  off KEY; UserError when it is not of that form."""
  key, sep, value = text.partition("=")
  key = key.strip().removeprefix(section + ".")
  if not sep or not key or not value:
    raise UserError(f"--{flag} {text!r}: expected KEY=VALUE"
                    + ("S (comma-separated)" if flag in LIST_FLAGS else ""))
  return key, value


def parse_value_lists(specs: list[str], flag: str, section: str = "config"
                      ) -> list[tuple[str, list[str]]]:
  """["KEY=V1,V2", ...] of a repeatable `--FLAG` -> [(KEY, [V1, V2]), ...] in the given order
  (values still strings); UserError for a malformed spec, an empty or repeated value, or a key
  given twice."""
  lists = []
  for spec in specs:
    key, values = parse_assignment(spec, flag, section)
    values = [v.strip() for v in values.split(",")]
    if any(not v for v in values):
      raise UserError(f"--{flag} {spec!r}: empty value in the list")
    if len(set(values)) != len(values):
      raise UserError(f"--{flag} {spec!r}: a value appears twice")
    if key in (k for k, _ in lists):
      raise UserError(f"--{flag}: key {key!r} is given twice; list all its values in one "
                      f"--{flag}")
    lists.append((key, values))
  return lists


def typed_overrides(raw: dict[str, str], cls, section: str) -> dict[str, Any]:
  """{field: value} of command-line strings (`--SECTION.KEY=VALUE`) for the dataclass `cls`,
  each typed as its field's default; ConfigError (one line) for an unknown key or a bad value."""
  defaults = {f.name: f.default for f in dataclasses.fields(cls)}
  out = {}
  for key, text in raw.items():
    if key not in defaults:
      raise errors.ConfigError(f"unknown {section} key {key!r}; choose one of "
                               f"{tuple(defaults)}")
    default = defaults[key]
    try:
      if isinstance(default, bool):
        if text.lower() not in ("true", "false", "1", "0"):
          raise ValueError
        out[key] = text.lower() in ("true", "1")
      elif isinstance(default, tuple):
        out[key] = tuple(int(t) for t in text.split(",") if t.strip())
      else:
        out[key] = type(default)(text)
    except ValueError:
      raise errors.ConfigError(
          f"--{section}.{key}={text!r} is not a {type(default).__name__}") from None
  return out


def parse_flags_or_fail(argv: list[str], sections: tuple[str, ...] = ()) -> list[str]:
  """Parse absl flags, turning any flag/config-override problem into a one-line error.
  `sections`: `--SECTION.KEY=VALUE` arguments kept for `section_overrides`, not absl."""
  help_wanted = help_requested(argv)
  if help_wanted:
    print_help_and_exit(argv, help_wanted == "full", sections)
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
  return _parsed_config(holder, values, argv)


def override_config(config, assignments: list[str]):
  """A copy of the ConfigDict `config` with ["KEY=VALUE", ...] applied as train.py applies
  `--config.KEY=VALUE`; UserError (one line) for an unknown key or a bad value."""
  from ml_collections import config_flags

  argv = ["override_config", *(f"--config.{a.strip()}" for a in assignments if a.strip())]
  values = flags.FlagValues()
  # ml_collections registers the --config.KEY flags it finds in sys_argv when the flag is
  # defined (without them every override is an unknown flag), so an unknown key fails here.
  try:
    holder = config_flags.DEFINE_config_dict("config", config.copy_and_resolve_references(),
                                             flag_values=values, sys_argv=argv)
  except _PARSE_ERRORS as e:
    raise UserError(_flag_error_message(e, argv)) from None
  return _parsed_config(holder, values, argv)


_PARSE_ERRORS = (flags.Error, KeyError, AttributeError, ValueError, TypeError)


def _parsed_config(holder, values: flags.FlagValues, argv: list[str]):
  try:
    values(argv)
  except _PARSE_ERRORS as e:
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
  """The exceptions `run` reports as one `error:` line with exit status 2: every module's error
  class derives from `errors.UserError` (bad input, a bad config, an unusable run)."""
  return (UserError,)


def run(main, argv=None, sections: tuple[str, ...] = ()):
  """Parse flags (answering --help and --helpfull), run `main(argv)`, and print user errors
  (`errors.UserError`) as one line (exit code 2; a run that stopped on purpose, e.g. on a
  non-finite loss: 3). `sections`: config sections the command takes as `--SECTION.KEY=VALUE`
  (e.g. eval.py's "sampler"; see `section_overrides`)."""
  from diffgemma.runs import distributed  # local: keep flag parsing light

  argv = parse_flags_or_fail(list(sys.argv if argv is None else argv), sections)
  quiet_library_logs()
  try:
    try:
      main(argv)
    except Exception as e:
      if distributed.is_multi_process() and not isinstance(e, (UserError, errors.RunStopped)):
        distributed.wait_for_lost()  # a peer gone mid-collective: the watchdog names it
      raise
  except UserError as e:
    _quiet_exit()
    fail(errors.one_line(e), on_every_process=errors.raised_on_every_process(e),
         leave_threads=errors.threads_left(e))
  except errors.RunStopped as e:
    fail(errors.one_line(e), code=3, leave_threads=errors.threads_left(e))
  except MemoryError as e:  # numpy's message names the array's size and shape
    _quiet_exit()
    fail(f"out of host memory ({errors.one_line(e)}): lower batch_size, the model's size or "
         "the data layout")
  except KeyboardInterrupt as e:
    _quiet_exit()
    fail("interrupted", code=130, leave_threads=errors.threads_left(e))
  except BaseException:
    if not distributed.is_multi_process():
      raise
    import traceback

    traceback.print_exc()
    distributed.exit_now(1)
