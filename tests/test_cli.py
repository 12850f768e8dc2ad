"""The command-line contract: bad input ends with a one-line error naming the problem, and
every command answers --help."""

import importlib.metadata
import os
import re
import subprocess
import sys

import pytest

from configs import sft_sudoku
from diffgemma.runs import resume_config
from diffgemma.tasks import sudoku_puzzles
from tests.helpers import entry_points, run, run_in_one_process, one_line_error


def defined_flag_names(script: str) -> list[str]:
  """The flags a command's file defines (DEFINE_*("NAME", ...)), read from its source."""
  with open(script, encoding="utf-8") as f:
    return re.findall(r"DEFINE_\w+\(\s*[\"'](\w+)[\"']", f.read())


def test_every_command_answers_help(tmp_path):
  """--help (and --helpfull) on every entry point: exit status 0, the command's own flags with
  their help; train.py --config=NAME --help also lists the recipe's resolved keys and values.
  All in one process (a process per command would import jax 30 times)."""
  commands = entry_points()
  assert {"train.py", "eval.py", "sample.py", "scripts/sweep.py",
          "benchmarks/step_ab.py"} <= set(commands)
  argvs = [[c, "--help"] for c in commands] + [
      ["train.py", "--helpfull"],
      ["train.py", "--config=sft_sudoku", "--config.optimizer.lr=0.25", "--help"]]
  bad = [["train.py", "--config=sft_sudoku", "--config.optimizer.lrr=1", "--help"],
         ["eval.py", f"--workdir={tmp_path}", "--data=x.csv", "--sweep",
          "sampler.entropy_bound=0.1,0.2"]]  # renamed: one line naming the new flag
  results = run_in_one_process(argvs + bad)
  for argv, (code, out, err) in zip(argvs, results):
    assert code == 0, f"{argv}: exit {code}\n{err[-2000:]}"
    for name in defined_flag_names(argv[0]):
      assert re.search(rf"--(\[no\])?{name}\b", out), f"{argv}: --{name} missing"
  short, full = results[commands.index("train.py")][1], results[len(argvs) - 2][1]
  for text in (short, full):  # diffgemma's flags in both, absl's in --helpfull only
    assert "--[no]distributed" in text and ("--flagfile" in text) == (text is full)
  expected = sft_sudoku.get_config()
  expected.optimizer.lr = 0.25
  listed = dict(re.findall(r"^  ([\w.]+) = (.*)$", results[len(argvs) - 1][1], re.M))
  flat = resume_config.flatten(expected.to_dict())
  assert listed == {key: repr(value) for key, value in flat.items()}
  for (code, _, err), needle in zip(results[len(argvs):], ["optimizer.lrr", "--scan"]):
    one_line_error(subprocess.CompletedProcess([], code, "", err), needle)


def test_unknown_config_key(tmp_path):
  r = run("train.py", "--config=sft_sudoku", f"--workdir={tmp_path}", "--config.optimizer.lrr=1")
  one_line_error(r, "optimizer.lrr")
  assert not os.listdir(tmp_path)  # nothing written


def test_unknown_config_name(tmp_path):
  one_line_error(run("train.py", "--config=nope", f"--workdir={tmp_path}"), "nope", "sft_sudoku")


def test_inconsistent_config_value(tmp_path):
  r = run("train.py", "--config=sft_sudoku", f"--workdir={tmp_path}", "--config.model.vocab_size=8")  # the digits prompt needs 13 ids
  one_line_error(r, "vocab_size")


def test_out_of_range_integers_are_named():
  """An integer no 32-bit size, step or seed can hold is named by its key, not found deep in
  numpy or XLA."""
  from diffgemma import cli
  from diffgemma.training import run_config

  for override, key in (("batch_size=100000000000000000000000", "batch_size"),
                        ("model.hidden_size=-2147483649", "model.hidden_size")):
    config = cli.parse_config("configs/sft_sudoku.py", [f"--config.{override}"])
    with pytest.raises(ValueError, match=rf"^{re.escape(key)}=.*32-bit"):
      run_config.build(config)
  config = cli.parse_config("configs/sft_sudoku.py", ["--config.batch_size=2147483647"])
  run_config.check_integer_range(config.to_dict())  # the limit itself is allowed


