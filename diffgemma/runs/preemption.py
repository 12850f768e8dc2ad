"""Graceful preemption: SIGTERM (what SLURM, Kubernetes and Cloud TPU send before they take a
machine away) and Ctrl-C (SIGINT) stop a training run at the next step boundary, with a
checkpoint there, and exit 0; a rerun of the same command resumes.

  with preemption.on_signals() as stop:     # train.py, around everything it does
    loop.train(..., preemption=stop)        # the loop asks `stop.requested` at boundaries

The handler only sets a flag (a signal may arrive at any bytecode, e.g. inside a checkpoint
write); the loop finishes the step in flight and decides. In a multi-process run the processes
agree on the stop step (`distributed.agree_any`): a signal that reached only one process, or
each at a different step, stops every process at the same step, so the collective save cannot
deadlock. A second Ctrl-C interrupts at once (the usual "interrupted", exit 130).
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
  """The stop flag the signal handler sets. `signal_name`: the first signal received."""

  def __init__(self):
    self.signal_name: str | None = None
    self.previous: dict = {}  # {signal: the handler before ours}

  @property
  def requested(self) -> bool:
    return self.signal_name is not None

  def handle(self, signum, frame) -> None:
    """The signal handler: sets the flag, nothing else (no I/O). After a first SIGINT the
    previous handler is back, so a second Ctrl-C interrupts a stop that takes too long."""
    del frame
    if self.signal_name is None:
      self.signal_name = signal.Signals(signum).name
    if signum == signal.SIGINT:
      previous = self.previous.get(signal.SIGINT)
      signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


@contextlib.contextmanager
def on_signals(signals=SIGNALS):
  """A `Preemption` whose flag SIGTERM and SIGINT set while the block runs (the previous
  handlers are restored after it). Outside the main thread (where Python cannot install
  handlers) the flag is never set."""
  stop = Preemption()
  if threading.current_thread() is not threading.main_thread():
    yield stop
    return
  stop.previous = {s: signal.getsignal(s) for s in signals}
  for s in signals:
    signal.signal(s, stop.handle)
  try:
    yield stop
  finally:
    for s, handler in stop.previous.items():
      signal.signal(s, handler if handler is not None else signal.SIG_DFL)
