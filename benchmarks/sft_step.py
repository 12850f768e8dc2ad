"""The SFT update step of a config, built for timing: the one builder of step_profile.py,
step_ab.py, throughput.py and gpu_suite.py.

diffgemma is imported inside the functions, so each of step_ab.py's processes builds the step
from the code tree it times (its PYTHONPATH names that tree), while this file comes from the tree
that runs the benchmark.
"""

import tempfile


# A recipe fitted to its budget (num_train_steps=0) is timed on a schedule of this length: the
# count is a compile-time constant of the step, and the Sudoku default had it before the fit.
TIMED_SCHEDULE_STEPS = 4000


def make_step(config, frozen=None, task=None):
  """(stage, jitted update step, initial state, frozen base) of an SFT config: the training
  loop's step on the default device placement (a fitted schedule timed as TIMED_SCHEDULE_STEPS).
  `frozen`: a LoRA run's base parameters, quantized here when the config asks; `task`: the
  config's task if already made."""
  if config.num_train_steps == 0:
    config = config.copy_and_resolve_references()
    config.num_train_steps = TIMED_SCHEDULE_STEPS
  from diffgemma.model import quantize
  from diffgemma.tasks import make_task
  from diffgemma.training import update_step
  from diffgemma.training.stages import sft

  try:
    from diffgemma.training import run_config, training_state
  except ImportError:  # a tree before the subpackage layering (step_ab.py times older refs)
    from diffgemma.runs import run_config, training_state

  setup = training_state.make_setup(run_config.build(config))
  if frozen is not None and setup.quantize_cfg is not None:
    frozen = quantize.quantize_params(frozen, setup.quantize_cfg)
  state = (training_state.init_state(setup) if frozen is None  # as older trees call it
           else training_state.init_state(setup, frozen=frozen))
  stage = sft.SftStage(None, task or make_task(config), setup)
  return stage, update_step.make_update_step(setup, stage.loss_fn), state, frozen


def build_step(config, steps: int):
  """(jitted update step, initial state, `steps` batches) of an SFT config."""
  step_fn, state, batches, _ = build_counted_step(config, steps, 0)
  return step_fn, state, batches


def build_counted_step(config, steps: int, count_batches: int):
  """build_step's three, then the mean examples per batch over the first
  max(steps, count_batches) batches of the input pipeline (a packed row holds several; 0.0 when
  nothing is counted), so that a step's time reads per example."""
  import numpy as np

  stage, step_fn, state, _ = make_step(config)
  with tempfile.TemporaryDirectory(prefix="sft_step_run_") as workdir:
    stage.start(state, None, 0, workdir)
    drawn = [stage.next_batch(i, state, None)[0] for i in range(max(steps, count_batches))]
  examples = [_examples_in(stage, i, batch) for i, batch in enumerate(drawn[:count_batches])]
  return step_fn, state, drawn[:steps], float(np.mean(examples)) if examples else 0.0


def _examples_in(stage, step: int, batch) -> int:
  """The examples one batch trains on: the stage's own count (the training loop's
  examples_seen), or in trees from before that count, the rows that hold a valid token."""
  import numpy as np

  if hasattr(stage, "batch_counts"):
    return int(stage.batch_counts(step, batch)[0])
  return int(np.sum(np.any(np.asarray(batch["valid"]), axis=1)))
