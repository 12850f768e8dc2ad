"""Run every known bad input through the command-line tools and print the outcomes as a table.

  python scripts/check_bad_inputs.py [--out=benchmarks/bad_inputs.md] [--only=lock,resume]

Each case runs train.py, eval.py, sample.py or a script in a subprocess, on a tiny Sudoku model
(tests/tiny_sudoku_config.py, or the chat task's byte-level config) in a temporary directory,
and checks the contract: a bad input ends with exit code 2 (3: a run its own guard stopped,
such as a divergence) and exactly one `error:` line on stderr, never a traceback; a recoverable
problem (a damaged newest checkpoint, a stale lock) is a one-line notice and the tool goes on.
The table lists the command, the exit code and the message. Exit status: 0 if every case holds.
Takes a few minutes on a 2-core CPU (a few cases train a few steps).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from absl import app, flags  # noqa: E402

_OUT = flags.DEFINE_string("out", None, "Also write the table (markdown) to this file.")
_ONLY = flags.DEFINE_list("only", None, "Run only the cases whose area or name contains one of "
                          "these words.")

TINY = "--config=tests/tiny_sudoku_config.py"
# tqdm progress bars and the notices a tool prints before going on are not error lines.
NOTICE = re.compile(r"^(warning: |note: |moved damaged |using checkpoint |resumed from |"
                    r"changed on resume)")
PROGRESS = re.compile(r"^\s*(train|sft|eval|sdrl):")


@dataclasses.dataclass
class Case:
  area: str
  name: str
  argv: list[str]  # the tool and its flags; {tmp}, {run}, {csv} are filled in
  expect: str = "error"  # "error": exit `code` + one error line; "ok": exit 0 (+ notices)
  needle: str = ""  # a word the message must contain
  setup: Callable[[dict], None] | None = None  # prepares files; gets the paths dict
  check: Callable[[dict], str | None] | None = None  # afterwards: a problem, or None
  wrap: list[str] | None = None  # a command the tool runs under (e.g. a small tmpfs)
  code: int = 2  # the exit code of an "error" case (3: a run stopped by its own guard)


def _python():
  return sys.executable


def run_case(case: Case, paths: dict) -> dict:
  if case.setup:
    case.setup(paths)
  argv = [a.format(**paths) for a in case.argv]
  cmd = [_python(), *argv]
  if case.wrap:
    cmd = [w.format(**paths) for w in case.wrap] + [" ".join(_quote(c) for c in cmd)]
  env = _env(paths)
  start = time.time()
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
  seconds = time.time() - start
  err_lines = [l.split("\r")[-1] for l in r.stderr.splitlines()]
  err_lines = [l for l in err_lines if l.strip() and not PROGRESS.match(l)]
  errors = [l for l in err_lines if not NOTICE.match(l)]
  notices = [l for l in err_lines + r.stdout.splitlines() if NOTICE.match(l.strip())]
  problems = []
  if "Traceback" in r.stderr or "Traceback" in r.stdout:
    problems.append("traceback")
  if case.expect == "error":
    if r.returncode != case.code:
      problems.append(f"exit {r.returncode}")
    if len(errors) != 1 or not errors[0].startswith("error: "):
      problems.append(f"{len(errors)} error lines")
    message = errors[-1] if errors else (r.stdout.strip().splitlines() or [""])[-1]
  else:
    if r.returncode != 0:
      problems.append(f"exit {r.returncode}")
    if errors:
      problems.append(f"{len(errors)} unexpected stderr lines")
    message = " / ".join(notices) or "(no notice)"
  if case.needle and case.needle not in message:
    problems.append(f"message lacks {case.needle!r}")
  if case.check:
    extra = case.check(paths)
    if extra:
      problems.append(extra)
  shown = " ".join(_quote(a) for a in argv).replace(paths["tmp"], "$TMP")
  return {"area": case.area, "name": case.name, "command": shown, "exit": r.returncode,
          "message": message.replace(paths["tmp"], "$TMP").strip(), "seconds": seconds,
          "ok": not problems, "problems": problems,
          "stderr": r.stderr if problems else ""}


def _env(paths: dict) -> dict:
  """CPU only; one XLA compilation cache for every run of the check (compiles dominate)."""
  return dict(os.environ, JAX_PLATFORMS="cpu",
              JAX_COMPILATION_CACHE_DIR=os.path.join(paths["tmp"], "xla_cache"),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _quote(arg: str) -> str:
  return arg if re.fullmatch(r"[\w./=:,+@%-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


# ----------------------------------------------------------------------------- fixtures


def _train(paths: dict, *extra: str) -> None:
  r = subprocess.run([_python(), "train.py", TINY, f"--workdir={paths['run']}",
                      "--config.num_train_steps=4", "--config.checkpoint_every=2", *extra],
                     cwd=ROOT, capture_output=True, text=True, env=_env(paths))
  if r.returncode:
    raise SystemExit(f"fixture run failed:\n{r.stderr}")


def make_fixtures(tmp: str) -> dict:
  """A trained tiny run (steps 2 and 4), a CSV of puzzles, and paths for the cases."""
  from diffgemma.tasks import sudoku_puzzles

  paths = {"tmp": tmp, "run": os.path.join(tmp, "run"), "csv": os.path.join(tmp, "p.csv")}
  _train(paths)
  sudoku_puzzles.write_csv(paths["csv"], *sudoku_puzzles.generate_puzzles(0, 2, 40, 44))
  return paths


def _copy_run(paths: dict, name: str) -> str:
  dest = os.path.join(paths["tmp"], name)
  shutil.rmtree(dest, ignore_errors=True)
  shutil.copytree(paths["run"], dest)
  return dest


def _data_files(step_dir: str) -> list[str]:
  return [os.path.join(d, f) for d, _, names in os.walk(step_dir) for f in names
          if f"{os.sep}d{os.sep}" in os.path.join(d, f)]


def damaged_run(paths: dict, every_file: bool = False) -> None:
  """Step 4 with its largest data file cut in half (a trainer, which restores everything,
  notices), or with every data file cut (eval reads the parameters only, and the largest file
  may hold optimizer state alone)."""
  run = _copy_run(paths, "damaged")
  files = _data_files(os.path.join(run, "checkpoints", "4"))
  for target in files if every_file else [max(files, key=os.path.getsize)]:
    os.truncate(target, os.path.getsize(target) // 2)


def all_damaged_run(paths: dict) -> None:
  run = _copy_run(paths, "all_damaged")
  for step in ("2", "4"):
    os.remove(os.path.join(run, "checkpoints", step, "default", "manifest.ocdbt"))


def corrupt_config_run(paths: dict) -> None:
  run = _copy_run(paths, "bad_json")
  with open(os.path.join(run, "config.json"), "w") as f:
    f.write('{"batch_size": 4,')


def copy_for(name: str) -> Callable[[dict], None]:
  return lambda paths: _copy_run(paths, name)


def stale_lock_run(paths: dict) -> None:
  run = _copy_run(paths, "stale_lock")
  child = subprocess.Popen([_python(), "-c", "pass"])
  child.wait()
  from diffgemma.runs import workdir_lock

  with open(workdir_lock.lock_path(run), "w") as f:
    json.dump(dict(workdir_lock.holder_info(), pid=child.pid, process_start=1), f)


class _HeldLock:
  """Holds a workdir's lock from this process (a stand-in for a running trainer)."""

  def __init__(self):
    self.context = None

  def setup(self, paths: dict) -> None:
    from diffgemma.runs import workdir_lock

    run = _copy_run(paths, "busy")
    self.context = workdir_lock.hold(run)
    self.context.__enter__()

  def release(self, paths: dict) -> None:
    self.context.__exit__(None, None, None)
    return None


