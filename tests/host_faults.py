"""One process of a multi-process run with a fault planted, for tests/test_host_failures.py.

  python -m tests.host_faults --marks=DIR [--pause_step=N] [--pause_save=S] [--full_disk_save=S] \
      [--fail_write=S | --hang_write=S | --fill_disk_write=S] -- train.py FLAGS...

Every process of those tests runs through it (SIGUSR1 prints its threads' stacks, for a test
that timed out). It patches the code below (nothing in diffgemma/ knows of it) and runs the script as
`python train.py FLAGS...` would; the supervised child of a multi-process run
(diffgemma/runs/supervisor.py) runs this same command line, so the faults are the child's. The faults, each at one point of this process's run, so a
test sends its signal at a known place instead of racing a tiny model's millisecond steps:

  --pause_step=N      the N-th call of the training step function (counted from 1 in this
                      invocation) touches DIR/paused-I (I: this process's index) and waits, its
                      batch in hand and its update not yet dispatched, until DIR/resume exists;
  --pause_save=S      the first array write of checkpoint step S (orbax's background write,
                      after the save has started) touches DIR/paused-I and waits the same way;
  --full_disk_save=S  the save of checkpoint step S touches DIR/failed-I and raises
                      OSError(ENOSPC) as it starts, as a full disk would when the save creates
                      its directory. (Raised in orbax's background array write instead, the
                      error leaves every process waiting in orbax's collectives, all of them
                      alive and beating: a hang these tests do not cover yet.)

Faults of orbax's background write (single-process runs too, tests/test_reliability.py), at the
first array write of checkpoint step S; each writes time.monotonic() of the fault to
DIR/write-fault-at:
  --fail_write=S       raise OSError(EIO) inside the write;
  --hang_write=S       never return (a hung file system);
  --fill_disk_write=S  fill the file system holding DIR (DIR/filler) first, then write: the
                       write fails with ENOSPC, as on a disk filled by something else.
"""

import argparse
import asyncio
import errno
import faulthandler
import os
import runpy
import signal
import sys
import time

POLL_S = 0.01


def mark(marks: str, what: str) -> None:
  # The process index as scripts/launch_local.py sets it, or as SLURM does (a cluster's launch).
  index = os.environ.get("DIFFGEMMA_PROCESS_ID", os.environ.get("SLURM_PROCID"))
  with open(os.path.join(marks, f"{what}-{index}"), "w"):
    pass


def resumed(marks: str) -> bool:
  return os.path.exists(os.path.join(marks, "resume"))


def pause_in_step(n: int, marks: str) -> None:
  from diffgemma.training import update_step

  make = update_step.make_update_step

  def make_pausing(*args, **kwargs):
    step_fn = make(*args, **kwargs)
    calls = [0]

    def pausing(*step_args):
      calls[0] += 1
      if calls[0] == n:
        mark(marks, "paused")
        while not resumed(marks):
          time.sleep(POLL_S)
      return step_fn(*step_args)

    return pausing

  update_step.make_update_step = make_pausing


def on_first_write_of(step: int, fault) -> None:
  """`await fault()` before the first array write of checkpoint `step` (its files go to
  STEP.orbax-checkpoint-tmp-* until orbax commits them)."""
  from orbax.checkpoint._src.serialization import serialization

  write = serialization.async_serialize_from_host
  seen = []

  async def writing(replica_slices, tensorstore_spec, *args, **kwargs):
    if not seen and f"/{step}.orbax-checkpoint-tmp" in str(tensorstore_spec):
      seen.append(step)
      await fault()
    return await write(replica_slices, tensorstore_spec, *args, **kwargs)

  serialization.async_serialize_from_host = writing


def full_disk_at_save(step: int, marks: str) -> None:
  import orbax.checkpoint as ocp

  save = ocp.CheckpointManager.save

  def saving(self, save_step, *args, **kwargs):
    if save_step == step:
      mark(marks, "failed")
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return save(self, save_step, *args, **kwargs)

  ocp.CheckpointManager.save = saving


def at_write_fault(marks: str) -> None:
  with open(os.path.join(marks, "write-fault-at"), "w") as f:
    f.write(repr(time.monotonic()))


def fill_disk(path: str) -> None:
  """Write `path` until the file system is full."""
  block = b"\0" * (1 << 16)
  with open(path, "wb", buffering=0) as f:
    while True:
      try:
        f.write(block)
      except OSError as e:
        if e.errno != errno.ENOSPC:
          raise
        if len(block) == 1:
          return
        block = block[:len(block) // 16]


def write_fault(kind: str, marks: str):
  async def fault():
    at_write_fault(marks)
    if kind == "fail":
      raise OSError(errno.EIO, "injected I/O error")
    if kind == "hang":
      while True:
        await asyncio.sleep(3600)
    fill_disk(os.path.join(marks, "filler"))

  return fault


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--marks", required=True)
  parser.add_argument("--pause_step", type=int)
  parser.add_argument("--pause_save", type=int)
  parser.add_argument("--full_disk_save", type=int)
  for kind in ("fail", "hang", "fill_disk"):
    parser.add_argument(f"--{kind}_write", type=int)
  parser.add_argument("command", nargs="+")
  args = parser.parse_args()
  faulthandler.register(signal.SIGUSR1, all_threads=True)  # a test's timeout shows the stacks
  if args.pause_step is not None:
    pause_in_step(args.pause_step, args.marks)
  if args.pause_save is not None:
    async def pause():
      mark(args.marks, "paused")
      while not resumed(args.marks):
        await asyncio.sleep(POLL_S)

    on_first_write_of(args.pause_save, pause)
  if args.full_disk_save is not None:
    full_disk_at_save(args.full_disk_save, args.marks)
  for kind in ("fail", "hang", "fill_disk"):
    if getattr(args, f"{kind}_write") is not None:
      on_first_write_of(getattr(args, f"{kind}_write"), write_fault(kind, args.marks))
  sys.argv = args.command
  runpy.run_path(args.command[0], run_name="__main__")


if __name__ == "__main__":
  main()
