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

A scheduler kills a machine some seconds after its SIGTERM (SLURM's KillWait, Kubernetes'
terminationGracePeriodSeconds). `grace_s` bounds the stop to that: if the process is still
running `grace_s` seconds after the first signal (a step or a save too slow for it), a watcher
thread calls `on_expired` (one line naming the last complete checkpoint) and ends the process
with `GRACE_EXPIRED_EXIT_CODE`, before the scheduler's SIGKILL would end it without a word.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Callable

from diffgemma import errors

SIGNALS = (signal.SIGTERM, signal.SIGINT)
DEFAULT_GRACE_S = 30.0
# Exit status when the grace period ran out before the stop's checkpoint (cli: 2 user error,
# 3 a run stopped on purpose, 130 interrupted; distributed: 4 another process was lost).
GRACE_EXPIRED_EXIT_CODE = 5
_POLL_S = 0.1


class Preemption:
  """The stop flag the signal handler sets. `signal_name`: the first signal received."""

  def __init__(self):
    self.signal_name: str | None = None
    self.previous: dict = {}  # {signal: the handler before ours}
    self.closed = threading.Event()  # the block has ended: the watcher stands down

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


def _watch(stop: Preemption, grace_s: float, on_expired: Callable[[], str]) -> None:
  """The watcher thread: once a signal has set the flag, wait `grace_s`, then end the process
  with one line unless the block has ended first."""
  while not stop.requested:
    if stop.closed.wait(_POLL_S):
      return
  if stop.closed.wait(grace_s):
    return
  errors.print_error(on_expired())
  os._exit(GRACE_EXPIRED_EXIT_CODE)  # the main thread may sit in a step or a collective


@contextlib.contextmanager
def on_signals(signals=SIGNALS, grace_s: float | None = None,
               on_expired: Callable[[], str] | None = None):
  """A `Preemption` whose flag SIGTERM and SIGINT set while the block runs (the previous
  handlers are restored after it). Outside the main thread (where Python cannot install
  handlers) the flag is never set. With `grace_s` > 0 and `on_expired` (a message, e.g. naming
  the last complete checkpoint), the process ends `grace_s` seconds after the first signal if
  the block is still running then (module docstring)."""
  stop = Preemption()
  if threading.current_thread() is not threading.main_thread():
    yield stop
    return
  stop.previous = {s: signal.getsignal(s) for s in signals}
  for s in signals:
    signal.signal(s, stop.handle)
  if grace_s and grace_s > 0 and on_expired is not None:
    threading.Thread(target=_watch, args=(stop, grace_s, on_expired), daemon=True,
                     name="preemption-grace").start()
  try:
    yield stop
  finally:
    stop.closed.set()
    for s, handler in stop.previous.items():
      signal.signal(s, handler if handler is not None else signal.SIG_DFL)
