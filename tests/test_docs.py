"""README.md and docs/*.md against the tree: every path they name exists, every module or object
they name in dotted form is there, every flag they pass to a script of the repo is one the script
defines (config overrides: keys of the named config; sampler overrides: SamplerConfig fields),
and the README stays short."""

import dataclasses
import functools
import glob
import importlib
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 150
DEFAULT_CONFIG = "sft_sudoku"  # what eval.py and others use without --config
# Flags absl defines for every program that parses with it.
ABSL_BUILTINS = {"help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok"}

ENTRY_POINTS = ("train.py", "eval.py", "sample.py")
SCRIPT = r"(?:train\.py|eval\.py|sample\.py|scripts/\w+\.py|benchmarks/\w+\.py)"
# A repository path: a top-level folder of the repo (or an entry point) and what follows.
PATH = re.compile(r"(?<![\w/.~-])((?:diffgemma|configs|scripts|benchmarks|docs|tests)/[\w./*-]*"
                  r"|(?:train|eval|sample)\.py|README\.md|requirements(?:-test)?\.txt)")
# A file named without its folder (`losses.py`, `design.md`).
BARE_FILE = re.compile(r"(?<![\w/.~-])([A-Za-z_]\w*\.(?:py|md))\b")
# A dotted name inside the package (`diffgemma.tasks.make_task`).
DOTTED = re.compile(r"(?<![\w/.-])(diffgemma(?:\.\w+)+)")
# A command line: a script of the repo followed by its arguments (to the end of the line, a
# backtick, a comment or a shell operator).
COMMAND = re.compile(r"(?<![\w/.-])(" + SCRIPT + r")((?:[ \t]+(?!#)[^\s`;|&#]+)*)")
# Words that stand for a name the reader chooses (`configs/sft_NAME.py`, `--sampler.KEY=VALUE`).
PLACEHOLDERS = {"NAME", "KEY", "VALUE", "FILE", "DIR", "RUN", "WORKDIR", "ROOT", "ARG", "STEP",
                "TIME", "SECTION", "X", "Y", "N"}


def doc_files() -> list[str]:
  return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def read(path: str) -> str:
  with open(path, encoding="utf-8") as f:
    return f.read()


def joined(text: str) -> str:
  """Shell line continuations joined, so a command split over lines is one line."""
  return re.sub(r"\\\n[ \t]*", " ", text)


def rel(path: str) -> str:
  return os.path.relpath(path, ROOT)


def is_placeholder(part: str) -> bool:
  """Whether a path component, key or name holds a placeholder word."""
  return any(word in PLACEHOLDERS for word in re.split(r"[_.:-]", part))


@functools.cache
def repo_basenames() -> frozenset[str]:
  names = set()
  for directory, dirs, files in os.walk(ROOT):
    dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"
               and not (directory == ROOT and d == "runs")]  # runs/: workdirs, not the repo
    names.update(files)
  return frozenset(names)


def named_paths(text: str) -> set[str]:
  out = set()
  for match in PATH.finditer(text):
    path = match.group(1).rstrip(".,:;)")
    if any(is_placeholder(part) for part in path.split("/") if part):
      continue
    out.add(path)
  return out


def path_exists(path: str) -> bool:
  if any(c in path for c in "*?["):
    return bool(glob.glob(os.path.join(ROOT, path)))
  full = os.path.join(ROOT, path)
  return os.path.isdir(full) if path.endswith("/") else os.path.exists(full)


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_named_paths_exist(doc):
  text = read(doc)
  missing = sorted(p for p in named_paths(text) if not path_exists(p))
  assert not missing, f"{rel(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_bare_file_names_exist(doc):
  """`losses.py` without its folder must still be some file of the repo (no stale names such as
  a module that was renamed)."""
  text = PATH.sub(" ", read(doc))
  names = {m.group(1) for m in BARE_FILE.finditer(text) if not is_placeholder(m.group(1))}
  missing = sorted(names - repo_basenames())
  assert not missing, f"{rel(doc)} names files the repository does not have: {missing}"


