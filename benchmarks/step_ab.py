"""A program of several code trees or environments, timed side by side on one machine.

  python benchmarks/step_ab.py --variant=main:origin/main --variant=this:. \
      [--variant="xnn:.:XLA_FLAGS='--xla_cpu_use_xnnpack=true'"] [--config=sft_sudoku] \
      [--program=sft_step|decoder_step|generate] [--batch=8] \
      [--rounds=8] [--steps_per_round=5] [--config_overrides=KEY=VALUE,...] \
      [--variant_overrides=LABEL:KEY=VALUE,...]

  # Packed rows against one example per row, same tree, per example:
  python benchmarks/step_ab.py --config=sft_chat:count --config_overrides=data.train=count.jsonl \
      --variant=unpacked:. --variant=packed:. \
      --variant_overrides=unpacked:data.max_row_tokens=0,data.max_row_examples=0,batch_size=16

`--program`: the config's SFT update step (default); the sampler's decoder step (one bidirectional
pass over a canvas of `--batch` rows against a cache holding their encoded prompts); or `generate`
(the whole jitted sampler, `--batch` prompts of the config's prompt length, its sampler section).
The sampler programs use only the model's entry points (`transformer`; `network` in trees from
before its split) and `sampler`, whose API every tree since the Flax port shares, so they time
trees from before it too. Each variant also reports its first call's time
less its median warm call: the compile time.

Each `--variant=LABEL:SOURCE[:ENV]` is one process: SOURCE is `.` (this working tree) or a git
ref (checked out into a temporary worktree, removed at the end); ENV is shell-style
`VAR=VALUE` assignments added to that process's environment (XLA flags, thread counts, a forced
device count). Every process builds the config's SFT update step from its own tree, compiles it
and runs one step; then the parent runs the processes' timed rounds one after another,
round-robin, so that a machine whose speed drifts affects every variant alike, and only one
process computes at a time. Prints the median ms per step of each variant and its speedup over
the first; for the SFT step also the examples a step trains on (the mean over `--count_batches`
input batches: packed rows hold several) and the time per example against the first variant's.
Absolute numbers depend on the machine; the ratios are what to compare.
"""

import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from absl import flags

from diffgemma import cli, errors

_VARIANTS = flags.DEFINE_multi_string("variant", None, "LABEL:SOURCE[:ENV] (see the docstring).")
_CONFIG = flags.DEFINE_string("config", "sft_sudoku", "Config name (configs/NAME.py[:VARIANT]).")
_OVERRIDES = flags.DEFINE_string("config_overrides", "", "KEY=VALUE,... applied in every variant.")
_VARIANT_OVERRIDES = flags.DEFINE_multi_string(
    "variant_overrides", [], "LABEL:KEY=VALUE,... applied in that variant only, after "
    "--config_overrides.")
_ROUNDS = flags.DEFINE_integer("rounds", 8, "Round-robin rounds (the median is kept).")
_STEPS = flags.DEFINE_integer("steps_per_round", 5, "Steps per timed round.")
_PROGRAM = flags.DEFINE_enum("program", "sft_step", ["sft_step", "decoder_step", "generate"],
                             "What to time (see the docstring).")
_BATCH = flags.DEFINE_integer("batch", 8, "Rows of the sampler programs.")
_COUNT_BATCHES = flags.DEFINE_integer(
    "count_batches", 64, "sft_step: input batches over which each variant counts its mean "
    "examples per step (packed rows hold several), to print the time per example.")
