"""Error types shared by the command-line tools and the modules below them.

Every error a user can fix is a `UserError` of one of three kinds (`InputError`, `ConfigError`,
`RunError`); a module's own error class subclasses its kind, so `cli.run` catches `UserError`
alone and prints its one-line message (exit status 2). `RunStopped` is a run that stopped on
purpose (exit status 3).

Also the one rule for a file (or a folder of files) a command writes (`check_output_file`,
`prepare_output_file`): its missing folders are made, as `train.py --workdir` makes its run
directory; an existing directory where a file goes, or a file in the way of a folder, is refused
in one line.
"""

from __future__ import annotations

import os


class UserError(Exception):
  """A problem the user can fix: printed as one line, no traceback. One-line message."""


class InputError(UserError, ValueError):
  """Malformed or missing user input (a data file, a puzzle, a prompt, a checkpoint or its
  tokenizer).

  Task modules raise subclasses of it, so the command-line layer reports them without knowing
  any task.
  """


class ConfigError(UserError, ValueError):
  """A config value or flag that cannot work (checked before anything is written)."""


class RunError(UserError, RuntimeError):
  """A run that cannot go on for a reason outside its input and config: its workdir is held by
  another trainer, its data pipeline failed mid-run."""


class RunStopped(RuntimeError):
  """A run that ended early on purpose (e.g. a non-finite loss): nothing bad was saved; the
  message (one line) says why and where the last good checkpoint is."""


def on_every_process(e: BaseException) -> BaseException:
  """`e`, marked as an error every process of a multi-process run raises at the same point (an
  outcome they agreed on, e.g. a busy workdir): a process that sees a peer end with it goes on
  to raise it too, instead of reporting the peer lost."""
  e.raised_on_every_process = True
  return e


def raised_on_every_process(e: BaseException) -> bool:
  return getattr(e, "raised_on_every_process", False)


def leave_threads(e: BaseException) -> BaseException:
  """`e`, marked as an error after which the process ends without joining its other threads: a
  library's thread is stuck (a checkpoint write that hung), and the interpreter's exit would
  wait for it forever."""
  e.leave_threads = True
  return e


def threads_left(e: BaseException) -> bool:
  return getattr(e, "leave_threads", False)


def one_line(e: BaseException) -> str:
  """The one line a user sees for `e`: its message's first line (a KeyError's key without the
  quotes repr adds), or the exception's type when it has no message."""
  text = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip().strip('"')
  lines = text.splitlines()
  return lines[0] if lines else type(e).__name__


def print_error(message: str) -> None:
  """Print 'error: MESSAGE' on stderr, on a line of its own: a progress bar still drawn there
  ends with a carriage return, not a newline, and would otherwise swallow the line."""
  import sys

  tqdm_module = sys.modules.get("tqdm")
  bars_open = tqdm_module is not None and len(getattr(tqdm_module.tqdm, "_instances", ())) > 0
  sys.stderr.write(("\n" if bars_open else "") + f"error: {message}\n")
  sys.stderr.flush()


# ----------------------------------------------------------------------------- output files


def check_output_file(path: str, flag: str, directory: bool = False) -> None:
  """InputError (one line) when the file `path` that `--flag` names cannot be written where it
  is: an existing directory, or a file in the way of its folder (`directory`: `path` is the
  folder the command writes its files in). Writes nothing (a command checks its outputs before
  its work; `prepare_output_file` makes the folders when it writes)."""
  if not directory and os.path.isdir(path):
    raise InputError(f"--{flag}={path!r} is a directory; name a file in it")
  ancestor = os.path.abspath(path) if directory else os.path.dirname(os.path.abspath(path))
  while not os.path.exists(ancestor):  # the nearest existing folder above the file
    ancestor = os.path.dirname(ancestor)
  if not os.path.isdir(ancestor):
    raise InputError(f"--{flag}={path!r}: {ancestor} is a file, not a directory")


def prepare_output_file(path: str, flag: str, directory: bool = False) -> str:
  """`path` (named by `--flag`), its missing folders made (`directory`: `path` itself too);
  InputError (one line) when `check_output_file` refuses it or a folder cannot be made
  (permissions, a full disk)."""
  check_output_file(path, flag, directory)
  folder = os.path.abspath(path) if directory else os.path.dirname(os.path.abspath(path))
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise InputError(f"--{flag}={path!r}: cannot make directory {folder}: "
                     f"{e.strerror or e}") from None
  return path
