"""The schedule fitted to the wall-clock budget (`num_train_steps=0`, `training.budget`): the fit,
the fastest timing window and the re-fit against brute force, the continued learning-rate
schedule, re-fits of a run slowed at its start or after its calibration, and a fitted run that
is stopped and resumed, or killed with -9 between two re-fits and rerun (slow tier), against an
uninterrupted fitted run (bitwise)."""

import json
import os
import time
import types

import jax
import numpy as np
import pytest

from diffgemma import errors
from diffgemma.runs import provenance
from diffgemma.tasks import make_task
from diffgemma.training import budget, loop
from tests.helpers import one_line_error, restore_run, run, tiny_sudoku_config


def brute_force_fit(seconds_left, start, sps, compile_s, eval_s, eval_every, ckpt_s, ckpt_every,
                    margin):
  """The largest n (start < n) whose steps, evals and checkpoints (each every k steps and at the
  last step) and one recompile take at most seconds_left less min(margin * seconds_left, 60 s),
  by walking n up."""
  best, periodic = start + 1, 0.0  # periodic: the cost of the events at multiples up to n
  for n in range(start + 1, start + 100_000):
    final = 0.0  # the last step's eval and checkpoint, unless they are periodic ones
    if eval_every > 0:
      periodic += eval_s if n % eval_every == 0 else 0.0
      final += eval_s if n % eval_every else 0.0
    periodic += ckpt_s if n % ckpt_every == 0 else 0.0
    final += ckpt_s if n % ckpt_every else 0.0
    cost = (n - start) * sps + compile_s + periodic + final
    if cost <= seconds_left - min(margin * seconds_left, 60.0):
      best = n
    elif (n - start) * sps > seconds_left:
      break
  return best


@pytest.mark.parametrize("seconds_left,start,sps,compile_s,eval_s,eval_every,ckpt_s,ckpt_every", [
    (1800.0, 50, 0.31, 12.0, 15.0, 500, 0.4, 250),  # the Sudoku default on a 2-core EPYC
    (600.0, 3, 0.2, 5.0, 30.0, 100, 2.0, 50),  # evals that cost 150 steps each
    (100.0, 10, 0.05, 0.0, 0.0, 0, 0.0, 7),  # no eval, odd checkpoint cadence
    (5.0, 20, 1.0, 10.0, 1.0, 5, 1.0, 5),  # the budget is already spent: one more step
    (7200.0, 50, 0.31, 12.0, 15.0, 500, 0.4, 250),  # two hours: the margin is capped at 60 s
])
def test_fit_num_steps_is_the_largest_count_that_fits(seconds_left, start, sps, compile_s, eval_s,
                                                      eval_every, ckpt_s, ckpt_every):
  fitted = budget.fit_num_steps(seconds_left, start, sps, compile_s, eval_s, eval_every, ckpt_s,
                                ckpt_every)
  assert fitted == brute_force_fit(seconds_left, start, sps, compile_s, eval_s, eval_every,
                                   ckpt_s, ckpt_every, budget.MARGIN)


