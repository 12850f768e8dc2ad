"""Where a training step's time goes: FLOPs, achieved GFLOP/s against the matmul peak, time per
operation class and the idle gap between operations.

  python benchmarks/step_profile.py [--config=sft_sudoku] [--steps=20] [--config.KEY=VALUE ...]

For the config's SFT update step (batch, model and objective as configured) it prints:
- the step's median wall time over `--steps` steps (after one compile step);
- FLOPs two ways: XLA's cost analysis of the compiled step, and a count from the step's jaxpr
  (every dot_general 2 * batch * M * N * K, scan bodies times their length);
- achieved GFLOP/s (jaxpr dot FLOPs / step time) against the peak of this machine, a jitted
  1024^3 float32 matmul measured in the same process (and bfloat16 when the model computes in
  bfloat16);
- from a profiler trace of `--trace_steps` steps: the time of each class of compiled operation
  (matmul fusions, reductions, gathers / scatters, copies, elementwise fusions, ...), their
  count per step, and the idle gap: step wall time minus the time any operation was running;
  and the time of each part of the step (attention, MoE, dense MLP, the self-conditioning pass,
  LM head, optimizer, ...), read from the named scopes in the operations' metadata.
With --compare="KEY=VALUE,KEY=VALUE;KEY=VALUE" it also times each variant (config overrides,
variants separated by ';') against the config itself, their steps interleaved round-robin in
one process so that a machine whose speed drifts affects all alike, and prints the ratios.
Absolute numbers depend on the machine; the ratios are what to compare.
"""

import collections
import glob
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax._src import profiler as jax_profiler  # ProfileData: the trace's events
from ml_collections import config_flags

from diffgemma import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config (default sft_sudoku).")
_STEPS = flags.DEFINE_integer("steps", 20, "Timed steps (median kept).", lower_bound=1)
_TRACE_STEPS = flags.DEFINE_integer("trace_steps", 5, "Steps under the profiler.", lower_bound=1)
_COMPARE = flags.DEFINE_string("compare", "", "Variants to time side by side: 'K=V,K=V;K=V'.")
_ROUNDS = flags.DEFINE_integer("rounds", 6, "Round-robin rounds of --compare (median kept).")
_PEAK_SIZE = flags.DEFINE_integer("peak_size", 1024, "Side of the square matmul for the peak.")

# Thunk events of the trace that are not compiled operations.
_NOT_OPERATIONS = re.compile(r"^(end: |ThreadpoolListener|SlinkyThreadPool|ThunkExecutor)")
# Operations whose time is their children's (counted there).
_CONTAINERS = {"while", "conditional", "call"}


def build_step(config, steps: int):
  """benchmarks/sft_step.py's build_step (loaded by path: this file also runs as a script, and
  tests import it as benchmarks.step_profile)."""
  here = os.path.dirname(os.path.abspath(__file__))
  return cli.load_module(os.path.join(here, "sft_step.py")).build_step(config, steps)

def dot_flops(jaxpr) -> float:
  """FLOPs of every dot_general in a (closed) jaxpr, nested jaxprs included; a scan's body
  counts `length` times, a cond's most expensive branch once."""
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (contract, _), (batch, _) = eqn.params["dimension_numbers"]
      lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
      k = np.prod([lhs[i] for i in contract])
      out = np.prod(eqn.outvars[0].aval.shape)
      total += 2.0 * out * k
      del rhs, batch
      continue
    subs = [v for v in eqn.params.values() if hasattr(v, "eqns") or hasattr(v, "jaxpr")]
    subs += [b for v in eqn.params.values() if isinstance(v, tuple) for b in v
             if hasattr(b, "eqns") or hasattr(b, "jaxpr")]
    counts = [dot_flops(getattr(s, "jaxpr", s)) for s in subs]
    if not counts:
      continue
    if eqn.primitive.name == "scan":
      total += eqn.params["length"] * sum(counts)
    elif eqn.primitive.name == "cond":
      total += max(counts)
    else:
      total += sum(counts)
  return total


def operation_classes(hlo_text: str) -> dict:
  """{instruction name: class} for the compiled module's instructions."""
  computations, current = {}, None
  for line in hlo_text.splitlines():
    header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header:
      current = computations.setdefault(header.group(2), [])
    elif current is not None and "=" in line:
      current.append(line)
  opcode_of = lambda line: (re.search(r"=\s*(?:\S+\s+)*?([a-z][\w\-]*)\(", line) or
                            re.search(r"\s([a-z][\w\-]*)\(", line))

  def contents(name, seen=()):
    ops = set()
    for line in computations.get(name, []):
      m = opcode_of(line)
      if m:
        ops.add(m.group(1))
      for called in re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", line):
        if called not in seen:
          ops |= contents(called, seen + (name,))
    return ops

  classes = {}
  for lines in computations.values():
    for line in lines:
      name = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
      m = opcode_of(line)
      if not name or not m:
        continue
      op = m.group(1)
      if op == "fusion":
        called = re.search(r"calls=%?([\w.\-]+)", line)
        inner = contents(called.group(1)) if called else set()
        op = next((kind for kind in ("dot", "convolution", "scatter", "gather", "reduce", "sort")
                   if kind in inner), None)
        if op is None:
          op = "copy" if inner <= {"copy", "transpose", "bitcast", "parameter", "reshape",
                                   "broadcast", "slice", "concatenate", "dynamic-slice",
                                   "dynamic-update-slice", "constant", "tuple",
                                   "get-tuple-element"} else "elementwise"
      classes[name.group(1)] = _class_name(op)
  return classes