_CHILD = flags.DEFINE_string("child", None, "Internal: the source tree this process times.")
_CHILD_OVERRIDES = flags.DEFINE_string("child_overrides", "", "Internal: this variant's own "
                                       "KEY=VALUE,... (from --variant_overrides).")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_config(tree: str, spec: str):
  """The tree's configs/NAME.py get_config(VARIANT), of `spec` = NAME[:VARIANT] or a path
  ending in configs/NAME.py[:VARIANT] (as cli.run resolves --config=NAME)."""
  import importlib.util

  path, _, variant = spec.partition(":")
  name = os.path.basename(path).removesuffix(".py")
  spec = importlib.util.spec_from_file_location(name, os.path.join(tree, "configs", name + ".py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(variant) if variant else module.get_config()


def _sft_step_module():
  """benchmarks/sft_step.py of this file's tree, by path: a timed tree (an older git ref) may
  not have it."""
  import importlib.util

  spec = importlib.util.spec_from_file_location(
      "sft_step", os.path.join(os.path.dirname(os.path.abspath(__file__)), "sft_step.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def child(tree: str):
  """Builds and compiles the tree's update step, then times `steps_per_round` steps for every
  'go' read from stdin, answering one JSON line each."""
  import jax

  from diffgemma import cli  # the tree's own: the parent puts it on PYTHONPATH

  config = _load_config(tree, _CONFIG.value)
  overrides = ",".join(o for o in (_OVERRIDES.value, _CHILD_OVERRIDES.value) if o)
  if overrides:
    config = cli.override_config(config, overrides.split(","))
  if _PROGRAM.value == "sft_step":
    run_once, examples = _sft_program(config)
  else:
    run_once, examples = _sampler_program(config), 0.0
  start = time.perf_counter()
  run_once()
  first = time.perf_counter() - start
  print(json.dumps({"ready": True, "devices": jax.device_count(), "jax": jax.__version__,
                    "first_seconds": first, "examples_per_step": examples}), flush=True)
  for line in sys.stdin:
    if line.strip() != "go":
      break
    start = time.perf_counter()
    for _ in range(_STEPS.value):
      run_once()
    print(json.dumps({"seconds": (time.perf_counter() - start) / _STEPS.value}), flush=True)


def _sft_program(config):
  """(one update step per call, on the next of `steps_per_round` + 1 prepared batches (cycled);
  the mean examples per batch over `count_batches` batches)."""
  import jax

  step_fn, state, batches, examples = _sft_step_module().build_counted_step(
      config, _STEPS.value + 1, _COUNT_BATCHES.value)
  holder = {"state": state, "i": 0}

  def run_once():
    batch = batches[holder["i"] % len(batches)]
    holder["i"] += 1
    holder["state"], metrics = step_fn(holder["state"], None, batch)
    jax.block_until_ready(metrics)

  return run_once, examples


def _sampler_program(config):
  """The decoder step or the whole sampler on random parameters and prompts (the programs'
  cost does not depend on the weights' values, except the sampler's adaptive stop: the same
  seeds in every tree, so every tree runs the same number of passes)."""
  import jax
  import jax.numpy as jnp

  try:
    from diffgemma.model import transformer
  except ImportError:  # a tree from before diffgemma/model/network.py was split
    from diffgemma.model import network as transformer
  from diffgemma.model.config import ModelConfig
  from diffgemma.sampling import sampler

  cfg = ModelConfig(**config.model.to_dict())
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  prompt_len = int(config.get("data", {}).get("prompt_len", 81))
  b, c = _BATCH.value, cfg.canvas_length
  prompt = jax.random.randint(jax.random.PRNGKey(1), (b, prompt_len), 3, cfg.vocab_size)
  valid = jnp.ones((b, prompt_len), bool)
  if _PROGRAM.value == "generate":
    fields = {f for f in sampler.SamplerConfig.__dataclass_fields__}
    sampler_cfg = sampler.SamplerConfig(**{k: v for k, v in config.sampler.to_dict().items()
                                           if k in fields})
    generate_fn = sampler.make_generate_fn(cfg, sampler_cfg)
    return lambda: jax.block_until_ready(generate_fn(params, prompt, valid,
                                                     jax.random.PRNGKey(2)))
  cache = transformer.init_cache(cfg, b, prompt_len + c)
  _, cache = jax.jit(transformer.encode, static_argnums=1)(params, cfg, prompt, cache, valid)
  canvas = jax.random.randint(jax.random.PRNGKey(3), (b, c), 3, cfg.vocab_size)
  decode = jax.jit(transformer.decode, static_argnums=1)
  return lambda: jax.block_until_ready(decode(params, cfg, canvas, cache))


def _source_tree(source: str, scratch: str) -> tuple[str, str]:
  """(directory, commit) of `.` or of a git ref checked out into a worktree under `scratch`."""
  if source == ".":
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return REPO, commit + ("+changes" if dirty else "")
  directory = os.path.join(scratch, source.replace("/", "_"))
  subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-q", directory, source],
                 check=True)
  commit = subprocess.run(["git", "-C", directory, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
  return directory, commit


def parent():
  own_overrides = {}
  for text in _VARIANT_OVERRIDES.value:
    label, _, assignments = text.partition(":")
    own_overrides[label] = assignments
  variants = []
  for text in _VARIANTS.value or ["this:."]:
    label, _, rest = text.partition(":")
    source, _, env = rest.partition(":")
    variants.append((label, source or ".", env))
  unknown = set(own_overrides) - {label for label, _, _ in variants}
  if unknown:
    raise errors.UserError(f"--variant_overrides names {sorted(unknown)}, which no --variant "
                           "has as its label")
  scratch = tempfile.mkdtemp(prefix="step_ab_")
  trees, processes, kept, firsts, examples = [], [], [], [], []
  try:
    for label, source, env in variants:
      directory, commit = _source_tree(source, scratch)
      if directory != REPO:
        trees.append(directory)
      extra = dict(item.split("=", 1) for item in shlex.split(env))
      process = subprocess.Popen(
          [sys.executable, os.path.abspath(__file__), f"--child={directory}",
           f"--config={_CONFIG.value}", f"--config_overrides={_OVERRIDES.value}",
           f"--steps_per_round={_STEPS.value}", f"--program={_PROGRAM.value}",
           f"--batch={_BATCH.value}", f"--count_batches={_COUNT_BATCHES.value}",
           f"--child_overrides={own_overrides.get(label, '')}"],
          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=directory,
          env={**os.environ, **extra, "PYTHONPATH": os.pathsep.join(
              p for p in (directory, os.environ.get("PYTHONPATH")) if p)})
      line = process.stdout.readline()
      if not line:  # the child died while compiling (e.g. a flag this CPU cannot run)
        print(f"{label}: {source} at {commit}, env {env or '-'}: FAILED (exit code "
              f"{process.wait()}), left out", flush=True)
        continue
      info = json.loads(line)
      print(f"{label}: {source} at {commit}, env {env or '-'}, overrides "
            f"{own_overrides.get(label) or '-'}, {info['devices']} device(s), "
            f"jax {info['jax']}", flush=True)
      firsts.append(info["first_seconds"])
      examples.append(info["examples_per_step"])
      processes.append(process)
      kept.append((label, source, env))
    times = [[] for _ in processes]
    for _ in range(_ROUNDS.value):
      for process, record in zip(processes, times):
        process.stdin.write("go\n")
        process.stdin.flush()
        record.append(json.loads(process.stdout.readline())["seconds"])
    for process in processes:
      process.stdin.close()
      process.wait()
  finally:
    for directory in trees:
      subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", directory])
    shutil.rmtree(scratch, ignore_errors=True)
  variants = kept
  medians = [float(np.median(t)) for t in times]
  what = _PROGRAM.value + (f" batch {_BATCH.value}" if _PROGRAM.value != "sft_step" else "")
  print(f"{os.path.basename(_CONFIG.value)} {what} {_OVERRIDES.value}: {_ROUNDS.value} "
        f"interleaved rounds of {_STEPS.value} calls, median ms per call, speedup over "
        f"{variants[0][0]}, compile (first call less the median); {os.cpu_count()} CPUs")
  per_example = all(examples)
  for (label, _, _), seconds, record, first, count in zip(variants, medians, times, firsts,
                                                          examples):
    spread = (min(record) * 1e3, max(record) * 1e3)
    line = (f"  {seconds * 1e3:8.1f} ms ({spread[0]:.0f}-{spread[1]:.0f})  "
            f"{medians[0] / seconds:5.2f}x  compile {first - seconds:6.1f} s")
    if per_example:  # the cost that matters when variants fit different examples in a step
      line += (f"  {count:5.2f} examples/step  {seconds * 1e3 / count:7.2f} ms/example "
               f"{seconds / count / (medians[0] / examples[0]):5.2f}x of {variants[0][0]}'s")
    print(f"{line}  {label}")


def main(argv):
  del argv
  if _CHILD.value:
    child(_CHILD.value)
  else:
    parent()


if __name__ == "__main__":
  cli.run(main)
