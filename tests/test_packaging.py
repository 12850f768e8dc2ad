"""The declared runtime dependencies: requirements.txt installs what pyproject.toml declares, and
every one of them is imported by the package (a dependency nothing imports is dropped)."""

import ast
import glob
import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Distribution name -> the top-level module it installs, where the two differ.
IMPORT_NAMES = {"orbax-checkpoint": "orbax", "ml-collections": "ml_collections",
                "absl-py": "absl", "Pillow": "PIL", "ml-dtypes": "ml_dtypes"}


def requirement_name(line: str) -> str:
  return re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0]


def declared() -> list[str]:
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    return [requirement_name(d) for d in tomllib.load(f)["project"]["dependencies"]]


def package_imports() -> set[str]:
  """Top-level modules imported anywhere in diffgemma/ (at module level or inside functions)."""
  names = set()
  for path in glob.glob(os.path.join(ROOT, "diffgemma", "**", "*.py"), recursive=True):
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names.update(alias.name.split(".")[0] for alias in node.names)
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        names.add(node.module.split(".")[0])
  return names


def test_requirements_txt_installs_what_pyproject_declares():
  """The same pins, and the project itself (`-e .`: scripts import the installed package)."""
  with open(os.path.join(ROOT, "requirements.txt")) as f:
    lines = [l.strip() for l in f if l.strip() and not l.lstrip().startswith("#")]
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    pinned = tomllib.load(f)["project"]["dependencies"]
  assert [l for l in lines if l.startswith("-")] == ["-e ."]
  assert sorted(l for l in lines if not l.startswith("-")) == sorted(pinned)


def test_every_runtime_dependency_is_imported_by_the_package():
  imported = package_imports()
  unused = [d for d in declared() if IMPORT_NAMES.get(d, d.replace("-", "_")) not in imported]
  assert not unused, f"declared in pyproject.toml but imported by no module of diffgemma/: {unused}"