# The named scopes of the model, the loss and the update step, most specific first: an
# operation belongs to the first that its op_name holds (the self-conditioning pass's MoE is
# the pass's).
REGIONS = ("optimizer", "forward_process", "self_conditioning_pass", "self_conditioning", "moe",
           "attention", "dense_mlp", "lm_head", "embedding")


def operation_regions(hlo_text: str) -> dict:
  """{instruction name: region} from each instruction's op_name metadata (its named scopes);
  "other" for what no scope covers (the loss, norms between blocks, layout changes)."""
  patterns = [(region, re.compile(rf"\b{region}\b")) for region in REGIONS]
  regions = {}
  for line in hlo_text.splitlines():
    name = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = ", line)
    op_name = re.search(r'op_name="([^"]*)"', line)
    if name:
      text = op_name.group(1) if op_name else ""
      regions[name.group(1)] = next((r for r, pattern in patterns if pattern.search(text)),
                                    "other")
  return regions


def _class_name(op: str) -> str:
  if op in ("dot", "convolution", "custom-call"):
    return "matmul" if op != "custom-call" else "custom call"
  if op in ("scatter", "gather", "sort", "reduce", "while", "conditional", "call"):
    return {"reduce": "reduction", "sort": "sort"}.get(op, op)
  if op in ("copy", "transpose", "dynamic-slice", "dynamic-update-slice", "concatenate", "slice",
            "pad", "reshape", "broadcast", "bitcast", "iota", "constant", "tuple",
            "get-tuple-element", "copy-start", "copy-done"):
    return "copy"
  return "elementwise"


def trace_operations(step_fn, state, batches, classes, regions):
  """Profile `batches` steps; returns (wall s per step, {class: (s per step, ops per step)},
  {region: (s per step, ops per step)}, busy s per step, state)."""
  with tempfile.TemporaryDirectory(prefix="step_profile_") as directory:
    jax.profiler.start_trace(directory)
    start = time.perf_counter()
    for batch in batches:
      state, metrics = step_fn(state, None, batch)
    jax.block_until_ready(metrics)
    wall = time.perf_counter() - start
    jax.profiler.stop_trace()
    data = jax_profiler.ProfileData.from_file(
        glob.glob(os.path.join(directory, "**", "*.xplane.pb"), recursive=True)[-1])
  per_class = collections.defaultdict(lambda: [0.0, 0])
  per_region = collections.defaultdict(lambda: [0.0, 0])
  intervals = []
  for plane in data.planes:
    for line in plane.lines:
      if "PjRtCpuClient" not in line.name and "XLAEigen" not in line.name:
        continue
      for event in line.events:
        base = event.name.split(" ")[0]
        if _NOT_OPERATIONS.match(event.name) or base not in classes:
          continue
        kind = classes[base]
        if kind in _CONTAINERS:
          continue
        per_class[kind][0] += event.duration_ns * 1e-9
        per_class[kind][1] += 1
        per_region[regions.get(base, "other")][0] += event.duration_ns * 1e-9
        per_region[regions.get(base, "other")][1] += 1
        intervals.append((event.start_ns, event.start_ns + event.duration_ns))
  busy, end = 0.0, -np.inf
  for lo, hi in sorted(intervals):  # union of the intervals: time any operation ran
    if hi > end:
      busy += (hi - max(lo, end)) * 1e-9
      end = hi
  n = len(batches)
  per_step = lambda table: {k: (v[0] / n, v[1] / n) for k, v in table.items()}
  return wall / n, per_step(per_class), per_step(per_region), busy / n, state


def matmul_peak(size: int, dtype) -> float:
  """GFLOP/s of a jitted size^3 matmul, best of a few repeats of a 10-product scan."""
  a = jnp.asarray(np.random.default_rng(0).standard_normal((10, size, size)), dtype)
  b = jnp.asarray(np.random.default_rng(1).standard_normal((size, size)), dtype)
  fn = jax.jit(lambda a, b: jax.lax.scan(lambda c, x: (c + (x @ b)[0, 0], None),
                                         jnp.zeros((), dtype), a)[0])
  fn(a, b).block_until_ready()
  best = np.inf
  for _ in range(3):
    start = time.perf_counter()
    fn(a, b).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 10 * 2 * size ** 3 / best / 1e9


