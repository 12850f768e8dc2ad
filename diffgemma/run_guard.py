"""Failures in the middle of a run end in one line that names the last complete checkpoint.

The training loop's calls that can fail for reasons outside the step itself (the data
pipeline; checkpoint writes are checkpointing.py's) go through here, so the user reads what
failed, at which step, and from where a rerun resumes, instead of a traceback from a worker.
"""

from __future__ import annotations

from typing import Iterator

from diffgemma import checkpointing


class RunFailure(RuntimeError):
  """The run stopped on an error outside the training step. One-line message."""

  def __str__(self):
    return str(self.args[0])


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
    raise RunFailure(f"the data pipeline ended before step {step}; "
                     f"{resume_hint(workdir)}") from None
  except Exception as e:  # noqa: BLE001 -- any worker failure
    lines = str(e).strip().splitlines()
    raise RunFailure(f"the data pipeline failed preparing step {step}: {type(e).__name__}"
                     + (f": {lines[0]}" if lines else "") + f"; {resume_hint(workdir)}") from None
