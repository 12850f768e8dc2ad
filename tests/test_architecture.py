"""The package's shape, checked on the source tree: import layers, of subpackages (`LAYERS`) and
of modules (as docs/design.md lists them), so no import circle can form; and the task boundary
(no generic module imports a task)."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "diffgemma"
TASK_PACKAGE = "diffgemma.tasks"
# The task interface and the registry are what generic code may import from the tasks package.
TASK_INTERFACE = {"diffgemma.tasks", "diffgemma.tasks.base"}

# The package's subpackages and top-level modules, bottom to top: each imports only those before
# it. errors: one-line error types; model: the network and its configs; runs: a run's directory
# (checkpoints, config.json, resume rules, lock, preemption, provenance, many processes); io:
# model checkpoint directories, tokenizers, TensorBoard; sampling: the sampler and traces; tasks:
# what the tokens mean; training: the typed run config, training state, losses, loop, stages,
# evaluation and loaded runs; cli: flags and the one catch of errors; tools: sweeps, comparison,
# lowering; harness: the lm-evaluation-harness model.
LAYERS = ("errors", "model", "runs", "io", "sampling", "tasks", "training", "cli", "tools",
          "harness")


def module_name(path: str) -> str:
  rel = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
  return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def package_modules() -> dict[str, str]:
  """{module name: path} of every module of the package."""
  found = {}
  for directory, _, files in os.walk(os.path.join(ROOT, PACKAGE)):
    for name in files:
      if name.endswith(".py"):
        path = os.path.join(directory, name)
        found[module_name(path)] = path
  return found


def imported_modules(path: str, known: set[str]) -> set[str]:
  """Package modules `path` imports anywhere in it (module level or inside functions);
  `from pkg import name` counts as pkg.name when that is a module."""
  tree = ast.parse(open(path, encoding="utf-8").read(), path)
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      if node.module.split(".")[0] != PACKAGE:
        continue
      for alias in node.names:
        sub = f"{node.module}.{alias.name}"
        out.add(sub if sub in known else node.module)
  return out


def design_rows() -> list[tuple[str, int]]:
  """(module, layer) of each row of the table in docs/design.md, in the table's order."""
  text = open(os.path.join(ROOT, "docs", "design.md"), encoding="utf-8").read()
  rows = re.findall(r"^\| `(diffgemma/[\w/]+)\.py` \| (\d+) \|", text, re.M)
  return [(module_name(os.path.join(ROOT, path + ".py")), int(layer)) for path, layer in rows]


def design_layers() -> dict[str, int]:
  """{module: layer} from the table in docs/design.md."""
  return dict(design_rows())


