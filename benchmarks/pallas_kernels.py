"""Pallas kernels against their XLA references at the 26B-A4B layer shapes, with rooflines.

  python benchmarks/pallas_kernels.py            # accelerator: canvas 256, prefix 4096, bf16
  python benchmarks/pallas_kernels.py --smoke    # CPU: small shapes, Pallas in interpret mode

Measures, in one run: the device's peak (a large matmul's FLOP/s and a large copy's bytes/s),
then for batch 1 and 8
  * canvas attention (sliding layer: 8 KV heads, head dim 256, window 1024; full layer: 2 KV
    heads, head dim 512) - XLA (`layers.attend` on a materialised mask) against the Pallas kernel;
  * the MoE expert MLP (128 experts, top 8, D 2816, I 704) - `jax.lax.ragged_dot` against the
    Pallas grouped kernel;
  * a whole denoising step of a scaled-down 26B-shaped model (same layer shapes, fewer layers),
    XLA against Pallas kernels: max logit difference and both step times.
Each line prints time, achieved TFLOP/s or GB/s, and the ratio to the roofline floor
max(FLOPs / peak FLOP/s, bytes / peak bytes/s). Interpret-mode times on CPU mean nothing;
--smoke only checks that everything runs and agrees.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from diffgemma import cli
from diffgemma.model import attention_mask, layers, transformer
from diffgemma.model.config import FULL, SLIDING, gemma_26b_a4b
from diffgemma.model.kernels import attention as attention_kernel
from diffgemma.model.kernels import moe as moe_kernel

SMOKE_OVERRIDES = dict(  # the 26B-A4B structure at CPU size (benchmarks' --smoke)
    hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, global_head_dim=128,
    num_global_kv_heads=1, sliding_window=48, num_experts=16, top_k_experts=4,
    moe_intermediate_size=64, intermediate_size=192, vocab_size=512, canvas_length=32)
SMOKE_PREFIX = 96


def timed(fn, *args, repeats: int) -> float:
  """Median seconds of a jitted call after one compile/warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def device_peaks(dtype, smoke: bool, repeats: int) -> tuple[float, float]:
  """(FLOP/s of a large matmul, bytes/s of a large elementwise copy), measured here."""
  n = 1024 if smoke else 8192
  a = jnp.ones((n, n), dtype)
  flops = 2 * n**3 / timed(jax.jit(lambda x: x @ x), a, repeats=repeats)
  elements = (2**22 if smoke else 2**28)
  x = jnp.ones((elements,), dtype)
  seconds = timed(jax.jit(lambda x: x * 2), x, repeats=repeats)
  return flops, 2 * x.nbytes / seconds  # read + write


def report(result: dict, peaks):
  """One line: both times, the kernel's achieved rates and its ratio to the roofline floor."""
  name, seconds_xla, seconds_pallas = result["name"], result["xla_s"], result["pallas_s"]
  flops, bytes_min = result["flops"], result["bytes"]
  floor = max(flops / peaks[0], bytes_min / peaks[1])
  print(f"{name:<42} xla {seconds_xla * 1e3:9.3f} ms | pallas {seconds_pallas * 1e3:9.3f} ms | "
        f"speedup {seconds_xla / seconds_pallas:5.2f}x | pallas {flops / seconds_pallas / 1e12:7.2f} "
        f"TFLOP/s, {bytes_min / seconds_pallas / 1e9:7.1f} GB/s | floor {floor * 1e3:8.3f} ms "
        f"({seconds_pallas / floor:5.2f}x of floor)")


