"""The one training loop: SFT and SD·RL runs alike (a stage supplies the loss and batches).

  train(config, workdir)   start a new run (random or --init_from) or resume the workdir's
                           latest checkpoint exactly (step, optimizer, data position, RNG)

Sections: configuration (everything checked before anything is written), state (new or
restored), the loop (update step, logging, periodic evaluation through the task, checkpoints,
deadline, preemption, the non-finite guard), and the close.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time

import jax
import ml_collections
from tqdm import tqdm

from diffgemma import errors
from diffgemma.io.tb_writer import SummaryWriter
from diffgemma.model import lora, sharding
from diffgemma.runs import (
  checkpointing,
  distributed,
  preemption as preemption_lib,
  provenance,
  resume_config,
  workdir_lock,
)
from diffgemma.sampling import sampler
from diffgemma.tasks import make_task, task_name, tokenization_keys
from diffgemma.tasks.base import Task
from diffgemma.training import (
  budget,
  evaluation,
  run_config,
  stages,
  training_state,
  update_step,
)


class NonFiniteError(errors.RunStopped):
  """A run stopped on a non-finite loss or gradient norm. One-line message."""


def _adopt_tokenization(config, init_from: str, overridden) -> None:
  """A run started from a training run of the same task keeps its token mapping (e.g. Sudoku's
  data.prompt_format): the starting model's embeddings were trained on it."""
  if not os.path.isfile(os.path.join(init_from, "config.json")):
    return  # a model checkpoint, not a training run
  source = checkpointing.load_config(init_from)
  try:
    same_task = task_name(source) == task_name(config)
  except ValueError:
    return  # an unknown task name: make_task reports it
  if not same_task:
    return
  for key in tokenization_keys(config):
    section, name = key.split(".")
    theirs = source.get(section, {}).get(name)
    ours = config.get(section, {}).get(name)
    if theirs is None or theirs == ours:
      continue
    if key in (overridden or ()):
      raise errors.ConfigError(f"--config.{key}={ours} differs from {theirs!r}, which the run in "
                               f"{init_from} was trained with; drop the override")
    with config.unlocked():
      config[section][name] = theirs
    print(f"  {key}: {ours!r} -> {theirs!r} (from {init_from})")


def prepare_config(config: ml_collections.ConfigDict, workdir: str | None,
                   init_from: str | None, planning: bool = False, overridden=None):
  """(config, run, task, resuming step or None, resume changes): the run's config as it is saved
  (config.json) and as the one typed `RunConfig` everything below takes, fully validated (a bad
  value is a one-line ConfigError; bad task data a one-line InputError), and the task built
  from its sections. Reads configs and task data only; writes nothing.

  A new run adopts `init_from`'s architecture. A resumed run continues under its saved config,
  with the requested changes that are safe on resume (`resume_config.reconcile`; any other
  difference is a one-line ResumeConfigError); `overridden` are the keys set on the command
  line. `planning` (--dry_run): an SD·RL config needs no --init_from.
  """
  config = ml_collections.ConfigDict(config.to_dict())
  step = checkpointing.latest_step(workdir) if workdir else None
  changes = {}
  if step is not None:
    config, changes = resume_config.reconcile(checkpointing.load_config(workdir), config,
                                              overridden, workdir)
    if "num_train_steps" in changes and config.get("fitted_schedule"):
      with config.unlocked():  # an explicit count ends the fitted schedule and its re-fits
        config.fitted_schedule = []
  elif init_from:
    with config.unlocked():
      config.init_from = os.path.abspath(init_from)
    training_state.adopt_checkpoint_architecture(config, init_from)
    _adopt_tokenization(config, init_from, overridden)
  try:
    stage_cls = stages.stage_class(config)
  except ValueError as e:
    raise errors.ConfigError(f"bad config: {e}") from None
  if step is None and not init_from and stage_cls.requires_init_from and not planning:
    raise checkpointing.CheckpointError(
        f"the {stage_cls.name} stage starts from a trained model: pass "
        "--init_from=SFT_WORKDIR (or a checkpoint dir)")
  try:
    run = run_config.build(config, **stages.stage_settings(config))
    task = make_task(config, planning=planning)
  except errors.InputError:
    raise
  except (KeyError, TypeError, ValueError) as e:
    after = " after the resume changes" if changes else ""
    raise errors.ConfigError(f"bad config{after}: {errors.one_line(e)}") from None
  return config, run, task, step, changes


