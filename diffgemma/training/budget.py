"""A training schedule fitted to the wall-clock budget: `num_train_steps=0` with `max_train_minutes`.

A step count written into a recipe fits one machine: the Sudoku default's 4000 steps ended after
21 of its 30 minutes on a fast 2-core AMD EPYC and were cut at 3480 steps, mid-decay, on a slow
Intel Xeon. With `num_train_steps=0` the loop measures instead (`training.loop`), and fits the
count at stated points:

1. the calibration, at the end of the learning-rate warmup (whose values do not depend on the
   step count, so its steps are the run's own): the timed steps after the compile, one periodic
   evaluation with its compile time taken out (`CompileClock`) and one checkpoint write;
   `fit_num_steps` picks the largest count whose steps, evaluations, checkpoints and the update
   step's recompile (the schedule is a compile-time constant) end inside the time left, less a
   margin (`margin_seconds`);
2. a re-fit every `refit_cadence` steps after it: at every periodic evaluation (at every
   checkpoint when evaluation is off), and at least every REFITS_PER_SCHEDULE-th of the count in
   effect (a schedule fitted short under load may end before its first evaluation: a 10-minute
   Sudoku run calibrated beside a busy process fitted 291 steps, evaluates every 500, and left
   4.1 of its 10 minutes unused); `refit` keeps the count while the time it would leave lies within a band around the
   margin (half the margin spent, up to a margin or a recompile more left over: a hysteresis
   against the pace's noise), else fits it again (shorter: "slower"; longer: "faster").

Each uses the fastest stable stretch of the step times since the previous fit (`fastest_window`:
the fastest run of consecutive timing windows covering a quarter of them, windows that held an
evaluation, a checkpoint or a compile left out), so a start slowed by another process on the
same core does not fix a short schedule, and a lasting slow-down shows at the next re-fit. A
change recompiles the update step (its cost is part of the fit) and continues the cosine decay
from the learning rate it has reached (`optimizer.learning_rate_schedule`), so the learning rate
does not jump.

Every decision, kept counts included, goes into the run's config.json (`fitted_schedule`: [step,
count] pairs, and `num_train_steps`, the latest count) before any checkpoint after it exists:
a resumed run (kill -9 included) replays the decisions recorded for its steps and so follows the
same schedule bitwise; later re-fits are taken fresh, and may only shorten the schedule (a
resumed invocation has a new max_train_minutes deadline, and the run's length must not depend on
when it was interrupted). `run_info.json` records the calibration (`Calibration.as_dict`) and
each re-fit (`Refit.as_dict`).
"""

from __future__ import annotations

import dataclasses
import time

import jax

FIT = 0  # num_train_steps=0: fit the count to max_train_minutes
# Time left kept free: a CPU step drifts by a few percent over a run (periodic evals warm the
# caches differently, the data curriculum changes), and a schedule cut by the deadline loses its
# lowest-learning-rate steps, which matter most. At most MAX_MARGIN_SECONDS: the re-fits catch a
# drift, and a run should leave at most two minutes unused (a margin, plus at most a margin's
# worth of time that a re-fit does not extend into).
MARGIN = 0.03
MAX_MARGIN_SECONDS = 60.0
# The fastest stretch of step times covers this fraction of the windows since the last fit: long
# enough that one lucky window does not set the pace, short enough that a slowed start (or an end
# slowed by load) is left out.
FASTEST_SHARE = 0.25
# A re-fit comes at least this many times per schedule (`refit_cadence`); a kept count costs
# nothing, a changed one a recompile.
REFITS_PER_SCHEDULE = 8
# ... but no more often than every this many steps: a re-fit reads the logged step times since
# the last one, and a few steps say little about the pace.
MIN_REFIT_STEPS = 20
# Why a fit chose its count (run_info.json's budget_refits, the progress line).
KEPT, FASTER, SLOWER = "kept", "faster", "slower"
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