def no_config_left(name: str) -> Callable[[dict], str | None]:
  def check(paths):
    path = os.path.join(paths["tmp"], name)
    return f"{path} was written" if os.path.exists(path) else None
  return check


def write_file(name: str, text: str) -> Callable[[dict], None]:
  def setup(paths):
    with open(os.path.join(paths["tmp"], name), "w") as f:
      f.write(text)
  return setup


def bad_solution_csv(paths: dict) -> None:
  from diffgemma.tasks import sudoku_puzzles

  puzzles, solutions = sudoku_puzzles.generate_puzzles(1, 1, 40, 40)
  quiz = "".join(map(str, puzzles[0]))
  solution = "".join(map(str, solutions[0]))
  solution = solution[:-1] + ("1" if solution[-1] != "1" else "2")
  with open(os.path.join(paths["tmp"], "bad_solution.csv"), "w") as f:
    f.write(f"quizzes,solutions\n{quiz},{solution}\n")


def _tmpfs_available() -> bool:
  probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                         capture_output=True)
  return probe.returncode == 0


# ----------------------------------------------------------------------------- the cases


def cases() -> list[Case]:
  held = _HeldLock()
  train = ["train.py", TINY, "--workdir={tmp}/new"]
  conf = lambda *overrides, needle="": Case(
      "config", " ".join(overrides), train + list(overrides), needle=needle,
      check=no_config_left("new"))
  puzzle = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"
  out = [
      conf("--config.batch_size=0", needle="batch_size"),
      conf("--config.batch_size=abc", needle="batch_size"),
      conf("--config.batch_size=2.5", needle="batch_size"),
      conf("--config.optimizer.lr=-0.001", needle="optimizer.lr"),
      conf("--config.optimizer.lr=0", needle="optimizer.lr"),
      conf("--config.optimizer.lr=fast", needle="optimizer.lr"),
      conf("--config.optimizer.lr=nan", needle="optimizer.lr"),
      conf("--config.num_train_steps=10", "--config.optimizer.warmup_steps=50",
           needle="warmup_steps"),
      conf("--config.num_train_steps=0", needle="num_train_steps"),
      conf("--config.keep_checkpoints=0", needle="keep_checkpoints"),
      conf("--config.checkpoint_every=0", needle="checkpoint_every"),
      conf("--config.log_every=-1", needle="log_every"),
      conf("--config.max_train_minutes=-5", needle="max_train_minutes"),
      conf("--config.grad_accum_steps=3", needle="grad_accum_steps"),
      conf("--config.optimizer.schedule=linear", needle="schedule"),
      conf("--config.optimizer.b2=1.5", needle="optimizer.b2"),
      conf("--config.optimizer.grad_clip=0", needle="grad_clip"),
      conf("--config.loss.noise_schedule=cubic", needle="noise_schedule"),
      conf("--config.loss.decoder_weighting=sqrt", needle="decoder_weighting"),
      conf("--config.loss.self_conditioning_prob=2", needle="self_conditioning_prob"),
      conf("--config.loss.decoder_weight=0", needle="both 0"),
      conf("--config.data.prompt_format=words", needle="prompt_format"),
      conf("--config.data.min_givens=10", needle="min_givens"),
      conf("--config.data.seed=-1", needle="data.seed"),
      conf("--config.model.num_kv_heads=0", needle="num_kv_heads"),
      conf("--config.model.head_dim=7", needle="head_dim"),
      conf("--config.model.moe_impl=magic", needle="moe_impl"),
      conf("--config.model.param_dtype=float8", needle="param_dtype"),
      conf("--config.model.vocab_size=8", needle="vocab_size"),
      conf("--config.model.top_k_experts=9", needle="top_k_experts"),
      conf("--config.sampler.max_new_tokens=40", needle="max_new_tokens"),
      conf("--config.sampler.t_min=0.9", needle="t_min"),
      conf("--config.eval.batch_size=0", needle="eval.batch_size"),
      conf("--config.lora.enabled=True", "--config.lora.rank=0", needle="lora.rank"),
      conf("--config.optimizer.lrr=1", needle="optimizer.lrr"),
      Case("config", "unknown config name", ["train.py", "--config=nope", "--workdir={tmp}/new"],
           needle="nope"),
      Case("config", "config file missing", ["train.py", "--config=/no/such/config.py",
                                             "--workdir={tmp}/new"], needle="not found"),
      Case("train", "no --workdir", ["train.py", TINY], needle="--workdir"),
      Case("train", "--workdir is a file", ["train.py", TINY, "--workdir={csv}"],
           needle="workdir"),
      Case("train", "--init_from missing", train + ["--init_from={tmp}/nowhere"],
           needle="not found", check=no_config_left("new/config.json")),
      Case("train", "second trainer on a busy workdir", ["train.py", TINY, "--workdir={tmp}/busy"],
           needle="in use by another trainer", setup=held.setup, check=held.release),
      Case("train", "stale lock of a dead trainer (notice, resumes)",
           ["train.py", TINY, "--workdir={tmp}/stale_lock", "--config.num_train_steps=4",
            "--config.checkpoint_every=2"], expect="ok", needle="taking over the lock",
           setup=stale_lock_run),
      Case("train", "resume with model.num_layers changed",
           ["train.py", TINY, "--workdir={tmp}/arch", "--config.num_train_steps=4",
            "--config.checkpoint_every=2", "--config.model.num_layers=3"],
           needle="model.num_layers", setup=copy_for("arch")),
      Case("train", "resume with optimizer.lr and data.seed changed",
           ["train.py", TINY, "--workdir={tmp}/lr", "--config.num_train_steps=4",
            "--config.checkpoint_every=2", "--config.optimizer.lr=0.01", "--config.data.seed=3"],
           needle="data.seed", setup=copy_for("lr")),
      Case("train", "resume with num_train_steps 4 -> 5, log_every 1 -> 2 (safe: applied, logged)",
           ["train.py", TINY, "--workdir={tmp}/longer", "--config.num_train_steps=5",
            "--config.checkpoint_every=2", "--config.log_every=2"], expect="ok",
           needle="num_train_steps: 4 -> 5", setup=copy_for("longer"),
           check=lambda p: None if json.load(open(f"{p['tmp']}/longer/config_history.json"))[0][
               "step"] == 4 else "no history entry at step 4"),
      Case("train", "resume: newest checkpoint truncated (notice, falls back)",
           ["train.py", TINY, "--workdir={tmp}/damaged", "--config.num_train_steps=4",
            "--config.checkpoint_every=2"], expect="ok", needle="moved damaged checkpoint step 4",
           setup=damaged_run),
      Case("train", "resume: every checkpoint unreadable",
           ["train.py", TINY, "--workdir={tmp}/all_damaged", "--config.num_train_steps=4",
            "--config.checkpoint_every=2"], needle="nothing was moved", setup=all_damaged_run),
      Case("train", "resume: config.json corrupted",
           ["train.py", TINY, "--workdir={tmp}/bad_json", "--config.num_train_steps=4"],
           needle="not valid JSON", setup=corrupt_config_run),
      Case("train", "data pipeline cannot make puzzles (18 givens)",
           train + ["--config.data.start_min_givens=18", "--config.data.start_max_givens=18",
                    "--config.data.min_givens=18", "--config.data.max_givens=18",
                    "--config.data.curriculum_steps=0"], needle="data pipeline failed"),
      Case("train", "divergence: lr=1e3 (no non-finite checkpoint is saved)",
           ["train.py", TINY, "--workdir={tmp}/diverge", "--config.num_train_steps=40",
            "--config.checkpoint_every=1", "--config.optimizer.lr=1e3"],
           needle="non-finite", code=3,
           check=lambda p: _finite_checkpoints_only(f"{p['tmp']}/diverge")),
      Case("eval", "no --data", ["eval.py", "--workdir={run}"], needle="--data"),
      Case("eval", "--data missing", ["eval.py", "--workdir={run}", "--data={tmp}/no.csv"],
           needle="not found"),
      Case("eval", "--data is a directory", ["eval.py", "--workdir={run}", "--data={tmp}"],
           needle="is a directory"),
      Case("eval", "--limit=0", ["eval.py", "--workdir={run}", "--data={csv}", "--limit=0"],
           needle="--limit"),
      Case("eval", "--batch_size=0", ["eval.py", "--workdir={run}", "--data={csv}",
                                      "--batch_size=0"], needle="--batch_size"),
      Case("eval", "--batch_size=-4", ["eval.py", "--workdir={run}", "--data={csv}",
                                       "--batch_size=-4"], needle="--batch_size"),
      Case("eval", "--workdir and --init_from", ["eval.py", "--workdir={run}",
                                                 "--init_from={run}", "--data={csv}"],
           needle="not both"),
      Case("eval", "--workdir without a run", ["eval.py", "--workdir={tmp}/nothing",
                                               "--data={csv}"], needle="no training run"),
      Case("eval", "--init_from missing", ["eval.py", "--init_from={tmp}/nowhere",
                                           "--data={csv}"], needle="not found"),
      Case("eval", "CSV with a wrong header", ["eval.py", "--workdir={run}",
                                               "--data={tmp}/header.csv"],
           needle="expected header", setup=write_file("header.csv", "a,b\n1,2\n")),
      Case("eval", "CSV solution that is not a valid grid", ["eval.py", "--workdir={run}",
                                                           "--data={tmp}/bad_solution.csv"],
           needle="line 2", setup=bad_solution_csv),
      Case("eval", "CSV empty", ["eval.py", "--workdir={run}", "--data={tmp}/empty.csv"],
           needle="empty", setup=write_file("empty.csv", "")),
      Case("eval", "CSV header only", ["eval.py", "--workdir={run}", "--data={tmp}/none.csv"],
           needle="no examples", setup=write_file("none.csv", "quizzes,solutions\n")),
      Case("eval", "newest checkpoint truncated (notice, uses the older)",
           ["eval.py", "--workdir={tmp}/damaged_eval", "--data={csv}", "--limit=1",
            "--batch_size=1"], expect="ok", needle="using checkpoint step 2",
           setup=lambda p: (damaged_run(p, every_file=True),
                            os.rename(f"{p['tmp']}/damaged", f"{p['tmp']}/damaged_eval")),
           check=lambda p: None if os.path.isdir(f"{p['tmp']}/damaged_eval/checkpoints/4")
           else "eval moved a checkpoint"),
      Case("eval", "every checkpoint unreadable", ["eval.py", "--workdir={tmp}/all_damaged",
                                                   "--data={csv}"],
           needle="can be restored", setup=all_damaged_run),
      Case("sample", "givens conflict", ["sample.py", "--workdir={run}",
                                         "--puzzle=55" + "." * 79], needle="given twice"),
      Case("sample", "givens admit no solution", ["sample.py", "--workdir={run}",
                                                  "--puzzle=12345678." + "." * 8 + "9" + "." * 63],
           needle="no solution"),
      Case("sample", "puzzle of 80 characters", ["sample.py", "--workdir={run}",
                                                 "--puzzle=" + "1" * 80], needle="80"),
      Case("sample", "puzzle with a letter", ["sample.py", "--workdir={run}",
                                              "--puzzle=x" + puzzle[1:]], needle="'x'"),
      Case("sample", "no arguments", ["sample.py"], needle="--workdir"),
      Case("sample", "a text prompt to a Sudoku run", ["sample.py", "--workdir={run}",
                                                      "--prompt=hi"], needle="expected 81"),
      Case("sample", "--workdir without a run", ["sample.py", "--workdir={tmp}/nothing",
                                                 "--puzzle=" + puzzle], needle="no training run"),
      Case("sample", "--init_from missing", ["sample.py", "--init_from={tmp}/nowhere",
                                             "--prompt=hi"], needle="not found"),
      Case("sample", "--max_new_tokens=0", ["sample.py", "--init_from={run}", "--prompt=hi",
                                            "--max_new_tokens=0"], needle="max_new_tokens"),
      Case("sample", "empty --prompt", ["sample.py", "--init_from={run}", "--prompt= "],
           needle="empty"),
      Case("sample", "--dtype=int8", ["sample.py", "--init_from={run}", "--prompt=hi",
                                      "--dtype=int8"], needle="dtype"),
      Case("convert", "--from missing", ["scripts/convert_checkpoint.py", "--from={tmp}/nowhere",
                                         "--to={tmp}/out"], needle="not found"),
      Case("convert", "no --to", ["scripts/convert_checkpoint.py", "--from={run}"],
           needle="--to"),
      Case("convert", "--to exists", ["scripts/convert_checkpoint.py", "--from={run}",
                                      "--to={tmp}"], needle="already exists"),
      Case("convert", "--format=gguf", ["scripts/convert_checkpoint.py", "--from={run}",
                                        "--to={tmp}/out", "--format=gguf"], needle="format"),
      Case("convert", "--max_shard_gb=0", ["scripts/convert_checkpoint.py", "--from={run}",
                                           "--to={tmp}/out", "--max_shard_gb=0"],
           needle="max_shard_gb"),
      Case("convert", "--canvas_length=0", ["scripts/convert_checkpoint.py", "--from={run}",
                                            "--to={tmp}/out", "--canvas_length=0"],
           needle="canvas_length"),
      Case("convert", "--from a directory that is no checkpoint",
           ["scripts/convert_checkpoint.py", "--from={tmp}/empty_dir", "--to={tmp}/out"],
           needle="config.json", setup=lambda p: os.makedirs(f"{p['tmp']}/empty_dir",
                                                             exist_ok=True)),
      Case("convert", "--from a run whose checkpoints are all unreadable",
           ["scripts/convert_checkpoint.py", "--from={tmp}/all_damaged", "--to={tmp}/out"],
           needle="can be restored", setup=all_damaged_run),
      Case("make_csv", "--num=0", ["scripts/make_sudoku_csv.py", "--out={tmp}/x.csv", "--num=0"],
           needle="--num"),
      Case("make_csv", "--min_givens=10", ["scripts/make_sudoku_csv.py", "--out={tmp}/x.csv",
                                           "--min_givens=10"], needle="min_givens"),
      Case("make_csv", "--min_givens above --max_givens",
           ["scripts/make_sudoku_csv.py", "--out={tmp}/x.csv", "--min_givens=50",
            "--max_givens=40"], needle="min_givens"),
      Case("make_csv", "--out in a missing directory",
           ["scripts/make_sudoku_csv.py", "--out={tmp}/no/dir/x.csv", "--num=1"],
           needle="directory"),
      Case("make_csv", "no --out", ["scripts/make_sudoku_csv.py"], needle="--out"),
      Case("make_csv", "--min_givens=18 (generator gives up)",
           ["scripts/make_sudoku_csv.py", "--out={tmp}/x.csv", "--min_givens=18",
            "--max_givens=18", "--num=1"], needle="18 givens"),
      Case("scalars", "--workdir without event files",
           ["scripts/print_scalars.py", "--workdir={tmp}/nothing"], needle="no scalars"),
      *chat_cases(),
  ]
  if _tmpfs_available():
    out.append(Case(
        "train", "disk full during a checkpoint save (900 KB tmpfs)",
        ["train.py", TINY, "--workdir={tmp}/mnt/run", "--config.num_train_steps=8",
         "--config.checkpoint_every=2"], needle="disk full",
        setup=lambda p: os.makedirs(f"{p['tmp']}/mnt", exist_ok=True),
        wrap=["unshare", "-m", "sh", "-c",
              "mount -t tmpfs -o size=900k tmpfs {tmp}/mnt && exec \"$0\" \"$@\"", "sh", "-c"]))
  return out


