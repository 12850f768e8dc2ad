"""A training schedule fitted to the wall-clock budget: `num_train_steps=0` with `max_train_minutes`.

A step count written into a recipe fits one machine: the Sudoku default's 4000 steps ended after
21 of its 30 minutes on a fast 2-core AMD EPYC and were cut at 3480 steps, mid-decay, on a slow
Intel Xeon. With `num_train_steps=0` the loop measures instead (`training.loop`):

1. the first steps after the compile, all inside the learning-rate warmup, which does not depend
   on the step count: they are the fitted run's own first steps, and nothing is thrown away;
2. the periodic evaluation once, with its compile time taken out (`CompileClock`), and one
   checkpoint write;

then `fit_num_steps` picks the largest count whose steps, evaluations, checkpoints and the update
step's recompile (the schedule is a compile-time constant) end inside the time left, less a
`MARGIN`. The count is written into the run's config.json before any checkpoint exists, so a
resume (kill -9 included) reads it back and continues the same schedule bitwise. `run_info.json`
records the calibration (`Calibration.as_dict`).
"""

from __future__ import annotations

import dataclasses
import time

import jax

FIT = 0  # num_train_steps=0: fit the count to max_train_minutes
# Time left kept free: a CPU step drifts by a few percent over a run (periodic evals warm the
# caches differently, the data curriculum changes), and a schedule cut by the deadline loses its
# lowest-learning-rate steps, which matter most.
MARGIN = 0.03
# The calibration ends at the end of the warmup, or earlier once it has used this fraction of
# the budget (a slow machine, a long warmup), after at least MIN_TIMED_STEPS timed steps.
MAX_CALIBRATION_SHARE = 0.1
MIN_TIMED_STEPS = 2


@dataclasses.dataclass(frozen=True)
class Calibration:
  """What the fit measured and chose (seconds; steps)."""

  seconds_per_step: float
  compile_seconds: float  # the update step's compile, paid again after the fit
  eval_seconds: float  # one periodic evaluation, warm
  checkpoint_seconds: float
  calibration_steps: int  # steps done when the count was fixed
  seconds_left: float  # of the budget, at that moment
  num_train_steps: int

  def as_dict(self) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v)
            for k, v in dataclasses.asdict(self).items()}

  def describe(self, minutes: float) -> str:
    return (f"fitted num_train_steps={self.num_train_steps} to max_train_minutes={minutes:g}: "
            f"{1 / self.seconds_per_step:.2f} steps/s after {self.calibration_steps} steps, "
            f"{self.eval_seconds:.1f} s per eval, {self.checkpoint_seconds:.1f} s per checkpoint, "
            f"{self.compile_seconds:.1f} s to recompile")


def events_between(start: int, end: int, every: int) -> int:
  """How many of the loop's periodic events (every `every` steps, and always at the last step)
  fall in steps start+1 .. end; 0 for every <= 0 (the event is off)."""
  if end <= start or every <= 0:
    return 0
  return end // every - start // every + (1 if end % every else 0)


def seconds_needed(num_steps: int, start_step: int, seconds_per_step: float,
                   compile_seconds: float, eval_seconds: float, eval_every: int,
                   checkpoint_seconds: float, checkpoint_every: int) -> float:
  """Wall time from `start_step` to the end of a `num_steps` schedule: the steps, the periodic
  evals and checkpoints (with the final ones) and one recompile of the update step."""
  return ((num_steps - start_step) * seconds_per_step + compile_seconds
          + events_between(start_step, num_steps, eval_every) * eval_seconds
          + events_between(start_step, num_steps, checkpoint_every) * checkpoint_seconds)


def fit_num_steps(seconds_left: float, start_step: int, seconds_per_step: float,
                  compile_seconds: float = 0.0, eval_seconds: float = 0.0, eval_every: int = 0,
                  checkpoint_seconds: float = 0.0, checkpoint_every: int = 0,
                  margin: float = MARGIN) -> int:
  """The largest step count whose remaining work (`seconds_needed`) fits (1 - margin) of
  `seconds_left`; at least start_step + 1 (a schedule always has a next step)."""
  if seconds_per_step <= 0:
    raise ValueError(f"seconds_per_step must be positive, got {seconds_per_step}")
  available = (1.0 - margin) * seconds_left

  def fits(n):
    return seconds_needed(n, start_step, seconds_per_step, compile_seconds, eval_seconds,
                          eval_every, checkpoint_seconds, checkpoint_every) <= available

  lo = start_step + 1  # seconds_needed grows with n: bisect for the last n that fits
  hi = start_step + max(1, int(available / seconds_per_step) + 1)
  if not fits(lo):
    return lo
  while lo < hi:
    mid = (lo + hi + 1) // 2
    if fits(mid):
      lo = mid
    else:
      hi = mid - 1
  return lo


class CompileClock:
  """Seconds JAX spent tracing, lowering and compiling while it is open (a context manager), from
  `jax.monitoring`'s compile events: a cold call's time less this is its warm time."""

  _EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
             "/jax/core/compile/jaxpr_to_mlir_module_duration",
             "/jax/core/compile/backend_compile_duration")

  def __init__(self):
    self.seconds = 0.0
    self.wall_seconds = 0.0

  def _listen(self, event: str, duration: float, **kwargs) -> None:
    del kwargs
    if event in self._EVENTS:
      self.seconds += duration

  def __enter__(self):
    self._start = time.perf_counter()
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc):
    jax.monitoring.unregister_event_duration_listener(self._listen)
    self.wall_seconds = time.perf_counter() - self._start
    return False

  @property
  def warm_seconds(self) -> float:
    return max(0.0, self.wall_seconds - self.seconds)
