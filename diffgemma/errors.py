"""Error types shared by the command-line tools and the modules below them."""

from __future__ import annotations


class InputError(ValueError):
  """Malformed user input (a data file, a puzzle, a prompt): printed as one line, no traceback.

  Task modules raise subclasses of it, so the command-line layer reports them without knowing
  any task.
  """


class ConfigError(ValueError):
  """A config value that cannot work (checked before anything is written). One-line message."""


class RunStopped(RuntimeError):
  """A run that ended early on purpose (e.g. a non-finite loss): nothing bad was saved; the
  message (one line) says why and where the last good checkpoint is."""