def bench_attention(cfg, layer_type, batch, prefix, dtype, repeats, rng) -> dict:
  """Canvas attention, XLA path against the Pallas kernel: {name, xla_s, pallas_s, flops,
  bytes (the minimum traffic: q, out and the visible K/V once), err}."""
  canvas, heads = cfg.canvas_length, cfg.num_heads
  hd = cfg.head_dim if layer_type == SLIDING else cfg.global_head_dim
  kv = cfg.num_kv_heads if layer_type == SLIDING else cfg.num_global_kv_heads
  window = cfg.sliding_window if layer_type == SLIDING else None
  keys = jax.random.split(rng, 3)
  slots = prefix + canvas
  q = jax.random.normal(keys[0], (batch, canvas, heads, hd), dtype)
  k = jax.random.normal(keys[1], (batch, slots, kv, hd), dtype)
  v = jax.random.normal(keys[2], (batch, slots, kv, hd), dtype)
  anchor = jnp.full((batch, canvas), prefix, jnp.int32)
  limit = anchor + canvas - 1
  pos = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, slots))
  valid = jnp.ones((batch, slots), bool)
  xla = jax.jit(lambda q, k, v: layers.attend(
      q, k, v, attention_mask.attention_mask(anchor, limit, pos, valid, window)))
  pallas = jax.jit(lambda q, k, v: attention_kernel.canvas_attention(
      q, k, v, anchor, limit, pos, valid, window))
  err = float(jnp.max(jnp.abs(xla(q, k, v).astype(jnp.float32) -
                              pallas(q, k, v).astype(jnp.float32))))
  visible = canvas + (min(prefix, window - 1) if window else prefix)
  flops = 4 * batch * heads * canvas * visible * hd
  itemsize = jnp.dtype(dtype).itemsize
  bytes_min = itemsize * batch * (2 * canvas * heads * hd + 2 * visible * kv * hd)
  return {"name": f"attention {layer_type[:7]} B={batch} hd={hd} (err {err:.1e})",
          "xla_s": timed(xla, q, k, v, repeats=repeats),
          "pallas_s": timed(pallas, q, k, v, repeats=repeats), "flops": flops,
          "bytes": bytes_min, "err": err}


