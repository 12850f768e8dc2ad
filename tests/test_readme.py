"""README.md run as a new user runs it: every command of its ```bash blocks, in order, as
written, in a fresh copy of the repository (no runs/ yet), each in its own process. Only
size-shrinking overrides are appended (`SHRINK`: steps, examples, a tiny model of the same
architecture); absl and ml_collections take the last value of a flag given twice. The setup
steps of a command (a virtualenv, pip installs) are recognised and left out: the rest of the
command runs in this environment. Commands this machine cannot run are skipped by name, with
the reason (`SKIPPED`). A command the test knows neither how to shrink nor why to skip fails
it, so a new README command is covered when it is added.
"""

import json
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The setup steps of a command, recognised and left out (this environment has them).
SETUP_STEP = re.compile(r"python3? -m venv \S+|\. \S+/bin/activate|pip install .+")

# The model of each recipe at the tests' tiny size (same architecture, a few thousand weights).
TINY_MODEL = [f"--config.model.{key}={value}" for key, value in (
    ("num_layers", 1), ("hidden_size", 16), ("intermediate_size", 24), ("num_heads", 2),
    ("num_kv_heads", 1), ("head_dim", 8), ("global_head_dim", 8), ("num_global_kv_heads", 1),
    ("num_experts", 4), ("moe_intermediate_size", 8), ("moe_tile_size", 8))]
TWO_STEPS = ["--config.num_train_steps=2", "--config.optimizer.warmup_steps=1"]

# (script, --config value or None): the overrides appended to its commands.
SHRINK = {
    ("train.py", "sft_sudoku"): TWO_STEPS + TINY_MODEL + [
        "--config.batch_size=4", "--config.eval.num_puzzles=4", "--config.eval.batch_size=4"],
    ("train.py", "sft_chat:sort"): TWO_STEPS + TINY_MODEL + [
        "--config.batch_size=4", "--config.eval.num_examples=4", "--config.eval.batch_size=4"],
    # The architecture comes from --init_from (the tiny SFT run above).
    ("train.py", "sdrl_sudoku"): TWO_STEPS + [
        "--config.sdrl.group_size=2", "--config.sdrl.prompts_per_rollout=2",
        "--config.sdrl.states_per_trajectory=2", "--config.sdrl.anchor_batch_size=4",
        "--config.sdrl.rollout_sampler.max_denoising_steps=4", "--config.eval.num_puzzles=4",
        "--config.eval.batch_size=4"],
    ("eval.py", None): ["--limit=4"],
    ("sample.py", None): [],
    ("scripts/make_sudoku_csv.py", None): ["--num=8"],
    ("scripts/make_chat_task.py", None): ["--num=16"],
    ("scripts/convert_checkpoint.py", None): [],
}

# A piece of a command -> why commands holding it are not run here.
SKIPPED = {
    "python -m pytest": "the suite itself (CI runs it; run here it would recurse)",
    "/ckpt/diffusiongemma-26b-a4b-it": "needs the 26B-A4B checkpoint (tests/test_parity.py and "
                                       "tests/test_checkpoint_io.py cover these paths on tiny "
                                       "checkpoints)",
    "--config=sft_sudoku_lora --dry_run": "compiles the 26B-A4B update step (minutes and GiB on "
                                          "a CPU; tests/test_lora.py dry-runs "
                                          "sft_sudoku_lora_tiny)",
}


def readme_text() -> str:
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    return f.read()


def readme_commands() -> list[str]:
  """The commands of README.md's ```bash blocks, in order: continuations joined, comments and
  blank lines dropped."""
  text = readme_text()
  commands = []
  for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
    for line in re.sub(r"\\\n[ \t]*", " ", block).splitlines():
      line = line.strip()
      if line and not line.startswith("#"):
        commands.append(line)
  return commands


def without_setup(command: str) -> list[str]:
  """The steps of a `&&` chain that are not setup steps (SETUP_STEP)."""
  steps = [step.strip() for step in command.split("&&")]
  return [step for step in steps if not SETUP_STEP.fullmatch(step)]