def resolves(dotted: str) -> bool:
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    name = ".".join(parts[:i])
    base = os.path.join(ROOT, *parts[:i])
    if not (os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))):
      continue
    obj = importlib.import_module(name)
    for attr in parts[i:]:
      if not hasattr(obj, attr):
        return False
      obj = getattr(obj, attr)
    return True
  return False


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_dotted_names_resolve(doc):
  names = {m.group(1).rstrip(".") for m in DOTTED.finditer(read(doc))
           if not is_placeholder(m.group(1))}
  missing = sorted(n for n in names if not resolves(n))
  assert not missing, f"{rel(doc)} names modules or objects that do not exist: {missing}"


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_nothing_outside_the_repository(doc):
  text = read(doc)
  assert "../" not in text and "/work/" not in text, (
      f"{rel(doc)} points outside the repository")


# ----------------------------------------------------------------------------- flags


@functools.cache
def script_source(script: str) -> str:
  return read(os.path.join(ROOT, script))


@functools.cache
def defined_flags(script: str) -> frozenset[str]:
  source = script_source(script)
  names = set(re.findall(r"DEFINE_\w+\(\s*[\"'](\w+)[\"']", source))
  names.update(n.lstrip("-") for n in re.findall(r"add_argument\(\s*[\"'](--[\w-]+)[\"']", source))
  if re.search(r"^\s*(from absl import|import absl)", source, re.M):
    names |= ABSL_BUILTINS
  if "distributed.define_flags()" in source:  # the multi-process flags, defined in one place
    names |= set(re.findall(r"DEFINE_\w+\(\s*[\"'](\w+)[\"']",
                            read(os.path.join(ROOT, "diffgemma", "runs", "distributed.py"))))
  return frozenset(names)


def takes_sampler_overrides(script: str) -> bool:
  return bool(re.search(r"sections=\(\s*[\"']sampler[\"']", script_source(script)))


def config_path(spec: str) -> str:
  """The file `--config=spec` names: NAME[:ARG] is configs/NAME.py, a path is itself."""
  name = spec.partition(":")[0]
  if "/" not in name:
    name = os.path.join("configs", name.removesuffix(".py") + ".py")
  return os.path.join(ROOT, name)