def test_fastest_window_is_the_fastest_run_of_a_quarter_of_the_windows():
  rng = np.random.default_rng(0)
  for count in (1, 3, 4, 9, 40):
    steps = rng.integers(1, 30, count)
    seconds = steps * rng.uniform(0.1, 0.5, count)
    span = max(1, count // 4)
    brute = min(seconds[i:i + span].sum() / steps[i:i + span].sum()
                for i in range(count - span + 1))
    assert budget.fastest_window(list(zip(steps, seconds))) == pytest.approx(brute, rel=1e-12)
  assert budget.fastest_window([]) is None
  # A slow start (4 windows at 0.5 s per step) does not set the pace of the 12 after it.
  slowed = [(20, 10.0)] * 4 + [(20, 6.0)] * 12
  assert budget.fastest_window(slowed) == pytest.approx(0.3)


REFIT_TIMING = dict(compile_seconds=12.0, eval_seconds=15.0, eval_every=500,
                    checkpoint_seconds=0.4, checkpoint_every=250)


@pytest.mark.parametrize("num_steps,step,seconds_left,sps,may_extend,reason", [
    (4250, 500, 1500.0, 0.35, True, budget.KEPT),  # on pace: less than a margin left over
    (4310, 500, 1500.0, 0.35, True, budget.KEPT),  # behind, within half the margin: kept
    (4380, 500, 1500.0, 0.35, True, budget.SLOWER),  # more than half the margin spent
    (4000, 500, 1500.0, 0.41, True, budget.SLOWER),  # the count no longer fits
    (3000, 500, 1500.0, 0.35, True, budget.FASTER),  # more than a margin would be left unused
    (3000, 500, 1500.0, 0.35, False, budget.KEPT),  # a resumed invocation does not extend
    (3897, 3700, 100.0, 0.35, True, budget.KEPT),  # the recompile would eat the gain
    (502, 500, 1.0, 2.0, True, budget.SLOWER),  # far behind: the fit's floor, one more step
])
def test_refit_keeps_a_count_that_fits_else_fits_again(num_steps, step, seconds_left, sps,
                                                       may_extend, reason):
  """Against brute force: kept while the time the remaining work (no recompile) leaves beyond
  the margin lies in [-margin / 2, max(margin, the recompile)]; else the brute-force fit (a
  recompile included), SLOWER when it shrinks, FASTER when it grows."""
  t = REFIT_TIMING
  fitted = brute_force_fit(seconds_left, step, sps, t["compile_seconds"], t["eval_seconds"],
                           t["eval_every"], t["checkpoint_seconds"], t["checkpoint_every"],
                           budget.MARGIN)
  margin = min(budget.MARGIN * seconds_left, 60.0)
  unused = seconds_left - margin - brute_force_cost(num_steps, step, sps, t)
  assert (unused < -margin / 2) == (reason == budget.SLOWER)
  expected = num_steps if reason == budget.KEPT else fitted
  assert budget.refit(num_steps, step, seconds_left, sps, may_extend=may_extend, **t) == (
      expected, reason)
  if reason == budget.FASTER:
    assert unused > max(margin, t["compile_seconds"]) and fitted > num_steps


def brute_force_cost(n, start, sps, t):
  """The seconds from `start` to the end of an n-step schedule without a recompile, step by
  step."""
  cost = (n - start) * sps
  for s in range(start + 1, n + 1):
    cost += t["eval_seconds"] if (s % t["eval_every"] == 0 or s == n) else 0.0
    cost += t["checkpoint_seconds"] if (s % t["checkpoint_every"] == 0 or s == n) else 0.0
  return cost


def test_a_refitted_cosine_schedule_continues_from_the_learning_rate_it_reached():
  """The plain schedule up to the change; from it the decay goes on from the value reached (no
  jump) to end_lr_fraction * lr at the new length; a second change likewise."""
  from diffgemma.training import optimizer

  cfg = optimizer.OptimizerConfig(lr=1e-3, warmup_steps=10, end_lr_fraction=0.1)
  plain = optimizer.learning_rate_schedule(cfg, 100)
  refitted = optimizer.learning_rate_schedule(cfg, 160, lengths=((0, 100), (40, 160), (90, 120)))
  lr = np.array([float(refitted(c)) for c in range(0, 170)])
  np.testing.assert_array_equal(lr[:40], [float(plain(c)) for c in range(40)])
  steps = np.abs(np.diff(lr[10:]))
  assert steps.max() < 2.5e-5, steps.max()  # a plain cosine's largest step is ~1.9e-5 here
  assert np.all(np.diff(lr[10:]) <= 1e-12)  # still decaying
  assert lr[120] == pytest.approx(1e-4) and lr[169] == pytest.approx(1e-4)
  assert lr[119] > 1e-4
  # A change inside the warmup leaves the warmup alone: the decay starts at its end.
  early = optimizer.learning_rate_schedule(cfg, 60, lengths=((0, 10), (5, 60)))
  np.testing.assert_allclose([float(early(c)) for c in range(11)],
                             [float(plain(c)) for c in range(11)], rtol=1e-6)
  assert float(early(35)) == pytest.approx(float(optimizer.learning_rate_schedule(cfg, 60)(35)),
                                           rel=1e-5)


@pytest.mark.parametrize("num_steps,event_every,log_every", [
    (291, 500, 20), (3060, 500, 20), (2000, 250, 20), (40, 0, 1), (7, 12, 1), (1000, 100, 30)])
def test_refit_cadence_is_the_event_or_an_eighth_of_the_schedule(num_steps, event_every,
                                                                  log_every):
  """By brute force: the smallest multiple of log_every not below an eighth of the count nor
  below MIN_REFIT_STEPS, or the periodic event's interval when that is shorter."""
  floor = max(budget.MIN_REFIT_STEPS, num_steps // budget.REFITS_PER_SCHEDULE)
  share = next(m for m in range(log_every, 10 * num_steps + 100, log_every) if m >= floor)
  want = min(share, event_every) if event_every > 0 else share
  assert budget.refit_cadence(num_steps, event_every, log_every) == want
  if (num_steps, event_every) == (291, 500):  # the loaded 10-minute run: a re-fit every 40 steps
    assert want == 40


def test_events_between_counts_the_periodic_and_the_final_event():
  for start, end, every in [(0, 10, 3), (3, 9, 3), (50, 4000, 500), (7, 8, 100), (5, 5, 2)]:
    expected = sum(1 for s in range(start + 1, end + 1) if s % every == 0 or s == end)
    assert budget.events_between(start, end, every) == expected
  assert budget.events_between(0, 10, 0) == 0


def fitted_tiny_config(minutes: float, warmup_steps: int, eval_every: int):
  """The tiny Sudoku config fitted to `minutes` (num_train_steps=0), with a cheap periodic
  evaluation every `eval_every` steps."""
  config = tiny_sudoku_config(workdir_steps=0)
  config.max_train_minutes = minutes
  config.optimizer.warmup_steps = warmup_steps
  config.eval.update(dict(every_steps=eval_every, num_puzzles=2, batch_size=2))
  config.sampler.max_denoising_steps = 2
  return config


def test_a_fitted_run_stopped_and_resumed_equals_the_uninterrupted_fitted_run(tmp_path,
                                                                             monkeypatch):
  """num_train_steps=0: the first warmup steps are timed, the count (fixed here at 7 so that the
  test's cost does not depend on this machine's speed; the fit itself is tested above) goes into
  config.json before any checkpoint, and run_info.json records the calibration. Stopped at step 5
  and rerun with the same config, the run ends at 7 bitwise equal to the uninterrupted fitted run
  (today's resume check), and equal to a run given num_train_steps=7 from the start: bitwise with
  XLA's optimisations on (the timed steps are the run's own); within 1e-6 under this suite's
  unoptimised compiles, where the warmup steps' program (compiled for the provisional count)
  rounds differently in the last bit."""
  asked = []

  def fit(seconds_left, start_step, seconds_per_step, **kwargs):
    asked.append(dict(seconds_left=seconds_left, start_step=start_step,
                      seconds_per_step=seconds_per_step, **kwargs))
    return 7

  monkeypatch.setattr(budget, "fit_num_steps", fit)
  config = fitted_tiny_config(minutes=30.0, warmup_steps=3, eval_every=100)
  resumed = str(tmp_path / "resumed")
  loop.train(config, resumed, stop_at=5)
  saved = json.load(open(os.path.join(resumed, "config.json")))
  assert saved["num_train_steps"] == 7 and saved["fitted_schedule"] == [[3, 7]]
  (call,) = asked
  assert call["start_step"] == 3 and call["seconds_per_step"] > 0
  assert call["eval_every"] == 100 and call["eval_seconds"] > 0
  assert 0 < call["seconds_left"] <= 30 * 60
  loop.train(config, resumed)  # the same command: resumes at 5 under the saved count
  assert len(asked) == 1  # a resume does not fit again
  runs = provenance.load_run_info(resumed)["invocations"]
  assert [(r["start_step"], r["end_step"], r["stop_reason"]) for r in runs] == [
      (0, 5, provenance.STOP_AT), (5, 7, provenance.NUM_TRAIN_STEPS)]
  # What the run trained on, carried over the resume: a Sudoku row is one example, all valid.
  row_tokens = make_task(config).layout.seq_len
  for run, steps in zip(runs, (5, 7)):
    assert run["examples_seen"] == steps * config.batch_size
    assert run["real_tokens_seen"] == steps * config.batch_size * row_tokens
  assert 0 < runs[0]["train_seconds"] < runs[1]["train_seconds"]
  fit_record = runs[0]["budget_fit"]
  assert fit_record["num_train_steps"] == 7 and fit_record["calibration_steps"] == 3
  assert fit_record["seconds_per_step"] == round(call["seconds_per_step"], 4)  # as recorded

  straight = str(tmp_path / "straight")
  loop.train(config, straight)
  given = config.copy_and_resolve_references()
  given.num_train_steps = 7
  explicit = str(tmp_path / "explicit")
  loop.train(given, explicit)
  states = {}
  for name, path in (("resumed", resumed), ("straight", straight), ("explicit", explicit)):
    *_, states[name], _, step = restore_run(path)
    assert step == 7, (name, step)
  jax.tree_util.tree_map(np.testing.assert_array_equal, states["resumed"], states["straight"])
  jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, rtol=0, atol=1e-6),
                         states["resumed"], states["explicit"])


