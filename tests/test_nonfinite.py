"""Finite-or-stop: a non-finite loss never reaches a checkpoint (the training CLI, end to end).

train.py runs under a launcher that wraps the update step: the chosen step sees a NaN embedding
and the clean one is put back after it (the same compiled program; no hook in the product)."""

import os

import chex
import jax
import numpy as np

from diffgemma.runs import checkpointing
from tests.helpers import restore_run, run

TINY = ["--config=sft_sudoku", "--config.model.vocab_size=16", "--config.model.hidden_size=16",
        "--config.model.intermediate_size=24", "--config.model.num_layers=2",
        "--config.model.layer_types=()", "--config.model.num_heads=2",
        "--config.model.num_kv_heads=1", "--config.model.head_dim=8",
        "--config.model.global_head_dim=8", "--config.model.num_experts=4",
        "--config.model.moe_intermediate_size=8", "--config.model.moe_tile_size=8",
        "--config.data.prompt_format=digits", "--config.data.num_threads=0",
        "--config.batch_size=4", "--config.num_train_steps=6", "--config.log_every=1",
        "--config.checkpoint_every=2", "--config.keep_checkpoints=1",
        "--config.eval.every_steps=0", "--config.optimizer.warmup_steps=1"]


# `python -c _NAN_AT_STEP N train.py ARGS`: train.py, with step N's loss (1-based) made NaN.
_NAN_AT_STEP = """
import runpy, sys
import jax.numpy as jnp
from diffgemma.training import update_step

nan_at = int(sys.argv.pop(1))
make = update_step.make_update_step


def make_with_a_nan(*args, **kwargs):
  step = make(*args, **kwargs)

  def step_with_a_nan(state, *rest):
    if int(state["step"]) + 1 != nan_at:
      return step(state, *rest)
    clean = state["params"]["embedding"]
    poisoned = dict(state, params=dict(state["params"], embedding=clean * jnp.nan))
    state, metrics = step(poisoned, *rest)  # not finite: the step keeps the (poisoned) params
    return dict(state, params=dict(state["params"], embedding=clean)), metrics

  return step_with_a_nan


update_step.make_update_step = make_with_a_nan
sys.argv.pop(0)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def train(workdir, *extra, nan_at=0):
  return run("-c", _NAN_AT_STEP, str(nan_at), "train.py", *TINY, f"--workdir={workdir}", *extra)


def all_finite(state) -> bool:
  return all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(state)
             if np.issubdtype(np.asarray(x).dtype, np.floating))


def test_a_nan_stops_the_run_at_its_step_and_keeps_the_last_finite_checkpoint(tmp_path):
  workdir = str(tmp_path / "run")
  r = train(workdir, nan_at=3)
  assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr[-2000:]
  last = r.stderr.strip().splitlines()[-1]  # after the progress bar
  assert last.startswith("error: non-finite loss or gradient norm at step 3"), last
  assert "last finite checkpoint is step 2" in last
  # keep_checkpoints=1: the finite step 2 was not pushed out by anything later.
  assert os.listdir(checkpointing.checkpoint_dir(workdir)) == ["2"]
  *_, state, _, step = restore_run(workdir)
  assert step == 2 and all_finite(state) and int(state["nonfinite"]) == 0


def test_skip_mode_leaves_the_bad_step_out_and_counts_it(tmp_path):
  """The skipped step 3 applies no update (its state equals step 2's but for the counters),
  the run goes on, and a second skip past max_nonfinite_skips stops it."""
  skipped = str(tmp_path / "skip")
  r = train(skipped, "--config.on_nonfinite=skip", "--config.checkpoint_every=1",
            "--config.keep_checkpoints=6", nan_at=3)
  assert r.returncode == 0, r.stderr[-2000:]
  *_, before, _, _ = restore_run(skipped, step=2)
  *_, bad, _, _ = restore_run(skipped, step=3)
  *_, final, _, step = restore_run(skipped)
  assert step == 6 and all_finite(final)
  assert int(final["nonfinite"]) == 1 and int(final["nonfinite_step"]) == 3
  for key in ("params", "opt_state"):
    chex.assert_trees_all_equal(bad[key], before[key])
  assert not np.array_equal(final["params"]["embedding"], bad["params"]["embedding"])
  strict = train(str(tmp_path / "strict"), "--config.on_nonfinite=skip",
                 "--config.max_nonfinite_skips=0", nan_at=3)
  assert strict.returncode == 3 and "exceed max_nonfinite_skips=0" in strict.stderr