def subpackage(module: str) -> str | None:
  """The entry of LAYERS a module belongs to (None for the package's own __init__)."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else None


def test_layers_name_every_subpackage_once():
  found = {subpackage(m) for m in package_modules()} - {None}
  assert len(set(LAYERS)) == len(LAYERS) and set(LAYERS) == found, (
      f"LAYERS misses {sorted(found - set(LAYERS))}, names unknown {sorted(set(LAYERS) - found)}")


def test_subpackages_import_only_lower_subpackages():
  """No arrow between subpackages runs back up LAYERS (modules may import within their own)."""
  modules = package_modules()
  rank = {name: i for i, name in enumerate(LAYERS)}
  bad = []
  for name, path in sorted(modules.items()):
    for target in sorted(imported_modules(path, set(modules))):
      here, there = subpackage(name), subpackage(target)
      if there is None or here == there:
        continue
      if rank[there] > rank[here]:
        bad.append(f"{name} imports {target}: {there} sits above {here} in LAYERS {LAYERS}")
  assert not bad, "\n".join(bad)


def test_design_table_is_sorted_by_subpackage_then_layer():
  rank = {name: i for i, name in enumerate(LAYERS)}
  rows = design_rows()
  key = lambda row: (rank.get(subpackage(row[0]), -1), row[1], row[0])
  assert rows == sorted(rows, key=key), (
      "docs/design.md's module table is not in LAYERS order, then by layer, then by name")


def test_design_lists_every_module_once():
  layers, modules = design_layers(), package_modules()
  assert sorted(layers) == sorted(modules), (
      f"docs/design.md misses {sorted(set(modules) - set(layers))}, lists unknown "
      f"{sorted(set(layers) - set(modules))}")


def test_imports_point_to_lower_layers_only():
  """Strictly lower layers: the import graph has no circle, and each module's place is the
  documented one."""
  layers, modules = design_layers(), package_modules()
  bad = []
  for name, path in sorted(modules.items()):
    for target in sorted(imported_modules(path, set(modules))):
      if target == PACKAGE or (target in modules and name.startswith(target + ".")):
        continue  # a package's own __init__ runs first anyway
      if target not in layers or layers[target] >= layers.get(name, -1):
        bad.append(f"{name} (layer {layers.get(name)}) imports {target} "
                   f"(layer {layers.get(target)})")
  assert not bad, "\n".join(bad)


# Benchmarks of one task: the AR baseline trains on chat data exactly as the chat task makes it.
TASK_SPECIFIC_BENCHMARKS = {"ar_baseline.py"}
# Package modules of one task: the harness's local tasks read chat JSONL and its requests are
# laid out as the chat task lays out prompts (chat_data's readers and padding).
TASK_SPECIFIC_MODULES = {"diffgemma.harness"}


def test_no_generic_module_imports_a_task_module():
  """Only tasks/ (and configs/, tests/, task-specific scripts) name a task module; generic code
  and the entry points reach tasks through the registry and the interface."""
  modules = package_modules()
  files = [p for n, p in modules.items()
           if not n.startswith(TASK_PACKAGE + ".") and n not in TASK_SPECIFIC_MODULES]
  files += [os.path.join(ROOT, f) for f in ("train.py", "eval.py", "sample.py")]
  files += [os.path.join(ROOT, "benchmarks", f) for f in os.listdir(os.path.join(ROOT, "benchmarks"))
            if f.endswith(".py") and f not in TASK_SPECIFIC_BENCHMARKS]
  bad = []
  for path in files:
    for target in imported_modules(path, set(modules)):
      if target.startswith(TASK_PACKAGE) and target not in TASK_INTERFACE:
        bad.append(f"{os.path.relpath(path, ROOT)} imports {target}")
  assert not bad, "\n".join(bad)


# Where a raw ml_collections ConfigDict may be read: the entry points and the one conversion
# (`training.run_config.build`), the steps before it (resume reconciliation, architecture
# adoption, validation, config.json), the stage and task registries and the tasks, which type
# their own sections. Everything else receives the typed, frozen `RunConfig` or its sections.
CONFIG_DICT_READERS = {
    "diffgemma.cli", "diffgemma.runs.checkpointing", "diffgemma.runs.resume_config",
    "diffgemma.tasks", "diffgemma.tasks.chat", "diffgemma.tasks.sudoku",
    "diffgemma.tools.lowering", "diffgemma.training.loaded", "diffgemma.training.loop",
    "diffgemma.training.memory_plan", "diffgemma.training.run_config",
    "diffgemma.training.stages", "diffgemma.training.stages.base",
    "diffgemma.training.stages.sdrl", "diffgemma.training.stages.sft",
    "diffgemma.training.training_state",
}


def test_the_raw_config_stays_at_the_entry_points():
  """Only the modules that convert or prepare the config import ml_collections: the model,
  sampling, io, update step and losses take typed configs (a new reader is a design change)."""
  readers = set()
  for name, path in package_modules().items():
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      if any(n.split(".")[0] == "ml_collections" for n in names):
        readers.add(name)
  assert readers <= CONFIG_DICT_READERS, sorted(readers - CONFIG_DICT_READERS)
  assert "diffgemma.training.update_step" not in readers