@pytest.mark.parametrize("slow_steps,reason", [
    (range(1, 9), budget.FASTER),  # another process shared the core until step 8
    # ... from the calibration on (slow tier: the same path, another outcome)
    pytest.param(range(5, 13), budget.SLOWER, marks=pytest.mark.slow),
])
def test_a_refit_at_the_first_evaluation_follows_the_pace_since_the_calibration(
    tmp_path, monkeypatch, slow_steps, reason):
  """Steps slowed by 1 s (a busy core) during the calibration (at the warmup's end, step 4,
  or earlier once it has used its share of the budget) fit a short schedule; the re-fit at the
  first evaluation (step 12) takes the fastest windows since, and lengthens it. Slowed after a
  fast calibration, the re-fit shortens it. Either is recorded in config.json
  (`fitted_schedule`, the new count) and run_info.json.

  The slow-down is a jump of the loop's clock, not a sleep: a tiny model's step takes
  milliseconds, and on a loaded machine their real jitter would decide the re-fit."""
  from diffgemma.training import update_step

  done, make, skew = [0], update_step.make_update_step, [0.0]
  clock = types.SimpleNamespace(perf_counter=lambda: time.perf_counter() + skew[0],
                                time=lambda: time.time() + skew[0], sleep=time.sleep,
                                monotonic=lambda: time.monotonic() + skew[0])

  def slowed(*args, **kwargs):
    step_fn = make(*args, **kwargs)

    def step(*step_args):
      out = step_fn(*step_args)
      done[0] += 1
      if done[0] in slow_steps:
        jax.block_until_ready(out)
        skew[0] += 1.0
      return out

    return step

  monkeypatch.setattr(update_step, "make_update_step", slowed)
  monkeypatch.setattr(loop, "time", clock)
  config = fitted_tiny_config(minutes=1.0, warmup_steps=4, eval_every=12)
  workdir = str(tmp_path / "run")
  loop.train(config, workdir, stop_at=13)
  (invocation,) = provenance.load_run_info(workdir)["invocations"]
  fitted = invocation["budget_fit"]["num_train_steps"]
  (refit,) = invocation["budget_refits"]
  assert (refit["step"], refit["before"], refit["reason"]) == (12, fitted, reason)
  assert (refit["after"] > fitted) == (reason == budget.FASTER)
  assert refit["after"] != fitted and refit["seconds_per_step"] > 0
  saved = json.load(open(os.path.join(workdir, "config.json")))
  calibrated_at = invocation["budget_fit"]["calibration_steps"]
  assert calibrated_at <= 4
  assert saved["fitted_schedule"] == [[calibrated_at, fitted], [12, refit["after"]]]
  assert saved["num_train_steps"] == refit["after"]