def test_override_config_applies_keys_as_train_py_does():
  """The benchmarks' --config_overrides (cli.override_config) set a loaded config's keys, typed
  by the config, and name an unknown key or a bad value in one line."""
  from diffgemma import cli
  from diffgemma.errors import UserError

  base = cli.parse_config("configs/sft_chat.py:count", [])
  config = cli.override_config(base, ["data.train=/x/count.jsonl", "batch_size=3",
                                      "optimizer.lr=0.5"])
  assert (config.data.train, config.batch_size, config.optimizer.lr) == ("/x/count.jsonl", 3, 0.5)
  assert base.batch_size != 3  # the loaded config is not changed
  for assignment, message in (("nope=1", "unknown config key 'nope'"),
                              ("data.nope=1", "unknown config key 'data.nope'"),
                              ("data.seed=x", "--config.data.seed=x")):
    with pytest.raises(UserError, match=re.escape(message)):
      cli.override_config(base, [assignment])


def test_host_memory_exhausted_is_one_line():
  """numpy's MemoryError (a batch or layout too big for the host) ends in one line."""
  program = ("from diffgemma import cli\n"
             "def main(argv):\n"
             "  raise MemoryError('Unable to allocate 373. GiB for an array with shape "
             "(50000000000,) and data type int64')\n"
             "cli.run(main, ['tool'])\n")
  one_line_error(run("-c", program), "out of host memory", "373. GiB", "batch_size")


def test_depth_is_one_override():
  """The small recipes leave layer_types to the default pattern, so num_layers alone sets the
  depth (a sweep varies it as one key)."""
  from diffgemma import cli
  from diffgemma.model.config import ModelConfig, default_layer_types
  from diffgemma.training import run_config

  for name in ("sft_sudoku", "sft_chat"):
    for depth in (3, 6):
      config = cli.parse_config(f"configs/{name}.py", [f"--config.model.num_layers={depth}"])
      model = ModelConfig(**config.model.to_dict())
      assert model.layer_types == default_layer_types(depth)
      run_config.build(config)  # the whole run config is consistent
  explicit = cli.parse_config("configs/sft_sudoku.py", ["--config.model.num_layers=2",
                                             "--config.model.layer_types=('full_attention','full_attention')"])
  assert ModelConfig(**explicit.model.to_dict()).layer_types == ("full_attention",) * 2


def test_chat_training_without_data(tmp_path):
  """Training needs data.train: one line before the workdir exists (it once failed with a
  traceback after creating the workdir)."""
  workdir = tmp_path / "w"
  one_line_error(run("train.py", "--config=sft_chat", f"--workdir={workdir}"), "data.train")
  assert not workdir.exists()


def new_run_dir(tmp_path):
  """A workdir with a Sudoku run's config and no checkpoint yet: the task is known, so input is
  checked before anything asks for weights."""
  from configs import sft_sudoku
  from diffgemma.runs import checkpointing

  checkpointing.save_config(str(tmp_path), sft_sudoku.get_config())
  return tmp_path


def test_short_puzzle(tmp_path):
  one_line_error(run("sample.py", f"--workdir={new_run_dir(tmp_path)}", "--puzzle=" + "1" * 80),
                 "80 characters")


def test_missing_checkpoint(tmp_path):
  csv = tmp_path / "p.csv"
  puzzles, solutions = sudoku_puzzles.generate_puzzles(0, 2, 40, 40)
  sudoku_puzzles.write_csv(csv, puzzles, solutions)
  one_line_error(run("eval.py", f"--workdir={tmp_path / 'nothing'}", f"--data={csv}"),
                 "nothing")