def compare(config, variants: list[str], rounds: int, steps: int = 6):
  """Median seconds per step of the config and of each variant, interleaved round-robin."""
  runs = []
  for overrides in [""] + variants:
    step_fn, state, batches = build_step(cli.override_config(config, overrides.split(",")),
                                         steps + 1)
    state, metrics = step_fn(state, None, batches[0])
    jax.block_until_ready(metrics)
    runs.append([step_fn, state, batches[1:], []])
  for _ in range(rounds):
    for run in runs:
      step_fn, state, batches, times = run
      start = time.perf_counter()
      for batch in batches:
        state, metrics = step_fn(state, None, batch)
      jax.block_until_ready(metrics)
      times.append((time.perf_counter() - start) / len(batches))
      run[1] = state
  return [float(np.median(run[3])) for run in runs]


def main(argv):
  del argv
  config = _CONFIG.value
  steps = _STEPS.value + _TRACE_STEPS.value + 1
  step_fn, state, batches = build_step(config, steps)

  compiled = step_fn.lower(state, None, batches[0]).compile()
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  xla_flops = float(cost.get("flops", float("nan")))
  counted = dot_flops(jax.make_jaxpr(step_fn)(state, None, batches[0]).jaxpr)
  classes = operation_classes(compiled.as_text())
  regions = operation_regions(compiled.as_text())

  state, metrics = step_fn(state, None, batches[0])
  jax.block_until_ready(metrics)
  times = []
  for batch in batches[1:_STEPS.value + 1]:
    start = time.perf_counter()
    state, metrics = step_fn(state, None, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  step_s = float(np.median(times))
  traced_s, per_class, per_region, busy_s, state = trace_operations(
      step_fn, state, batches[_STEPS.value + 1:], classes, regions)

  m = config.model
  print(f"config: batch {config.batch_size}, hidden {m.hidden_size}, layers {m.num_layers}, "
        f"compute {m.compute_dtype}, remat {m.remat}, moe {m.moe_impl}, "
        f"self_conditioning_prob {config.loss.self_conditioning_prob}; "
        f"{jax.device_count()} device(s), {os.cpu_count()} CPUs")
  print(f"step: {step_s * 1e3:.1f} ms (median of {len(times)}); traced {traced_s * 1e3:.1f} ms")
  peaks = {"float32": matmul_peak(_PEAK_SIZE.value, jnp.float32)}
  if m.compute_dtype == "bfloat16":
    peaks["bfloat16"] = matmul_peak(_PEAK_SIZE.value, jnp.bfloat16)
  print(f"FLOPs per step: XLA cost analysis {xla_flops / 1e9:.2f} G, jaxpr dots "
        f"{counted / 1e9:.2f} G")
  for dtype, peak in peaks.items():
    achieved = counted / step_s / 1e9
    print(f"achieved {achieved:.1f} GFLOP/s against a {dtype} {_PEAK_SIZE.value}^3 matmul peak "
          f"of {peak:.1f} GFLOP/s: {100 * achieved / peak:.1f}%; the step at peak would take "
          f"{counted / peak / 1e6:.1f} ms")
  # Independent operations run concurrently on the CPU threads: class times add up to more
  # than the wall time; `busy` is the time at least one operation ran.
  total_s = sum(seconds for seconds, _ in per_class.values())
  print(f"operation time per step, summed over threads: {total_s * 1e3:.1f} ms; some operation "
        f"running: {busy_s * 1e3:.1f} ms of {traced_s * 1e3:.1f} ms")
  print("| operation class | ms per step (all threads) | share of operation time | "
        "operations per step | us each |")
  print("|---|---|---|---|---|")
  for kind, (seconds, count) in sorted(per_class.items(), key=lambda kv: -kv[1][0]):
    print(f"| {kind} | {seconds * 1e3:.1f} | {100 * seconds / total_s:.1f}% | {count:.0f} | "
          f"{1e6 * seconds / max(count, 1):.1f} |")
  idle = traced_s - busy_s
  print(f"| idle gap (no operation running) | {idle * 1e3:.1f} | "
        f"{100 * idle / traced_s:.1f}% of the step | | |")
  print("| part of the step (named scope; forward and backward) | ms per step (all threads) | "
        "share of operation time | operations per step | us each |")
  print("|---|---|---|---|---|")
  for region, (seconds, count) in sorted(per_region.items(), key=lambda kv: -kv[1][0]):
    print(f"| {region} | {seconds * 1e3:.1f} | {100 * seconds / total_s:.1f}% | {count:.0f} | "
          f"{1e6 * seconds / max(count, 1):.1f} |")

  if _COMPARE.value:
    variants = [v for v in _COMPARE.value.split(";") if v.strip()]
    seconds = compare(config, variants, _ROUNDS.value)
    print(f"side by side, {_ROUNDS.value} interleaved rounds (median ms per step, speedup over "
          "the config):")
    for name, s in zip(["(config)"] + variants, seconds):
      print(f"  {s * 1e3:7.1f} ms  {seconds[0] / s:.2f}x  {name}")


if __name__ == "__main__":
  cli.run(main, sys.argv if any(a.startswith("--config=") for a in sys.argv)
           else sys.argv + ["--config=sft_sudoku"])