def bench_moe(cfg, batch, dtype, repeats, rng) -> dict:
  """The expert MLP, jax.lax.ragged_dot against the Pallas grouped kernel (keys as
  bench_attention; bytes: the used experts' weights and the rows in and out once)."""
  tokens = batch * cfg.canvas_length
  d, inter, experts, top_k = (cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                              cfg.top_k_experts)
  keys = jax.random.split(rng, 4)
  x = jax.random.normal(keys[0], (tokens, d), dtype)
  router_logits = jax.random.normal(keys[1], (tokens, experts))
  weights, index = jax.lax.top_k(jax.nn.softmax(router_logits), top_k)
  flat = index.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  x_sorted = x[order // top_k]
  row_weights = weights.reshape(-1)[order]
  group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
  gate_up = (jax.random.normal(keys[2], (experts, d, 2 * inter)) * d**-0.5).astype(dtype)
  down = (jax.random.normal(keys[3], (experts, inter, d)) * inter**-0.5).astype(dtype)

  def xla_fn(x, gate_up, down):
    gate, up = jnp.split(jax.lax.ragged_dot(x, gate_up, group_sizes), 2, axis=-1)
    y = jax.lax.ragged_dot(layers.gelu_tanh(gate) * up, down, group_sizes)
    return y * row_weights[:, None].astype(y.dtype)

  xla = jax.jit(xla_fn)
  pallas = jax.jit(lambda x, gate_up, down: moe_kernel.expert_mlp(
      x, group_sizes, gate_up, down, row_weights))
  ref, out = xla(x_sorted, gate_up, down), pallas(x_sorted, gate_up, down)
  scale = float(jnp.max(jnp.abs(ref.astype(jnp.float32))))
  err = float(jnp.max(jnp.abs(ref.astype(jnp.float32) - out.astype(jnp.float32)))) / scale
  rows = tokens * top_k
  flops = rows * (2 * d * 2 * inter + 2 * inter * d)
  used = int(jnp.sum(group_sizes > 0))
  itemsize = jnp.dtype(dtype).itemsize
  bytes_min = itemsize * (used * 3 * d * inter + 2 * rows * d)
  return {"name": f"moe B={batch} tokens={tokens} experts used {used} (rel err {err:.1e})",
          "xla_s": timed(xla, x_sorted, gate_up, down, repeats=repeats),
          "pallas_s": timed(pallas, x_sorted, gate_up, down, repeats=repeats), "flops": flops,
          "bytes": bytes_min, "err": err}


def bench_denoising_step(cfg, batch, prefix, repeats, rng):
  """One decoder pass over a canvas against a filled cache: XLA path against Pallas kernels."""
  params = transformer.init_params(cfg, rng)
  cache = transformer.init_cache(cfg, batch, prefix + cfg.canvas_length)
  filled = jnp.ones((batch, prefix), bool)
  keys = jax.random.split(rng, 2 + 2 * cfg.num_layers)
  for i, layer_cache in enumerate(cache["layers"]):
    for j, name in enumerate(("k", "v")):
      noise = jax.random.normal(keys[2 + 2 * i + j], layer_cache[name].shape, jnp.float32)
      layer_cache[name] = (noise * 0.5).astype(layer_cache[name].dtype)
  cache["valid"] = cache["valid"].at[:, :prefix].set(filled)
  cache["end"] = jnp.asarray(prefix, jnp.int32)
  canvas = jax.random.randint(keys[0], (batch, cfg.canvas_length), 0, cfg.vocab_size)
  results = {}
  for name, variant in (("xla", cfg.replace(moe_impl="ragged_dot", attention_impl="xla")),
                        ("pallas", cfg.replace(moe_impl="pallas", attention_impl="pallas"))):
    step = jax.jit(lambda p, x, c, variant=variant: transformer.decode(p, variant, x, c))
    results[name] = (step(params, canvas, cache), timed(step, params, canvas, cache,
                                                        repeats=repeats))
  err = float(jnp.max(jnp.abs(results["xla"][0] - results["pallas"][0])))
  print(f"denoising step ({cfg.compute_dtype}), {cfg.num_layers} layers, B={batch}, prefix "
        f"{prefix}: xla "
        f"{results['xla'][1] * 1e3:.2f} ms | pallas {results['pallas'][1] * 1e3:.2f} ms | "
        f"speedup {results['xla'][1] / results['pallas'][1]:.2f}x | max |logit diff| {err:.2e}")


def main(argv):
  del argv
  f = flags.FLAGS
  dtype = jnp.dtype(f.dtype)
  smoke = f.smoke
  full = gemma_26b_a4b(param_dtype=f.dtype, compute_dtype=f.dtype)
  prefix, repeats = f.prefix, f.repeats
  if smoke:  # the same structure at CPU size (Pallas interprets)
    full = full.replace(**SMOKE_OVERRIDES)
    prefix, repeats = SMOKE_PREFIX, 2
  print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}"
        f", dtype {dtype.name}{' [smoke: interpret mode, times not meaningful]' if smoke else ''}")
  peaks = device_peaks(dtype, smoke, repeats)
  print(f"measured peak: {peaks[0] / 1e12:.1f} TFLOP/s (matmul), {peaks[1] / 1e9:.0f} GB/s (copy)")
  rng = jax.random.PRNGKey(0)
  for batch in map(int, f.batches):
    for layer_type in (SLIDING, FULL):
      report(bench_attention(full, layer_type, batch, prefix, dtype, repeats, rng), peaks)
    report(bench_moe(full, batch, dtype, repeats, rng), peaks)
  layers = f.step_layers
  scaled = full.replace(num_layers=layers, layer_types=())
  # Agreement in float32 first (bfloat16 rounding differs between any two kernels), then the
  # step times in the benchmark dtype.
  bench_denoising_step(scaled.replace(param_dtype="float32", compute_dtype="float32"), 1,
                       prefix, 1, rng)
  for batch in map(int, f.batches):
    bench_denoising_step(scaled, batch, prefix, repeats, rng)


if __name__ == "__main__":
  # Defined here, not at import: gpu_suite.py imports this module's functions.
  flags.DEFINE_bool("smoke", False, "Small shapes (CPU, interpret mode): checks only.")
  flags.DEFINE_list("batches", ["1", "8"], "Batch sizes.")
  flags.DEFINE_integer("prefix", 4096, "Cached prefix length.")
  flags.DEFINE_integer("repeats", 10, "Timed calls per measurement (median).")
  flags.DEFINE_integer("step_layers", 6, "Layers of the scaled-down model (6 = one sliding "
                       "period: 5 sliding + 1 full).")
  flags.DEFINE_string("dtype", "bfloat16", "Activation and weight dtype.")
  cli.run(main)
