"""The SFT update step of a config, built for timing: shared by step_profile.py and step_ab.py.

diffgemma is imported inside the functions, so each of step_ab.py's processes builds the step
from the code tree it times (its PYTHONPATH names that tree), while this file comes from the tree
that runs the benchmark.
"""

import tempfile


# A recipe fitted to its budget (num_train_steps=0) is timed on a schedule of this length: the
# count is a compile-time constant of the step, and the Sudoku default had it before the fit.
TIMED_SCHEDULE_STEPS = 4000


def build_step(config, steps: int):
  """(jitted update step, initial state, `steps` batches) of an SFT config."""
  if config.num_train_steps == 0:
    config = config.copy_and_resolve_references()
    config.num_train_steps = TIMED_SCHEDULE_STEPS
  from diffgemma.tasks import make_task
  from diffgemma.training import update_step
  from diffgemma.training.stages import sft

  try:
    from diffgemma.training import run_config, training_state
  except ImportError:  # a tree before the subpackage layering (step_ab.py times older refs)
    from diffgemma.runs import run_config, training_state

  setup = training_state.make_setup(run_config.build(config))
  state = training_state.init_state(setup)
  stage = sft.SftStage(None, make_task(config), setup)
  step_fn = update_step.make_update_step(setup, stage.loss_fn)
  with tempfile.TemporaryDirectory(prefix="sft_step_run_") as workdir:
    stage.start(state, None, 0, workdir)
    batches = [stage.next_batch(i, state, None)[0] for i in range(steps)]
  return step_fn, state, batches