def check_init_from(init_from: str | None, workdir: str) -> None:
  """A new run's missing --init_from fails before anything is read or written (a resumed run
  does not read it)."""
  if init_from and checkpointing.latest_step(workdir) is None and not os.path.isdir(init_from):
    raise checkpointing.CheckpointError(f"--init_from directory {init_from!r} not found")


def record_resume_changes(workdir: str, config, changes: dict, step: int) -> None:
  """Print the changes a resumed run applies; rewrite config.json; append them, with the step
  they take effect, to the run's config history."""
  if not changes:
    return
  print(f"changed on resume at step {step}: {'; '.join(resume_config.describe(changes, config))}"
        f" (recorded in {resume_config.HISTORY_FILE})")
  checkpointing.save_config(workdir, config)
  resume_config.record(workdir, step, changes)


def eval_params(state, frozen, lora_cfg: lora.LoraConfig):
  """What the sampler runs: the trained params, or the base wrapped with the adapters."""
  return training_state.model_params(state["params"], frozen, lora_cfg)


def evaluate_and_log(step, params, task: Task, model_cfg, sampler_cfg, prompts, batch_size,
                     generate_fn, writer, trace_fn=None, trace_rows: int = 0) -> dict[str, float]:
  """The periodic held-out evaluation: written to TensorBoard (with the denoising traces of the
  first `trace_rows` examples, drawn by `trace_fn`, a trajectory-recording sampler), printed
  above the progress bar (with the task's warning when the metrics look unhealthy), returned as
  eval/* metrics."""
  metrics, _ = evaluation.evaluate(task, params, model_cfg, sampler_cfg, prompts, batch_size,
                                   seed=step, generate_fn=generate_fn)
  if trace_fn is not None and trace_rows:
    shown = prompts.take(slice(0, trace_rows))
    images = ({} if shown.pixel_values_NxIxMxD is None
              else {"images": evaluation.prompt_images(shown)})
    out = jax.device_get(trace_fn(params, shown.prompt_NxP, shown.valid_NxP,
                                  jax.random.PRNGKey(step), **images))
    task.log_traces(writer, step, shown, out.trajectory, rows=range(len(shown)))
  accuracies = sorted((k for k in metrics if k.endswith("accuracy")),
                      key=lambda k: k != task.headline_metric)  # the task's headline first
  shown = [f"{k}={metrics[k]:.3f}" for k in accuracies]
  tqdm.write(f"step {step}: eval {' '.join(shown)} TPF={metrics['tokens_per_forward']:.2f} "
             f"steps/canvas={metrics['steps_per_canvas']:.1f}")
  warning = task.plateau_warning(step, metrics)
  if warning:
    tqdm.write(warning)
  metrics = {f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
  writer.write(step, metrics)
  return metrics


def _check_finite(state, train_cfg: run_config.TrainConfig, mngr) -> int:
  """The number of skipped non-finite steps so far (one host sync); raises NonFiniteError when
  the policy says the run must stop."""
  count, first = (int(x) for x in jax.device_get((state["nonfinite"], state["nonfinite_step"])))
  if count == 0:
    return 0
  if train_cfg.on_nonfinite == "stop" or count > train_cfg.max_nonfinite_skips:
    last = mngr.latest_step()
    where = (f"the last finite checkpoint is step {last} in {mngr.directory}"
             if last is not None else "no checkpoint was saved")
    reason = ("on_nonfinite='stop'" if train_cfg.on_nonfinite == "stop" else
              f"{count} non-finite steps exceed max_nonfinite_skips="
              f"{train_cfg.max_nonfinite_skips}")
    raise NonFiniteError(f"non-finite loss or gradient norm at step {first} ({reason}); "
                         f"stopped without saving it; {where}")
  return count


class _Seen:
  """What the run has trained on up to its current step: examples_seen and real_tokens_seen
  (the stage's `batch_counts`, summed; carried across invocations in the checkpoint,
  `training_state.with_seen`) and train_seconds (the wall-clock seconds of the training loops,
  from each invocation's first step on, compiles, evaluations and checkpoints included; carried
  in run_info.json, `seconds_before` those of the checkpoint resumed from)."""

  def __init__(self, state, seconds_before: float):
    self._counts = training_state.seen_counts(state)
    self._pending = []  # device scalars of the steps since the last read
    self._before = seconds_before
    self._started = time.perf_counter()

  def start(self) -> None:
    self._started = time.perf_counter()

  def add(self, counts) -> None:
    self._pending.append(counts)

  def totals(self) -> dict:
    """{examples_seen, real_tokens_seen, train_seconds} now (one host read)."""
    for examples, tokens in jax.device_get(self._pending):
      self._counts["examples_seen"] += int(examples)
      self._counts["real_tokens_seen"] += int(tokens)
    self._pending = []
    self._counts["train_seconds"] = self._before + time.perf_counter() - self._started
    return dict(self._counts)


def _close(bar, mngr, writer, failed: BaseException | None = None) -> None:
  """The progress bar, pending checkpoint writes (their failure is one line), TensorBoard. With
  `failed` (the error already on its way out) a second error is dropped."""
  bar.close()
  checkpointing.finish(mngr, failed=failed)
  try:
    writer.close()
  except OSError:
    if not failed:
      raise


def train(config: ml_collections.ConfigDict, workdir: str, init_from: str | None = None,
          stop_at: int | None = None, overridden=None,
          preemption: preemption_lib.Preemption | None = None) -> dict:
  """Train (or resume) in `workdir`; returns the last logged metrics.

  `stop_at` ends this invocation early at that step (with a checkpoint), as a preemption would;
  the schedule still spans `num_train_steps`, so rerunning resumes the same run. `init_from`
  starts a new run from a checkpoint directory's parameters; a LoRA run (lora.enabled) trains
  adapters on that base. An SD·RL config (an `sdrl` section) runs the SD·RL stage.
  `overridden`: the config keys set on the command line (see `prepare_config`). One trainer
  per workdir (`workdir_lock`). `preemption` (train.py's SIGTERM / Ctrl-C flag): when it is
  set, on any process, every process stops at the same next step boundary with a checkpoint
  there, and the call returns normally after one line saying how to resume.
  """
  # ---------------------------------------------------------------- configuration
  check_init_from(init_from, workdir)
  config, run, task, start_step, changes = prepare_config(config, workdir, init_from,
                                                          overridden=overridden)
  with workdir_lock.hold(workdir):  # every process of a multi-process run: process 0's lock
    return _train(config, run, task, workdir, start_step, changes, init_from, stop_at,
                  preemption)


def _agreed_stop(step: int, stop_at, end_time, preemption) -> str:
  """Why the loop stops after boundary `step` ("": it goes on), the same on every process:
  stop_at (every process computes the same), else a stop signal one process received
  ("preempted:SIGTERM") or process 0's wall-clock deadline, agreed through
  `distributed.agree_any` (one key-value round trip per boundary, no device sync; none in a
  single-process run)."""
  if stop_at is not None and step >= stop_at:
    return provenance.STOP_AT
  if preemption is None and end_time is None:
    return ""  # nothing that could differ between processes
  if preemption is not None and preemption.requested:
    mine = f"{provenance.PREEMPTED}:{preemption.signal_name}"
  elif end_time is not None and time.time() > end_time:
    mine = provenance.MAX_TRAIN_MINUTES
  else:
    mine = ""
  return distributed.agree_any("stop", mine)


def _with_schedule(run: run_config.RunConfig, decisions) -> run_config.RunConfig:
  """`run` under a fitted schedule's decisions so far ([step, count] pairs; the last count is
  the one in effect)."""
  decisions = tuple((int(s), int(n)) for s, n in decisions)
  return dataclasses.replace(run, train=dataclasses.replace(
      run.train, num_train_steps=decisions[-1][1], fitted_schedule=decisions))


def _with_num_train_steps(run: run_config.RunConfig, num_steps: int) -> run_config.RunConfig:
  return dataclasses.replace(run, train=dataclasses.replace(run.train, num_train_steps=num_steps))


class _StepClock:
  """Times a fitting run's first steps: step 1 (with the update step's compile) apart from the
  steps after it. Each timed step ends on the device (`block_until_ready`), so dispatch does not
  hide its cost."""

  def __init__(self, start_step: int):
    self.start_step = start_step
    self.began, self.began_wall = time.perf_counter(), time.time()
    self.first_done = None  # perf_counter after the compiled step
    self.durations = []  # seconds of each step after it

  def stepped(self, step: int, state) -> None:
    jax.block_until_ready(state)
    now = time.perf_counter()
    if self.first_done is None:
      self.first_done = now
    else:
      self.durations.append(now - self.last_done)
    self.last_done, self.last_step = now, step

  def timed_steps(self) -> int:
    return len(self.durations)

  def seconds_per_step(self) -> float:
    """The fastest stretch of the timed steps (`budget.fastest_window`)."""
    return budget.fastest_window((1, seconds) for seconds in self.durations)

  def compile_seconds(self) -> float:
    return max(0.0, self.first_done - self.began - self.seconds_per_step())

  def calibrated(self, step: int, warmup_end: int, end_time: float) -> bool:
    """Enough timed steps: the warmup is over, or the calibration has used its share of the
    budget (`budget.MAX_CALIBRATION_SHARE`)."""
    if self.timed_steps() < budget.MIN_TIMED_STEPS:
      return False
    share = (time.time() - self.began_wall) / max(end_time - self.began_wall, 1e-9)
    return step >= warmup_end or share >= budget.MAX_CALIBRATION_SHARE


class _Refits:
  """A fitted run's re-fits after its calibration (`budget.refit`): the clean timing windows
  (steps, seconds) since the last decision, what a schedule costs besides its steps, and the
  decisions already recorded for the steps ahead (a resumed run replays them, so it follows
  the schedule of the run it continues; fresh decisions come only after the last recorded one)."""

  def __init__(self, decisions, start_step: int, timing: dict, may_extend: bool):
    self.pending = {int(s): int(n) for s, n in decisions if s > start_step}
    self.last_recorded = max((int(s) for s, _ in decisions), default=-1)
    self.windows = []
    self.timing = {k: float(timing.get(k) or 0.0)
                   for k in ("compile_seconds", "eval_seconds", "checkpoint_seconds")}
    self.may_extend = may_extend

  def due(self, step: int, cadence: int) -> bool:
    return step in self.pending or (step > self.last_recorded and step % cadence == 0)

  def decide(self, step: int, num_steps: int, end_time, eval_every: int,
             checkpoint_every: int) -> tuple[int, budget.Refit | None]:
    """(the count after `step`, the fresh decision to record or None): the recorded decision
    for `step`, else a fresh one (none without a deadline: the count is kept), process 0's,
    agreed by every process."""
    windows, self.windows = self.windows, []
    if step in self.pending:
      return self.pending.pop(step), None
    if end_time is None:
      return num_steps, None
    seconds_left = end_time - time.time()
    seconds_per_step = budget.fastest_window(windows)
    count, reason = num_steps, budget.KEPT  # no clean window since the last fit: no evidence
    if seconds_per_step is not None:
      count, reason = budget.refit(num_steps, step, seconds_left, seconds_per_step,
                                   eval_every=eval_every, checkpoint_every=checkpoint_every,
                                   may_extend=self.may_extend, **self.timing)
    count, reason = distributed.agree("refit", lambda: f"{count} {reason}").split()
    self.last_recorded = step
    return int(count), budget.Refit(step, seconds_per_step, self.timing["eval_seconds"],
                                    seconds_left, num_steps, int(count), reason)


def _fit_schedule(clock: _StepClock, step: int, end_time: float, train_cfg, eval_every: int,
                  evaluate, save_checkpoint, workdir: str) -> tuple[budget.Calibration, dict]:
  """(the fitted count and what it was measured from, the eval metrics at `step`): one periodic
  evaluation at `step` (logged like any other, its compile time taken out) and one checkpoint
  write into a scratch directory, timed; process 0's count, agreed by every process."""
  evaluated, eval_seconds = {}, 0.0
  if evaluate is not None:
    with budget.CompileClock() as compile_clock:
      evaluated = evaluate()
    eval_seconds = compile_clock.warm_seconds
  scratch = os.path.join(workdir, ".budget_calibration")
  began = time.perf_counter()
  save_checkpoint(scratch)
  checkpoint_seconds = time.perf_counter() - began
  if distributed.primary():
    shutil.rmtree(scratch, ignore_errors=True)
  seconds_left = end_time - time.time()
  fields = dict(seconds_per_step=clock.seconds_per_step(), compile_seconds=clock.compile_seconds(),
                eval_seconds=eval_seconds, checkpoint_seconds=checkpoint_seconds)
  count = budget.fit_num_steps(seconds_left, step, eval_every=eval_every,
                               checkpoint_every=train_cfg.checkpoint_every, **fields)
  count = int(distributed.agree("fit_num_steps", lambda: str(count)))
  return budget.Calibration(calibration_steps=step, seconds_left=seconds_left,
                            num_train_steps=count, **fields), evaluated


def _save_and_wait(workdir: str, step: int, state, timeout_s: float) -> None:
  mngr = checkpointing.manager(workdir, keep=1, timeout_s=timeout_s)
  checkpointing.save(mngr, step, state)
  checkpointing.finish(mngr)


def _too_slow(calibration: budget.Calibration, train_cfg) -> str:
  """One line: this machine fits fewer steps than the recipe needs, and the minutes that would."""
  per_step = (60 * train_cfg.max_train_minutes) / max(calibration.num_train_steps, 1)
  minutes = math.ceil(train_cfg.min_useful_steps * per_step / 60)
  return (f"warning: this machine fits {calibration.num_train_steps} steps in "
          f"max_train_minutes={train_cfg.max_train_minutes:g}, fewer than the "
          f"{train_cfg.min_useful_steps} this recipe needs for a useful result: set "
          f"--config.max_train_minutes={minutes} or more")


def _train(config: ml_collections.ConfigDict, run: run_config.RunConfig, task: Task, workdir: str,
           start_step, changes, init_from, stop_at, preemption) -> dict:
  """The run itself; `config` is only written to the workdir (config.json), `run` is read."""
  if start_step is not None and init_from:
    print(f"resuming {workdir}: --init_from applies only to a new run")
  # num_train_steps=0: a new run times its first steps, all inside the warmup, then fits the
  # count (`_fit_schedule`); until then the stage's data stream spans the warmup.
  fitting = run.train.num_train_steps == budget.FIT and start_step is None
  if fitting:
    run = _with_num_train_steps(run, run.optimizer.warmup_steps)
  # A resumed fitted run starts under the decisions taken up to its step; the later recorded
  # ones are replayed at their steps (`_Refits`).
  decisions = run.train.fitted_schedule
  if start_step is not None and decisions:
    run = _with_schedule(run, [d for d in decisions if d[0] <= start_step] or decisions[:1])
  setup = training_state.make_setup(run)
  train_cfg = setup.train_cfg
  stage = stages.make_stage(task, setup)
  report = task.data_report()
  if report:
    print(report)

  # ---------------------------------------------------------------- state
  if start_step is not None:
    # The newest readable checkpoint (a damaged newer one is moved aside, with a notice).
    state, frozen, start_step = training_state.restore_state(workdir, setup, move_damaged=True)
    print(f"resumed from step {start_step} in {workdir}")
    record_resume_changes(workdir, config, changes, start_step)
  else:
    start_step = 0
    if init_from:
      print(f"initialising from {init_from}")
    state, frozen = training_state.new_state(setup)
    checkpointing.save_config(workdir, config)
  # run_info.json: this invocation's provenance, and the task's main metric (tools/compare.py)
  provenance.record_start(workdir, start_step, headline_metric=task.headline_metric)
  refits = (_Refits(decisions, start_step, provenance.budget_fit(workdir) or {}, may_extend=False)
            if decisions and not fitting else None)
  # After the restore: a checkpoint moved aside is not one of the manager's steps.
  mngr = checkpointing.manager(workdir, keep=train_cfg.keep_checkpoints,
                               timeout_s=train_cfg.checkpoint_timeout_s)
  model_cfg, lora_cfg = setup.model_cfg, setup.lora_cfg
  trained = sum(x.size for x in jax.tree_util.tree_leaves(state["params"]))
  if frozen is None:
    print(f"model: {trained / 1e6:.3f}M parameters; {stage.name} steps {start_step}.."
          f"{train_cfg.num_train_steps}")
  else:
    base = sum(x.size for x in jax.tree_util.tree_leaves(frozen))
    print(f"model: {base / 1e6:.3f}M frozen parameters ({lora_cfg.base_dtype}), "
          f"{trained / 1e6:.3f}M LoRA parameters (rank {lora_cfg.rank}); {stage.name} steps "
          f"{start_step}..{train_cfg.num_train_steps}")

  state_sh = jax.tree_util.tree_map(lambda x: x.sharding, state)
  frozen_sh = None if frozen is None else jax.tree_util.tree_map(lambda x: x.sharding, frozen)
  step_fn = update_step.make_update_step(
      setup, stage.loss_fn, state_sh, frozen_sh,
      update_step.batch_shardings(setup, stage.batch_shapes()), stage.update_stream)
  writer = SummaryWriter(os.path.join(workdir, "tensorboard"), enabled=distributed.primary())
  eval_cfg = run.eval
  eval_prompts = task.eval_prompts() if eval_cfg.every_steps > 0 else None
  eval_sampler_cfg = run.sampler.with_stops(task.stop_token_ids)
  generate_fn = sampler.make_generate_fn(model_cfg, eval_sampler_cfg)
  # Denoising traces exist in diffusion mode only (AR decoding records no trajectory).
  trace_rows = (min(eval_cfg.trace_examples, len(eval_prompts or ()))
                if eval_sampler_cfg.mode == sampler.DIFFUSION else 0)
  trace_fn = (sampler.make_generate_fn(model_cfg, eval_sampler_cfg.replace(record_trajectory=True))
              if trace_rows else None)
  stage.start(state, frozen, start_step, workdir)
  seen = _Seen(state, provenance.train_seconds_at(workdir, start_step))

  def checkpoint(step):
    nonlocal state
    _check_finite(state, train_cfg, mngr)  # nothing non-finite is ever saved
    totals = seen.totals()
    state = training_state.with_seen(state, totals)
    # A full disk met here (the write in flight filled it) is the checkpoint's failure: one line.
    with checkpointing.write_errors(mngr, step):
      provenance.record_train_seconds(workdir, step, totals["train_seconds"])
    saved = state if not (frozen is not None and lora_cfg.save_base) else {**state, "base": frozen}
    checkpointing.save(mngr, step, saved)

  def reschedule(step, decisions):
    """Continue after `step` under a fitted schedule's decisions: rebuild what depends on the
    count, the schedule (a compile-time constant of the update step) and the stage's data
    stream (from this step on)."""
    nonlocal run, setup, train_cfg, stage, step_fn
    run = _with_schedule(run, decisions)
    setup = training_state.make_setup(run, mesh=setup.mesh)
    train_cfg = setup.train_cfg
    stage = stages.make_stage(task, setup)
    stage.start(state, frozen, step, workdir)
    step_fn = update_step.make_update_step(
        setup, stage.loss_fn, state_sh, frozen_sh,
        update_step.batch_shardings(setup, stage.batch_shapes()), stage.update_stream)
    bar.total = train_cfg.num_train_steps
    bar.refresh()

  def save_decision(decision):
    """Append a fit decision ([step, count]) to config.json, with the count in effect, before
    any checkpoint after it: a resume replays it."""
    with config.unlocked():
      config.fitted_schedule = [*config.get("fitted_schedule", []), list(decision)]
      config.num_train_steps = decision[1]
    checkpointing.save_config(workdir, config)

  # ---------------------------------------------------------------- the loop
  end_time = (time.time() + 60 * train_cfg.max_train_minutes
              if train_cfg.max_train_minutes > 0 else None)
  last, host_metrics = {}, {}
  # A timing window (between two logged steps) is clean when it held no checkpoint and no
  # compile: a re-fit's pace comes from the clean ones (evaluations restart the window).
  window_start, window_steps, window_clean = time.perf_counter(), 0, False
  refit_event = eval_cfg.every_steps if eval_prompts is not None else train_cfg.checkpoint_every
  bar = tqdm(total=None if fitting else train_cfg.num_train_steps, initial=start_step,
             desc=stage.name, unit="step", dynamic_ncols=True, disable=not distributed.primary())
  step, stop = start_step, ""
  clock = _StepClock(start_step) if fitting else None
  seen.start()
  try:
    while step < train_cfg.num_train_steps:
      batch, new_host_metrics = stage.next_batch(step, state, frozen)
      host_metrics.update(new_host_metrics)
      batch = sharding.global_batch(batch, setup.mesh, setup.rules)
      seen.add(stage.batch_counts(step, batch))
      state, metrics = step_fn(state, frozen, batch)
      step += 1
      window_steps += 1
      bar.update(1)
      checkpointing.check_write(mngr)  # a failed or hung background write ends the run now
      if clock is not None:
        clock.stepped(step, state)
      final = step == train_cfg.num_train_steps and not fitting
      if step % train_cfg.log_every == 0 or final:
        metrics = jax.tree_util.tree_map(float, jax.device_get(metrics))
        metrics["nonfinite_steps"] = float(_check_finite(state, train_cfg, mngr))
        elapsed = time.perf_counter() - window_start
        metrics["steps_per_second"] = window_steps / elapsed
        if stage.tokens_per_batch():
          metrics["tokens_per_second"] = window_steps * stage.tokens_per_batch() / elapsed
        metrics.update(host_metrics)
        metrics.update(seen.totals())
        if refits is not None and window_clean:
          refits.windows.append((window_steps, elapsed))
        window_start, window_steps, window_clean = time.perf_counter(), 0, True
        writer.write(step, metrics)
        bar.set_postfix(stage.progress_fields(metrics))
        last.update(metrics)
      boundary = stage.is_boundary(step)
      stop = _agreed_stop(step, stop_at, end_time, preemption) if boundary else ""
      stopping = bool(stop)
      if eval_prompts is not None and (step % eval_cfg.every_steps == 0 or final or stopping):
        with budget.CompileClock() as eval_clock:
          last.update(evaluate_and_log(step, eval_params(state, frozen, lora_cfg), task,
                                       model_cfg, eval_sampler_cfg, eval_prompts,
                                       eval_cfg.batch_size, generate_fn, writer, trace_fn,
                                       trace_rows))
        if refits is not None:
          refits.timing["eval_seconds"] = eval_clock.warm_seconds
        # eval time is not throughput
        window_start, window_steps, window_clean = time.perf_counter(), 0, True
      if fitting and stopping:
        tqdm.write(f"stopped at step {step}, before the schedule was fitted to the budget: "
                   "nothing saved; rerun the same command to start again")
      elif boundary and (step % train_cfg.checkpoint_every == 0 or final or stopping):
        checkpoint(step)
        window_clean = False  # the write goes on in the background
      if stop == provenance.MAX_TRAIN_MINUTES:
        tqdm.write(f"stopping at step {step}: max_train_minutes={train_cfg.max_train_minutes} "
                   "reached")
      if stopping:
        break
      if fitting and clock.calibrated(step, train_cfg.num_train_steps, end_time):
        # Fix the count, then rebuild what depends on it: the schedule (a compile-time
        # constant of the update step) and the stage's data stream (from this step on).
        def evaluate_now():
          return evaluate_and_log(step, eval_params(state, frozen, lora_cfg), task, model_cfg,
                                  eval_sampler_cfg, eval_prompts, eval_cfg.batch_size,
                                  generate_fn, writer, trace_fn, trace_rows)

        calibration, evaluated = _fit_schedule(
            clock, step, end_time, train_cfg, eval_cfg.every_steps if eval_prompts else 0,
            evaluate_now if eval_prompts is not None else None,
            lambda scratch: _save_and_wait(scratch, step, state,
                                           train_cfg.checkpoint_timeout_s), workdir)
        last.update(evaluated)
        fitting, clock = False, None
        decision = (step, calibration.num_train_steps)
        save_decision(decision)
        provenance.record_fit(workdir, calibration.as_dict())
        refits = _Refits([decision], step, calibration.as_dict(), may_extend=True)
        reschedule(step, [decision])
        tqdm.write(calibration.describe(train_cfg.max_train_minutes))
        if calibration.num_train_steps < train_cfg.min_useful_steps:
          tqdm.write(_too_slow(calibration, train_cfg))
        window_start, window_steps, window_clean = time.perf_counter(), 0, False
      elif (refits is not None and step < train_cfg.num_train_steps
            and refits.due(step, budget.refit_cadence(train_cfg.num_train_steps, refit_event,
                                                      train_cfg.log_every))):
        before = train_cfg.num_train_steps
        count, refit = refits.decide(step, before, end_time,
                                     eval_cfg.every_steps if eval_prompts else 0,
                                     train_cfg.checkpoint_every)
        if refit is not None:  # a fresh decision: saved before any checkpoint after it
          save_decision((step, count))
          provenance.record_refit(workdir, refit.as_dict())
        if count != before:
          reschedule(step, [*train_cfg.fitted_schedule, (step, count)])
          tqdm.write(refit.describe() if refit is not None else
                     f"step {step}: num_train_steps {before} -> {count} (recorded in config.json)")
          window_clean = False  # the next step compiles
  except BaseException as e:  # the loop's own error is the one the user sees
    _close(bar, mngr, writer, failed=e)
    raise
  _close(bar, mngr, writer)  # the checkpoint at `step` is complete
  preempted = stop.startswith(provenance.PREEMPTED)
  provenance.record_end(workdir, step, provenance.stop_reason(
      step, train_cfg.num_train_steps, stop == provenance.MAX_TRAIN_MINUTES, preempted),
      seen.totals())
  if preempted and step < train_cfg.num_train_steps:
    print(f"stopped at step {step} on {stop.partition(':')[2]}: checkpoint saved in "
          f"{checkpointing.checkpoint_dir(workdir)}; rerun the same command to resume")
  return last
