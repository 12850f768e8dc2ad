"""Start N processes of one multi-process run on this machine, as a cluster launcher would.

  python scripts/launch_local.py --num_processes=2 -- train.py --config=sft_sudoku \
      --workdir=/tmp/run --config.sharding.fsdp=2
  python scripts/launch_local.py --num_processes=4 --devices_per_process=2 -- eval.py ...

Each process gets the coordinator (a free localhost port), the process count and its index
through DIFFGEMMA_COORDINATOR / DIFFGEMMA_NUM_PROCESSES / DIFFGEMMA_PROCESS_ID (see
diffgemma/runs/distributed.py). With --platform=cpu (the default) each process simulates
--devices_per_process CPU devices and the collectives go through gloo; with --platform=gpu
process i sees GPUs i*D .. (i+1)*D-1. Every line a process prints is prefixed with its index
("[1] ..."), stdout to stdout and stderr to stderr.

The launcher exits with the first non-zero exit status (a process killed by signal S counts as
128+S), or 0 when every process ended with 0. After the first failure the others get
--grace_s seconds to stop on their own (a multi-process run stops when one of its processes is
lost, with one line naming it); then they are killed. Ctrl-C (SIGINT) and SIGTERM are passed on
to every process, once: the processes run in their own process group, so a Ctrl-C in the
terminal reaches them only through the launcher (train.py then stops every process at the same
step with a checkpoint and exits 0; a second Ctrl-C interrupts).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import flags

from diffgemma import cli

# Its own flag set: the scripts it starts define flags of the same names (--num_processes).
FLAGS = flags.FlagValues()
_NUM = flags.DEFINE_integer("num_processes", 2, "Processes to start.", lower_bound=1,
                            flag_values=FLAGS)
_DEVICES = flags.DEFINE_integer("devices_per_process", 1, "Devices each process sees.",
                                lower_bound=1, flag_values=FLAGS)
_PLATFORM = flags.DEFINE_enum("platform", "cpu", ["cpu", "gpu"],
                              "cpu: simulated CPU devices; gpu: this machine's GPUs, split.",
                              flag_values=FLAGS)
_GRACE = flags.DEFINE_float("grace_s", 90.0, "After one process fails, how long the others may "
                            "take to stop on their own before they are killed.",
                            flag_values=FLAGS)
_POLL_S = 0.2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def process_env(index: int, count: int, devices: int, platform: str, coordinator: str) -> dict:
  """The environment of process `index`: the run's coordinates and its devices."""
  env = dict(os.environ, DIFFGEMMA_COORDINATOR=coordinator,
             DIFFGEMMA_NUM_PROCESSES=str(count), DIFFGEMMA_PROCESS_ID=str(index),
             PYTHONUNBUFFERED="1")
  if platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""),
                                 f"--xla_force_host_platform_device_count={devices}"]).strip()
  else:
    env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(index * devices + d) for d in range(devices))
  return env


def _pump(stream, out, prefix: str) -> None:
  """Copy a child's output line by line, each line prefixed with the child's index."""
  for line in iter(stream.readline, b""):
    out.buffer.write(prefix.encode() + line)
    out.flush()
  stream.close()


def exit_status(code: int) -> int:
  return 128 - code if code < 0 else code


def launch(command: list[str], count: int, devices: int = 1, platform: str = "cpu",
           grace_s: float = 90.0) -> int:
  coordinator = f"localhost:{free_port()}"
  script = command[0]
  if not os.path.isfile(script) and os.path.isfile(os.path.join(ROOT, script)):
    script = os.path.join(ROOT, script)
  children, pumps = [], []

  def forward(signum, frame):
    del frame
    for child in children:
      if child.poll() is None:
        child.send_signal(signum)

  # Before the first start: the children run in their own process group, so a signal that
  # killed the launcher would not reach them.
  signal.signal(signal.SIGINT, forward)
  signal.signal(signal.SIGTERM, forward)
  for index in range(count):
    child = subprocess.Popen([sys.executable, script, *command[1:]],
                             env=process_env(index, count, devices, platform, coordinator),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             process_group=0)  # the terminal's Ctrl-C comes through `forward`
    children.append(child)
    print(f"[launch] process {index}: pid {child.pid}", file=sys.stderr, flush=True)
    for stream, out in ((child.stdout, sys.stdout), (child.stderr, sys.stderr)):
      pump = threading.Thread(target=_pump, args=(stream, out, f"[{index}] "), daemon=True)
      pump.start()
      pumps.append(pump)

  first_failure, deadline = None, None
  while [child.poll() for child in children].count(None):  # poll every child, each round
    if first_failure is None:
      failed = [c for c in children if c.returncode not in (None, 0)]
      if failed:
        first_failure = exit_status(failed[0].returncode)
        deadline = time.monotonic() + grace_s
    elif time.monotonic() > deadline:
      for index, child in enumerate(children):
        if child.poll() is None:
          print(f"[launch] killing process {index} (still running {grace_s:g} s after the "
                "first failure)", file=sys.stderr, flush=True)
          child.kill()
    time.sleep(_POLL_S)
  for pump in pumps:
    pump.join()
  if first_failure is None:
    first_failure = next((exit_status(c.returncode) for c in children if c.returncode), 0)
  return first_failure


def main(argv: list[str]) -> int:
  ours, command = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (
      argv, [])
  help_wanted = cli.help_requested(ours)
  if help_wanted:
    print(cli.command_help(help_wanted == "full", FLAGS))
    return 0
  try:
    FLAGS(ours)
  except flags.Error as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  if not command:
    print("error: give the script to run after --, e.g. -- train.py --config=...",
          file=sys.stderr)
    return 2
  return launch(command, _NUM.value, _DEVICES.value, _PLATFORM.value, _GRACE.value)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