@functools.cache
def load_config(spec: str):
  arg = spec.partition(":")[2]
  path = config_path(spec)
  module_spec = importlib.util.spec_from_file_location(
      "docs_config_" + re.sub(r"\W", "_", rel(path)), path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()


def has_key(config, key: str) -> bool:
  node = config
  for part in key.split("."):
    if not hasattr(node, "keys") or part not in node:
      return False
    node = node[part]
  return True


@functools.cache
def sampler_fields() -> frozenset[str]:
  from diffgemma.sampling import sampler

  return frozenset(f.name for f in dataclasses.fields(sampler.SamplerConfig))


def commands(text: str):
  """(script, [argument tokens]) of every command line in `text`."""
  for match in COMMAND.finditer(joined(text)):
    tokens = [t.strip("[]") for t in match.group(2).split()]
    yield match.group(1), [t for t in tokens if t]


def command_problems(script: str, tokens: list[str]) -> list[str]:
  if not os.path.isfile(os.path.join(ROOT, script)):
    return [f"{script}: no such script"]
  if "--" in tokens:  # a launcher: `-- SCRIPT ARGS` is a command of its own
    rest = tokens[tokens.index("--") + 1:]
    inner = (command_problems(rest[0], rest[1:]) if rest and re.fullmatch(SCRIPT, rest[0])
             else [f"{script} --: no script of the repo follows"])
    return command_problems(script, tokens[:tokens.index("--")]) + inner
  flags = defined_flags(script)
  problems = []
  config_spec = DEFAULT_CONFIG
  for token in tokens:
    if token.startswith("--config="):
      config_spec = token.split("=", 1)[1]
      if is_placeholder(config_spec):
        config_spec = None  # a config the reader writes: its keys cannot be checked
      elif not os.path.isfile(config_path(config_spec)):
        problems.append(f"{script} {token}: no such config")
        config_spec = DEFAULT_CONFIG
  for i, token in enumerate(tokens):
    if not token.startswith("--") or token == "--":
      continue
    name = token[2:].split("=", 1)[0]
    if "." in name:  # --SECTION.KEY=VALUE
      section, key = name.split(".", 1)
      if any(is_placeholder(p) for p in key.split(".")):
        ok = section in ("config", "sampler")
      elif section == "config":
        ok = "config" in flags and (config_spec is None
                                    or has_key(load_config(config_spec), key))
      elif section == "sampler":
        ok = takes_sampler_overrides(script) and key in sampler_fields()
      else:
        ok = False
      if not ok:
        problems.append(f"{script} {token}: not a key of --{section}"
                        + (f" ({config_spec})" if section == "config" else ""))
      continue
    if is_placeholder(name):
      continue
    if name not in flags:
      problems.append(f"{script} {token}: {script} defines no --{name}")
      continue
    # sweep.py's --grid KEY=V1,V2 / --set KEY=VALUE name keys of its --config.
    if script == "scripts/sweep.py" and name in ("grid", "set"):
      value = token.split("=", 1)[1] if "=" in token else (tokens[i + 1] if i + 1 < len(tokens)
                                                           else "")
      key = value.split("=", 1)[0]
      if (key and config_spec is not None and not is_placeholder(key)
          and not has_key(load_config(config_spec), key)):
        problems.append(f"{script} --{name} {value}: not a key of {config_spec}")
  return problems


@pytest.mark.parametrize("doc", doc_files(), ids=rel)
def test_command_line_flags_are_defined(doc):
  found = list(commands(read(doc)))
  problems = [p for script, tokens in found for p in command_problems(script, tokens)]
  assert not problems, f"{rel(doc)}:\n" + "\n".join(problems)


def test_commands_are_found():
  """The command parser sees the README's commands (a broken pattern would pass vacuously)."""
  found = [script for doc in doc_files() for script, tokens in commands(read(doc)) if tokens]
  assert {"train.py", "eval.py", "sample.py"} <= set(found)
  assert any(s.startswith("scripts/") for s in found)
  assert any(s.startswith("benchmarks/") for s in found)


def test_checker_catches_bad_flags():
  assert command_problems("eval.py", ["--no_such_flag=1"])
  assert command_problems("eval.py", ["--sampler.no_such_key=1"])
  assert not command_problems("eval.py", ["--sampler.entropy_bound=0.3"])
  assert command_problems("train.py", ["--sampler.entropy_bound=0.3"])
  assert command_problems("train.py", ["--config.optimizer.no_such_key=1"])
  assert not command_problems("train.py", ["--config=sft_chat:sort", "--config.data.train=a"])
  assert command_problems("train.py", ["--config=no_such_config"])
  assert not command_problems("train.py", ["--distributed", "--heartbeat_timeout_s=60"])
  assert not command_problems("scripts/launch_local.py",
                              ["--num_processes=2", "--", "train.py", "--config=sft_sudoku"])
  assert command_problems("scripts/launch_local.py", ["--", "train.py", "--no_such_flag=1"])
  assert command_problems("scripts/launch_local.py", ["--no_such_flag=1", "--", "eval.py"])
  assert named_paths("see `diffgemma/train_loop.py`, configs/NAME.py, benchmarks/RESULTS.md") == {
      "diffgemma/train_loop.py", "benchmarks/RESULTS.md"}
  assert not path_exists("diffgemma/train_loop.py")


# ----------------------------------------------------------------------------- size


def test_readme_is_short():
  lines = read(os.path.join(ROOT, "README.md")).count("\n")
  assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"