def test_fitting_needs_a_budget_and_a_warmup_to_time(tmp_path):
  config = tiny_sudoku_config(workdir_steps=0)
  config.max_train_minutes = 0.0
  with pytest.raises(errors.ConfigError, match="num_train_steps=0 fits the schedule"):
    loop.train(config, str(tmp_path / "a"))
  config.max_train_minutes = 5.0
  config.optimizer.warmup_steps = 1
  with pytest.raises(errors.ConfigError, match="optimizer.warmup_steps >= 3"):
    loop.train(config, str(tmp_path / "b"))
  assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


def test_the_load_benchmark_checks_its_flags_before_it_starts_anything(tmp_path):
  """benchmarks/fit_under_load.py: a load longer than the run, an unknown run name: one line
  each, nothing started (its --help: tests/test_cli.py)."""
  out = str(tmp_path / "out")
  for args, needle in ((["--minutes=10", "--load_minutes=20"], "--load_minutes"),
                       (["--runs=quiet,busy"], "--runs")):
    one_line_error(run("benchmarks/fit_under_load.py", f"--out={out}", *args), needle)
  assert not os.path.exists(out)


# `python -c _FIT_TO N REFITS HANG train.py ARGS`: train.py whose calibration fits N steps and
# whose re-fits decide REFITS ("step:count,..."; the count is kept at the other points): the
# decisions must not depend on this machine's speed (the fit and the re-fit are tested above; no
# hook in the product). HANG > 0: the process stops dead once the re-fit at that step is recorded.
_FIT_TO = """
import os, runpy, sys, time
from diffgemma.runs import provenance
from diffgemma.training import budget

count, table, hang = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
del sys.argv[1:4]
refits = dict(tuple(int(x) for x in pair.split(":")) for pair in table.split(",") if pair)
budget.fit_num_steps = lambda *args, **kwargs: count
budget.refit = lambda num_steps, step, *a, **k: (
    (refits[step], "faster" if refits[step] > num_steps else "slower") if step in refits
    else (num_steps, "kept"))
record = provenance.record_refit

def record_then_hang(workdir, refit):
  record(workdir, refit)
  if refit["step"] == hang:
    open(os.path.join(workdir, "hanging"), "w").close()
    time.sleep(600)

provenance.record_refit = record_then_hang
sys.argv.pop(0)
runpy.run_path(sys.argv[0], run_name="__main__")
"""
FITTED_STEPS = 20
REFITS = {6: 26, 10: 24, 14: 22}  # lengthened, shortened, shortened: the run ends at 22
FITTED_FLAGS = ["--config=tests/tiny_sudoku_config.py", "--config.num_train_steps=0",
                "--config.max_train_minutes=30", "--config.optimizer.warmup_steps=3",
                "--config.checkpoint_every=4", "--config.eval.every_steps=2",
                "--config.eval.num_puzzles=2", "--config.eval.batch_size=2",
                "--config.sampler.max_denoising_steps=2"]


