"""The SFT update step of a config, built for timing: the one builder of step_profile.py,
step_ab.py, throughput.py and gpu_suite.py.

diffgemma is imported inside the functions, so each of step_ab.py's processes builds the step
from the code tree it times (that tree first on sys.path), while this file comes from the tree
that runs the benchmark.
"""

import tempfile


def with_overrides(config, overrides: str):
  """A copy of `config` with 'KEY=VALUE,KEY=VALUE' applied (values parsed as the key's type)."""
  config = config.copy_and_resolve_references()
  for item in filter(None, overrides.split(",")):
    key, value = item.split("=", 1)
    *path, last = key.strip().split(".")
    node = config
    for part in path:
      node = node[part]
    current = node[last]
    node[last] = (value.lower() in ("1", "true") if isinstance(current, bool)
                  else type(current)(value))
  return config


def make_step(config, frozen=None, task=None):
  """(stage, jitted update step, initial state, frozen base) of an SFT config: the training
  loop's step on the default device placement. `frozen`: a LoRA run's base parameters,
  quantized here when the config asks; `task`: the config's task if already made."""
  from diffgemma.model import quantize
  from diffgemma.runs import run_config, training_state
  from diffgemma.tasks import make_task
  from diffgemma.training import update_step
  from diffgemma.training.stages import sft

  setup = training_state.make_setup(run_config.build(config))
  if frozen is not None and setup.quantize_cfg is not None:
    frozen = quantize.quantize_params(frozen, setup.quantize_cfg)
  state = training_state.init_state(setup, frozen=frozen)
  stage = sft.SftStage(None, task or make_task(config), setup)
  return stage, update_step.make_update_step(setup, stage.loss_fn), state, frozen


def build_step(config, steps: int):
  """(jitted update step, initial state, `steps` batches) of an SFT config."""
  stage, step_fn, state, _ = make_step(config)
  with tempfile.TemporaryDirectory(prefix="sft_step_run_") as workdir:
    stage.start(state, None, 0, workdir)
    batches = [stage.next_batch(i, state, None)[0] for i in range(steps)]
  return step_fn, state, batches
