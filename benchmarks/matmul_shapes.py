"""float32 matmul rates at the shapes of `vs_transformers.py`'s model: jax (XLA:CPU) vs torch.

  python benchmarks/matmul_shapes.py [--tokens=256,640] [--hidden_size=128 ...]

For each [M, K] x [K, N] product of one layer (projections, dense MLP, one expert's share of the
routed rows, LM head) and its weight-gradient form ([K, M] x [M, N]), prints GFLOP/s of a
jitted `lax.scan` over `--repeats` distinct left operands (no per-call dispatch in the timing)
and of a torch loop over the same operands, and their ratio. The defaults are the sizes of
`vs_transformers.py` at batch 8: 256 rows in a decoder step (8 x canvas 32), 640 in its training
step (8 x (16 + 2 x 32)). This separates the matmul kernels from everything else a step does:
when a whole step runs far below these rates, per-operation costs outside the dots decide.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from absl import flags

from diffgemma import cli

_TOKENS = flags.DEFINE_list("tokens", ["256", "640"], "Rows M of the activations.")
_HIDDEN = flags.DEFINE_integer("hidden_size", 128, "Hidden size.")
_INTERMEDIATE = flags.DEFINE_integer("intermediate_size", 256, "Dense MLP intermediate size.")
_QUERY = flags.DEFINE_integer("query_width", 128, "Query heads x head dim.")
_KV = flags.DEFINE_integer("kv_width", 64, "KV heads x head dim (sliding layers).")
_MOE = flags.DEFINE_integer("moe_intermediate_size", 64, "Expert MLP size.")
_EXPERT_SHARE = flags.DEFINE_float("expert_share", 0.25, "Rows per expert / M (top-k / experts).")
_VOCAB = flags.DEFINE_integer("vocab_size", 512, "LM head width.")
_REPEATS = flags.DEFINE_integer("repeats", 200, "Products per timed call.")
_TRIALS = flags.DEFINE_integer("trials", 5, "Timed calls (best kept).")
_THREADS = flags.DEFINE_integer("torch_threads", None, "torch intra-op threads (default: torch's).")


def layer_shapes(m: int) -> dict:
  """{name: (M, K, N)} of one layer's products at M rows, and their weight-gradient forms."""
  h, e = _HIDDEN.value, max(1, round(_EXPERT_SHARE.value * m))
  forward = {"q/o projection": (m, h, _QUERY.value), "k/v projection": (m, h, _KV.value),
             "MLP gate/up": (m, h, _INTERMEDIATE.value), "MLP down": (m, _INTERMEDIATE.value, h),
             "expert gate+up": (e, h, 2 * _MOE.value), "expert down": (e, _MOE.value, h),
             "LM head": (m, h, _VOCAB.value)}
  grads = {f"{name}, dW": (k, mm, n) for name, (mm, k, n) in forward.items()
           if name in ("MLP gate/up", "MLP down", "LM head")}
  return forward | grads


def best_seconds(fn, trials: int) -> float:
  fn()  # compile / warm up
  times = []
  for _ in range(trials):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return min(times)


def rates(m: int, k: int, n: int) -> tuple[float, float]:
  """(jax, torch) GFLOP/s of `--repeats` [m, k] x [k, n] products."""
  rng = np.random.default_rng(0)
  a_RxMxK = rng.standard_normal((_REPEATS.value, m, k), np.float32)
  b_KxN = rng.standard_normal((k, n), np.float32)
  flops = 2.0 * m * k * n * _REPEATS.value

  @jax.jit
  def summed(a_RxMxK, b_KxN):
    # Accumulating keeps every product live; the add is 1/(2K) of the work.
    return jax.lax.scan(lambda acc, a: (acc + a @ b_KxN, None), jnp.zeros((m, n)), a_RxMxK)[0]

  ja, jb = jnp.asarray(a_RxMxK), jnp.asarray(b_KxN)
  jax_s = best_seconds(lambda: summed(ja, jb).block_until_ready(), _TRIALS.value)
  ta, tb = torch.from_numpy(a_RxMxK), torch.from_numpy(b_KxN)

  def torch_loop():
    acc = torch.zeros(m, n)
    for a in ta:
      acc += a @ tb
    return acc

  torch_s = best_seconds(torch_loop, _TRIALS.value)
  return flops / jax_s / 1e9, flops / torch_s / 1e9


def main(argv):
  del argv
  if _THREADS.value:
    torch.set_num_threads(_THREADS.value)
  print(f"jax {jax.__version__} ({jax.devices()[0].platform}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); best of {_TRIALS.value} x {_REPEATS.value} "
        "products; GFLOP/s")
  print(f"{'M rows':>6}  {'product':<22} {'M x K x N':>16}  {'jax':>6}  {'torch':>6}  jax/torch")
  for m in (int(t) for t in _TOKENS.value):
    for name, (mm, k, n) in layer_shapes(m).items():
      ours, theirs = rates(mm, k, n)
      print(f"{m:6d}  {name:<22} {f'{mm}x{k}x{n}':>16}  {ours:6.1f}  {theirs:6.1f}  "
            f"{ours / theirs:.2f}")


if __name__ == "__main__":
  cli.run(main)