@pytest.mark.slow
def test_a_fitted_run_killed_between_refits_then_rerun_equals_the_uninterrupted_run(tmp_path):
  """kill -9 of a fitted train.py after its re-fit at step 10 is recorded, with its latest
  checkpoint at step 8, then the same command: it resumes at 8 under the decisions recorded up
  to there, replays the one at 10, takes the later ones fresh (here the same as the
  uninterrupted run's), and ends bitwise equal to the uninterrupted fitted run."""
  import subprocess
  import sys

  from diffgemma.runs import checkpointing

  def command(workdir, count, refits, hang=0):
    table = ",".join(f"{k}:{v}" for k, v in refits.items())
    return [sys.executable, "-c", _FIT_TO, str(count), table, str(hang), "train.py",
            *FITTED_FLAGS, f"--workdir={workdir}"]

  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
  straight, killed = str(tmp_path / "straight"), str(tmp_path / "killed")
  done = subprocess.run(command(straight, FITTED_STEPS, REFITS), capture_output=True, text=True,
                        env=env, timeout=600)
  assert done.returncode == 0, done.stdout + done.stderr
  with open(tmp_path / "first.log", "w") as log:
    proc = subprocess.Popen(command(killed, FITTED_STEPS, REFITS, hang=10), stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    deadline = time.time() + 600
    while proc.poll() is None and time.time() < deadline:
      # The step-8 checkpoint is written in the background: wait for it to be complete.
      if (os.path.exists(os.path.join(killed, "hanging"))
          and checkpointing.latest_step(killed) == 8):
        break
      time.sleep(0.05)
    assert proc.poll() is None, open(tmp_path / "first.log").read()
    proc.kill()
    proc.wait()
  assert checkpointing.latest_step(killed) == 8
  schedule = json.load(open(os.path.join(killed, "config.json")))["fitted_schedule"]
  assert schedule == [[3, 20], [4, 20], [6, 26], [8, 26], [10, 24]]
  # The rerun's calibration and its re-fits up to step 10 would decide otherwise if they were
  # asked: they must not be; the later ones are fresh.
  rerun = command(killed, FITTED_STEPS + 5, {6: 30, 10: 30, 14: 22})
  done = subprocess.run(rerun, capture_output=True, text=True, env=env, timeout=600)
  assert done.returncode == 0, done.stdout + done.stderr
  runs = provenance.load_run_info(killed)["invocations"]
  assert "budget_fit" in runs[0] and "budget_fit" not in runs[-1]
  assert [r["step"] for r in runs[-1]["budget_refits"]] == [12, 14, 16, 18, 20]
  assert (runs[-1]["start_step"], runs[-1]["end_step"]) == (8, 22)
  for path in (straight, killed):
    config = json.load(open(os.path.join(path, "config.json")))
    assert config["num_train_steps"] == 22
    assert [d for d in config["fitted_schedule"] if d[0] in (3, 6, 10, 14)] == [
        [3, 20], [6, 26], [10, 24], [14, 22]]
  states = {}
  for name, path in (("killed", killed), ("straight", straight)):
    *_, states[name], _, step = restore_run(path)
    assert step == 22, (name, step)
  jax.tree_util.tree_map(np.testing.assert_array_equal, states["killed"], states["straight"])