def refit_cadence(num_steps: int, event_every: int, log_every: int) -> int:
  """Steps between re-fits under a count of `num_steps`: the periodic event's (`event_every`,
  the evaluation or the checkpoint; <= 0: none), or a REFITS_PER_SCHEDULE-th of the count (at
  least MIN_REFIT_STEPS) when that is shorter, rounded up to a multiple of `log_every` (the
  re-fit reads the logged step times)."""
  log_every = max(log_every, 1)
  share = max(MIN_REFIT_STEPS, num_steps // REFITS_PER_SCHEDULE)
  share = -(-share // log_every) * log_every
  return min(event_every, share) if event_every > 0 else share


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


def margin_seconds(seconds_left: float, margin: float = MARGIN) -> float:
  """The time kept free of `seconds_left`: `margin` of it, at most MAX_MARGIN_SECONDS."""
  return min(margin * seconds_left, MAX_MARGIN_SECONDS)


def fit_num_steps(seconds_left: float, start_step: int, seconds_per_step: float,
                  compile_seconds: float = 0.0, eval_seconds: float = 0.0, eval_every: int = 0,
                  checkpoint_seconds: float = 0.0, checkpoint_every: int = 0,
                  margin: float = MARGIN) -> int:
  """The largest step count whose remaining work (`seconds_needed`) fits `seconds_left` less
  `margin_seconds`; at least start_step + 1 (a schedule always has a next step)."""
  if seconds_per_step <= 0:
    raise ValueError(f"seconds_per_step must be positive, got {seconds_per_step}")
  available = seconds_left - margin_seconds(seconds_left, margin)

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


def fastest_window(windows, share: float = FASTEST_SHARE) -> float | None:
  """Seconds per step of the fastest run of consecutive timing windows, each (steps, seconds),
  that covers `share` of them (at least one window); None without windows. The windows are
  those since the last fit that held no evaluation, checkpoint or compile, in step order."""
  windows = [(int(n), float(t)) for n, t in windows if n > 0]
  if not windows:
    return None
  span = max(1, int(len(windows) * share))
  steps = [0]
  seconds = [0.0]
  for n, t in windows:  # prefix sums: every run of `span` windows in O(1)
    steps.append(steps[-1] + n)
    seconds.append(seconds[-1] + t)
  return min((seconds[i + span] - seconds[i]) / (steps[i + span] - steps[i])
             for i in range(len(windows) - span + 1))


def refit(num_steps: int, step: int, seconds_left: float, seconds_per_step: float,
          compile_seconds: float = 0.0, eval_seconds: float = 0.0, eval_every: int = 0,
          checkpoint_seconds: float = 0.0, checkpoint_every: int = 0,
          may_extend: bool = True, margin: float = MARGIN) -> tuple[int, str]:
  """(count, reason) at a re-fit after `step` of a `num_steps` schedule. With `unused` the time
  its remaining work (no recompile) would leave beyond the margin: the count is kept (KEPT)
  while -margin/2 <= unused <= max(margin, compile_seconds); else it is fitted again
  (`fit_num_steps`, a recompile included, which aims at unused = 0): SLOWER when it falls
  behind, FASTER when more would be left over (only with `may_extend`).

  The band is a hysteresis: the margin is there to absorb the pace's noise, so a count is
  shrunk only once half of it is spent, and extended only past what the change's recompile
  costs. Without it, a 30-minute Sudoku run on this project's 2-core EPYC re-fitted 6 times
  (3745 -> 3986 -> 3879 -> ... -> 3656 steps, a 15 s recompile each) on a +-4% pace."""
  timing = dict(eval_seconds=eval_seconds, eval_every=eval_every,
                checkpoint_seconds=checkpoint_seconds, checkpoint_every=checkpoint_every)
  keep_margin = margin_seconds(seconds_left, margin)
  unused = seconds_left - keep_margin - seconds_needed(num_steps, step, seconds_per_step, 0.0,
                                                       **timing)
  behind = unused < -keep_margin / 2
  ahead = may_extend and unused > max(keep_margin, compile_seconds)
  if not (behind or ahead):
    return num_steps, KEPT
  fitted = fit_num_steps(seconds_left, step, seconds_per_step, compile_seconds, margin=margin,
                         **timing)
  if behind and fitted < num_steps:
    return fitted, SLOWER
  if ahead and fitted > num_steps:
    return fitted, FASTER
  return num_steps, KEPT  # a recompile would cost more than the change gains


def schedule_lengths(fitted_schedule) -> tuple[tuple[int, int], ...]:
  """The learning-rate schedule's lengths from a run's fit decisions ([step, count] pairs, the
  calibration first): ((0, first count), (step, new count) at each change); kept counts drop."""
  lengths = []
  for step, count in fitted_schedule:
    if not lengths:
      lengths.append((0, int(count)))
    elif count != lengths[-1][1]:
      lengths.append((int(step), int(count)))
  return tuple(lengths)


@dataclasses.dataclass(frozen=True)
class Refit:
  """One re-fit after `step` (seconds; steps): what it measured, the count before and after."""

  step: int
  seconds_per_step: float | None  # the fastest window since the last fit; None: no clean one
  eval_seconds: float
  seconds_left: float
  before: int
  after: int
  reason: str  # KEPT, FASTER or SLOWER

  def as_dict(self) -> dict:
    return {k: (round(v, 4) if isinstance(v, float) else v)
            for k, v in dataclasses.asdict(self).items()}

  def describe(self) -> str:
    pace = (f"{1 / self.seconds_per_step:.2f} steps/s" if self.seconds_per_step
            else "no clean timing window")
    return (f"step {self.step}: re-fitted num_train_steps {self.before} -> {self.after} "
            f"({self.reason}: {pace}, {self.seconds_left / 60:.1f} min left)")


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
