"""Train a DiffusionGemma model.

  python train.py --config=sft_sudoku --workdir=/tmp/sudoku [--config.num_train_steps=500 ...]
  python train.py --config=CONFIG --workdir=DIR --init_from=CHECKPOINT_DIR   # fine-tune
  python train.py --config=sft_sudoku_lora --dry_run   # per-device memory plan, no weights
  python train.py --config=sft_sudoku_lora:vision --dry_run --dry_run_images=1  # with images
  python train.py --config=sdrl_sudoku --workdir=DIR --init_from=SFT_WORKDIR  # SD·RL stage

Rerunning on the same workdir resumes exactly (step, optimizer, data position, RNG).
SIGTERM or Ctrl-C stops the run at the next step boundary with a checkpoint there (every
process of a multi-process run at the same step) and exits 0; a second Ctrl-C interrupts.
"""

import math
import os

from absl import flags
from ml_collections import config_flags

from diffgemma import cli
from diffgemma.runs import distributed, preemption

distributed.define_flags()  # --distributed, --coordinator_address, --num_processes, ...
_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/NAME.py, or just NAME.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, config and logs.")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "Start a new run from these parameters: a transformers checkpoint dir "
    "(DiffusionGemma or Gemma 4), an orbax model dir, or a training workdir. The model "
    "architecture comes from the checkpoint.")
_DRY_RUN = flags.DEFINE_bool(
    "dry_run", False, "Compile the training step against abstract parameters on the "
    "configured mesh and print per-device memory; allocates no weights, needs no --workdir.")
_DRY_RUN_DEVICES = flags.DEFINE_integer(
    "dry_run_devices", None, "Devices to simulate on the CPU for --dry_run (default: the "
    "product of the config's fixed sharding axes).")
_DRY_RUN_IMAGES = flags.DEFINE_integer(
    "dry_run_images", 0, "For --dry_run: plan every row of a text task with this many images at "
    "the vision tower's soft-token budget (the prompt lengthened by their placeholders); needs "
    "a model with a vision tower, e.g. --config=sft_sudoku_lora:vision.")
_GRACE_S = flags.DEFINE_float(
    "preemption_grace_s", preemption.DEFAULT_GRACE_S, "Seconds after SIGTERM or Ctrl-C within "
    "which the run must have stopped with a checkpoint; set it to the scheduler's grace period "
    "(SLURM KillWait, Kubernetes terminationGracePeriodSeconds). If a step and its save take "
    "longer, the run ends with one line naming the last complete checkpoint (exit status 5). "
    "0: no limit.")


def simulate_devices(config) -> None:
  """Ask XLA for N host (CPU) devices before JAX starts, for a --dry_run without hardware."""
  n = _DRY_RUN_DEVICES.value
  if n is None:  # -1 ("the rest") counts as 1
    n = math.prod(max(config.sharding.get(a, 1), 1) for a in ("data", "fsdp", "expert", "tensor"))
  flags_ = [f"--xla_force_host_platform_device_count={n}",
            # Schedule for memory, not concurrency, as a GPU compile would (else the CPU plan
            # holds many layers' temporaries at once); skip costly codegen nobody will run.
            "--xla_cpu_enable_concurrency_optimized_scheduler=false",
            "--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
  os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "")] + flags_).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")


def main(argv):
  del argv
  if _DRY_RUN.value:
    _main(None)
    return
  # From the start: a signal during set-up counts too.
  with preemption.on_signals(grace_s=_GRACE_S.value, on_expired=_grace_expired) as stop:
    _main(stop)


def _last_checkpoint() -> str:
  """Where a rerun resumes, read from the disk now: the line's end when a run ends on a failure
  (a stop past its grace period, another process of the run lost)."""
  from diffgemma.runs import checkpointing

  workdir = _WORKDIR.value or ""
  step = checkpointing.latest_step(workdir) if workdir else None
  return (f"the last complete checkpoint is step {step} in {checkpointing.checkpoint_dir(workdir)}"
          if step is not None else "no checkpoint was complete")


def _grace_expired() -> str:
  """The line for a stop that outlived --preemption_grace_s (run on the watcher thread)."""
  return (f"the stop did not finish within --preemption_grace_s={_GRACE_S.value:g}; "
          f"{_last_checkpoint()}; rerun the same command to resume from it (or raise "
          "--preemption_grace_s)")


def _resume_point() -> str:
  """The end of the line when another process of the run is lost (distributed.lost)."""
  return f"{_last_checkpoint()}; rerun the same command to resume from it"


def _main(stop: preemption.Preemption | None):
  if _CONFIG.value is None:
    raise cli.UserError("--config is required, e.g. --config=sft_sudoku")
  if _DRY_RUN_IMAGES.value and not _DRY_RUN.value:
    raise cli.UserError("--dry_run_images is for --dry_run (a training run's images come from "
                        "its data)")
  if _DRY_RUN_IMAGES.value < 0:
    raise cli.UserError(f"--dry_run_images must be >= 0, got {_DRY_RUN_IMAGES.value}")
  if _DRY_RUN.value:
    simulate_devices(_CONFIG.value)
  elif not _WORKDIR.value:
    raise cli.UserError("--workdir is required, e.g. --workdir=/tmp/sudoku")
  distributed.initialize_from_flags(resume_point=_resume_point)
  from diffgemma.training import memory_plan, loop  # after flag parsing, so bad flags fail fast

  if _DRY_RUN.value:
    report = memory_plan.dry_run(_CONFIG.value, init_from=_INIT_FROM.value,
                                 images=_DRY_RUN_IMAGES.value)
    print(memory_plan.format_report(report))
    return
  # The keys set on the command line: on resume, only they can change an --init_from run's
  # architecture (see resume_config.reconcile).
  overridden = set(config_flags.get_override_values(flags.FLAGS["config"]))
  distributed.check_same_run(_CONFIG.value.to_dict(), {
      "workdir": _WORKDIR.value, "init_from": _INIT_FROM.value,
      "config.*": sorted(overridden)})  # the keys set on the command line
  loop.train(_CONFIG.value, _WORKDIR.value, init_from=_INIT_FROM.value, overridden=overridden,
             preemption=stop)


if __name__ == "__main__":
  cli.run(main)