def test_malformed_csv_row(tmp_path):
  puzzles, solutions = sudoku_puzzles.generate_puzzles(0, 2, 40, 40)
  csv = tmp_path / "bad.csv"
  good = "".join(map(str, puzzles[0])) + "," + "".join(map(str, solutions[0]))
  csv.write_text("quizzes,solutions\n" + good + "\n" + good[:-1] + "\n")
  one_line_error(run("eval.py", f"--workdir={new_run_dir(tmp_path)}", f"--data={csv}"), "line 3")


def test_puzzle_lines_become_a_solved_csv(tmp_path):
  """make_sudoku_csv.py --from_lines: '.'-blank lines with trailing comments and blank lines
  in between; the CSV holds the first --num puzzles with the generator's (unique) solutions, in
  folders --out names that did not exist yet."""
  puzzles, solutions = sudoku_puzzles.generate_puzzles(3, 3, 30, 32)
  lines = ["".join(str(d) if d else "." for d in p) for p in puzzles]
  source = tmp_path / "puzzles.txt"
  source.write_text(lines[0] + "  // a comment\n\n" + lines[1] + "\n" + lines[2] + "\n")
  out = tmp_path / "new" / "folders" / "out.csv"
  r = run("scripts/make_sudoku_csv.py", f"--from_lines={source}", "--num=2", f"--out={out}")
  assert r.returncode == 0, r.stderr
  got_puzzles, got_solutions = sudoku_puzzles.load_csv(out)
  assert (got_puzzles == puzzles[:2]).all() and (got_solutions == solutions[:2]).all()


def test_an_output_file_gets_its_folders_and_nothing_else(tmp_path):
  """The one rule for a file a command writes: missing folders are made when it is written;
  an existing directory, or a file where a folder should be, is refused in one line naming the
  flag, and the check before the work writes nothing."""
  from diffgemma import errors

  (tmp_path / "file").write_text("x")
  for path, needle in ((tmp_path, "is a directory"), (tmp_path / "file" / "sub" / "o.csv",
                                                       "is a file")):
    for refuse in (errors.check_output_file, errors.prepare_output_file):
      with pytest.raises(errors.InputError, match=needle) as caught:
        refuse(str(path), "out")
      assert str(caught.value).startswith(f"--out={str(path)!r}")
  nested = tmp_path / "a" / "b" / "o.csv"
  errors.check_output_file(str(nested), "out")
  assert sorted(os.listdir(tmp_path)) == ["file"]  # the check made nothing
  assert errors.prepare_output_file(str(nested), "out") == str(nested)
  assert (tmp_path / "a" / "b").is_dir() and not nested.exists()
  # A folder of outputs (eval.py --out with --scan, --out_dir): an existing one is fine.
  with pytest.raises(errors.InputError, match="is a file"):
    errors.prepare_output_file(str(tmp_path / "file"), "out_dir", directory=True)
  errors.prepare_output_file(str(tmp_path / "a"), "out_dir", directory=True)
  errors.prepare_output_file(str(tmp_path / "c" / "d"), "out_dir", directory=True)
  assert (tmp_path / "c" / "d").is_dir()


def test_a_puzzle_line_without_a_unique_solution(tmp_path):
  source = tmp_path / "puzzles.txt"
  source.write_text("." * 81 + "\n")
  r = run("scripts/make_sudoku_csv.py", f"--from_lines={source}", f"--out={tmp_path / 'o.csv'}")
  one_line_error(r, "line 1", "no unique solution")


def test_no_script_shadows_an_importable_module():
  """`python benchmarks/X.py` puts benchmarks/ first on sys.path, so a script named like a
  standard or installed module replaces it for every import made in that process (a
  benchmarks/kernels.py once stood in for Hugging Face's `kernels`, which transformers probes
  for)."""
  installed = set(importlib.metadata.packages_distributions()) | {"kernels"}
  taken = set(sys.stdlib_module_names) | installed
  for command in entry_points():
    if "/" in command:
      stem = os.path.splitext(os.path.basename(command))[0]
      assert stem not in taken, f"{command} shadows the importable module {stem!r}; rename it"