def shrink_key(argv: list[str]) -> tuple[str, str | None]:
  """(script, --config value) of `python SCRIPT ARGS...`."""
  config = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  return argv[1], config


def plan() -> tuple[list[tuple[str, list[str]]], list[tuple[str, str]], list[str]]:
  """(runs: [(step as written, argv to run)], skipped: [(command, reason)], unknown: steps
  the test cannot shrink)."""
  runs, skipped, unknown = [], [], []
  for command in readme_commands():
    reason = next((why for piece, why in SKIPPED.items() if piece in command), None)
    if reason:
      skipped.append((command, reason))
      continue
    for step in without_setup(command):
      argv = shlex.split(step)
      key = shrink_key(argv) if len(argv) > 1 and argv[0] in ("python", "python3") else None
      if key not in SHRINK:
        unknown.append(step)
        continue
      runs.append((step, [sys.executable, *argv[1:], *SHRINK[key]]))
  return runs, skipped, unknown


def fresh_copy(destination: str) -> None:
  """The repository as a fresh clone has it: no hidden folders, caches or runs."""
  ignore = shutil.ignore_patterns("__pycache__", ".*", "runs", "export")
  for name in os.listdir(ROOT):
    source = os.path.join(ROOT, name)
    if name.startswith(".") or name in ("runs", "export"):
      continue
    if os.path.isdir(source):
      shutil.copytree(source, os.path.join(destination, name), ignore=ignore)
    else:
      shutil.copy2(source, destination)


def test_the_plan_covers_the_readme():
  """Every README command is run (shrunk) or skipped with its reason; every entry of SHRINK and
  SKIPPED is still used (no stale names)."""
  fences = re.findall(r"^```(\w*)$", readme_text(), re.M)
  assert fences[::2] and set(fences[::2]) == {"bash"}, (
      f"README.md code blocks must be ```bash (this test runs them): {fences[::2]}")
  runs, skipped, unknown = plan()
  assert not unknown, ("README.md runs commands tests/test_readme.py does not know how to "
                       f"shrink; add them to SHRINK (or SKIPPED, with the reason): {unknown}")
  used = {shrink_key(shlex.split(step)) for step, _ in runs}
  assert set(SHRINK) == used, f"SHRINK entries no README command uses: {set(SHRINK) - used}"
  pieces = {piece for piece in SKIPPED if any(piece in c for c, _ in skipped)}
  assert set(SKIPPED) == pieces, f"SKIPPED entries matching nothing: {set(SKIPPED) - pieces}"
  assert any(s.startswith("python train.py") for s, _ in runs), "no training command found"
  # The setup steps are recognised, and only they are left out.
  assert without_setup("python3 -m venv .venv && . .venv/bin/activate && pip install -r "
                       "requirements.txt && python train.py --config=X") == [
                           "python train.py --config=X"]


def test_readme_commands_run_in_a_fresh_clone(tmp_path):
  runs, skipped, _ = plan()
  clone = tmp_path / "clone"
  clone.mkdir()
  fresh_copy(str(clone))
  # The clone's package, as its editable install would import it (not this checkout's).
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(clone))
  timings = []
  for step, argv in runs:
    start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(argv, cwd=clone, capture_output=True, text=True, env=env, timeout=300)
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
    timings.append(f"{time.perf_counter() - start:5.1f} s ({cpu_seconds:5.1f} s CPU)  "
                   f"{step[:90]}")
    assert r.returncode == 0, (f"README command failed (exit {r.returncode}), run as\n  "
                               f"{shlex.join(argv[1:])}\n{r.stderr[-3000:]}")
    if argv[1] == "eval.py":  # its last line: one JSON object of metrics naming the headline
      metrics = json.loads(r.stdout.strip().splitlines()[-1])
      assert metrics["headline_metric"] in metrics
  print("\n".join(timings + [f"skipped: {c[:80]} ({why})" for c, why in skipped]))
  assert os.path.isdir(clone / "runs" / "chat" / "sort" / "checkpoints")
