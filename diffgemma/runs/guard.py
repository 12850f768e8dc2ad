"""Failures in the middle of a run end in one line that names the last complete checkpoint.

The training loop's calls that can fail for reasons outside the step itself (the data
pipeline; checkpoint writes are checkpointing.py's) go through here, so the user reads what
failed, at which step, and from where a rerun resumes, instead of a traceback from a worker.
"""

from __future__ import annotations

from typing import Iterator

from diffgemma import errors
from diffgemma.runs import checkpointing


class RunFailure(errors.RunError):
  """The run stopped on an error outside the training step. One-line message.

  With a workdir, the message ends with where a rerun resumes, worked out when the message is
  read: by then the loop has closed its checkpoint manager, so saves that were still being
  written when the error struck count as complete."""

  def __init__(self, message: str, workdir: str | None = None):
    super().__init__(message, workdir)

  def __str__(self):
    message, workdir = self.args
    return message if workdir is None else f"{message}; {resume_hint(workdir)}"


def resume_hint(workdir: str) -> str:
  last = checkpointing.latest_step(workdir)
  if last is None:
    return "no checkpoint was written yet"
  return f"the last complete checkpoint is step {last}; rerun the same command to resume there"


def next_batch(batches: Iterator, step: int, workdir: str):
  """The batch of training step `step` (1-based), or RunFailure if the pipeline fails or ends.

  A worker's exception (a generator that cannot make a puzzle, a dead loader) surfaces here."""
  try:
    return next(batches)
  except StopIteration:
    raise RunFailure(f"the data pipeline ended before step {step}", workdir) from None
  except Exception as e:  # noqa: BLE001 -- any worker failure
    lines = str(e).strip().splitlines()
    raise RunFailure(f"the data pipeline failed preparing step {step}: {type(e).__name__}"
                     + (f": {lines[0]}" if lines else ""), workdir) from None