def chat_line(user: str, assistant: str | None) -> str:
  messages = [{"role": "user", "content": user}]
  if assistant is not None:
    messages.append({"role": "assistant", "content": assistant})
  return json.dumps({"messages": messages})


def chat_file(name: str, *lines: str) -> Callable[[dict], None]:
  """A JSONL file whose first line is a good conversation and whose next lines are `lines`."""
  return write_file(name, "\n".join([chat_line("Count from 1 to 3.", "1 2 3"), *lines]) + "\n")


def tokenizer_without_template(paths: dict) -> None:
  from tests.test_tokenizer import write_tokenizer_json  # a small Gemma-like tokenizer.json

  write_tokenizer_json(os.path.join(paths["tmp"], "tok_no_template"))
  chat_file("ok.jsonl")(paths)


def chat_cases() -> list[Case]:
  """The chat task's bad inputs: data, tokenizer, layout, and its scripts."""
  train = ["train.py", "--config=sft_chat", "--workdir={tmp}/chat_new"]
  data = lambda name: f"--config.data.train={{tmp}}/{name}"
  case = lambda name, argv, needle, setup=None: Case(
      "chat", name, argv, needle=needle, setup=setup, check=no_config_left("chat_new"))
  return [
      case("no --config.data.train", train, "data.train"),
      case("JSONL line that is not JSON", train + [data("notjson.jsonl")], "notjson.jsonl:2",
           chat_file("notjson.jsonl", "{not json")),
      case("conversation with no assistant turn", train + [data("noreply.jsonl")],
           "noreply.jsonl:2", chat_file("noreply.jsonl", chat_line("hi", None))),
      case("unknown role", train + [data("role.jsonl")], "role.jsonl:2",
           chat_file("role.jsonl", json.dumps({"messages": [
               {"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}))),
      case("tokenizer directory without a chat template",
           train + [data("ok.jsonl"), "--config.data.tokenizer={tmp}/tok_no_template"],
           "no chat template", tokenizer_without_template),
      case("prompt too long under data.overflow=error",
           train + [data("long.jsonl"), "--config.data.overflow=error"], "long.jsonl:2",
           chat_file("long.jsonl", chat_line("Count " * 40, "1"))),
      case("reply too long under data.overflow=error",
           train + [data("longreply.jsonl"), "--config.data.overflow=error"], "longreply.jsonl:2",
           chat_file("longreply.jsonl", chat_line("hi", "1 " * 200))),
      case("data.eval_fraction and data.eval both",
           train + [data("ok.jsonl"), "--config.data.eval_fraction=0.1",
                    "--config.data.eval={tmp}/ok.jsonl"], "not both", chat_file("ok.jsonl")),
      case("eval.metric=regex without eval.answer_regex",
           train + [data("ok.jsonl"), "--config.eval.metric=regex"], "answer_regex",
           chat_file("ok.jsonl")),
      case("data.weights of the wrong length",
           train + [data("ok.jsonl"), "--config.data.weights=1,2"], "data.weights",
           chat_file("ok.jsonl")),
      Case("chat", "make_chat_task --task=add", ["scripts/make_chat_task.py", "--task=add",
                                                  "--num=2", "--out={tmp}/t.jsonl"],
           needle="--task"),
      Case("chat", "convert_gsm8k: a line without ####",
           ["scripts/convert_gsm8k.py", "--train={tmp}/gsm.jsonl", "--out_dir={tmp}/gsm_out"],
           needle="gsm.jsonl:1",
           setup=write_file("gsm.jsonl", json.dumps({"question": "1+1?", "answer": "2"}) + "\n")),
  ]


def _finite_checkpoints_only(workdir: str) -> str | None:
  from diffgemma.runs import checkpointing, loaded

  if not checkpointing.steps_on_disk(workdir):
    return None
  import jax
  import numpy as np

  run = loaded.load_run(workdir)
  bad = [x for x in jax.tree_util.tree_leaves(run.params) if not np.isfinite(x).all()]
  return f"checkpoint step {run.step} holds non-finite values" if bad else None


def main(argv):
  del argv
  tmp = tempfile.mkdtemp(prefix="bad_inputs_")
  try:
    paths = make_fixtures(tmp)
    selected = [c for c in cases() if not _ONLY.value or any(
        w in c.area or w in c.name for w in _ONLY.value)]
    rows = []
    for i, case in enumerate(selected, 1):
      row = run_case(case, paths)
      rows.append(row)
      status = "ok" if row["ok"] else "FAIL " + ", ".join(row["problems"])
      print(f"[{i}/{len(selected)}] {case.area}: {case.name}: {status} ({row['seconds']:.0f} s)",
            file=sys.stderr)
      if not row["ok"]:
        print(row["stderr"][-3000:], file=sys.stderr)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  table = format_table(rows)
  print(table)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(HEADER.format(date=time.strftime("%Y-%m-%d")) + table + "\n")
  failed = [r for r in rows if not r["ok"]]
  print(f"{len(rows) - len(failed)} of {len(rows)} cases hold the contract", file=sys.stderr)
  sys.exit(1 if failed else 0)


HEADER = """# Bad inputs: every case tried, one line each

Generated by `python scripts/check_bad_inputs.py --out=benchmarks/bad_inputs.md` ({date}; the
tiny model of tests/tiny_sudoku_config.py, or `sft_chat`, in a temporary directory, `$TMP`).
"holds": exit code 2 (3 for a run stopped by its non-finite guard) with exactly one `error:`
line on stderr and no traceback, or, for a recoverable problem, exit
code 0 with one-line notices (shown joined by ` / `). The disk-full case needs `unshare -m` (a
private 900 KB tmpfs) and is skipped where that is not allowed.

"""


def format_table(rows: list[dict]) -> str:
  cell = lambda text: str(text).replace("|", "\\|")
  lines = ["| # | area | case | command | exit | message | holds |",
           "|---|---|---|---|---|---|---|"]
  for i, r in enumerate(rows, 1):
    lines.append(f"| {i} | {r['area']} | {cell(r['name'])} | `{cell(r['command'])}` | "
                 f"{r['exit']} | {cell(r['message'])} | {'yes' if r['ok'] else 'NO: ' + ', '.join(r['problems'])} |")
  return "\n".join(lines)


if __name__ == "__main__":
  app.run(main)
