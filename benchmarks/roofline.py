"""Analytical cost of one 26B-A4B denoising step, and its floor on H100, H200 and A100.

  python benchmarks/roofline.py                      # canvas 256, prefix 4096, batch 1 and 8
  python benchmarks/roofline.py --batches=1 --prefix=8192

One step = one decoder pass over B canvases of C tokens after a P-token cached prefix, plus the
sampling step (softmax over [B, C, V], the draw, and the self-conditioning embedding
probs @ E), plus the canvas commit (an encoder pass over C tokens, once per canvas) amortised
over the steps of a canvas (C / TPF). Counted:
  * weight bytes touched: every dense weight once (attention, dense MLP, router,
    self-conditioning MLP, the tied embedding as LM head; the sampling step reads it again),
    and the experts actually used: E (1 - (1 - k/E)^N) distinct experts of a layer for N tokens
    with uniform top-k routing (each token picks k distinct of E; tokens independent), or the
    report's measured 84 of 128 per 256-token canvas (B canvases: E (1 - (1 - 84/E)^B));
  * KV-cache bytes read: per layer B x visible prefix slots x K x hd for keys and values
    (sliding layers see the last window - 1 prefix slots, full layers all P);
  * FLOPs: 2 per multiply-add of every matmul (dense weights for all B*C tokens, k experts per
    token, attention scores and values over the visible keys, LM head, self-conditioning
    embedding);
and floor = max(FLOPs / peak FLOP/s, bytes / peak bytes/s), the time no implementation beats.
"FP8" stores and multiplies weights in one byte (the report's setting), activations and the KV
cache stay in bfloat16; the A100 has no FP8 tensor cores, so its FP8 row is FP8 storage with
bfloat16 math. Peaks are the vendors' dense (no sparsity) datasheet figures for SXM parts.
"""

from __future__ import annotations

import dataclasses

from absl import flags

from diffgemma import cli
from diffgemma.model.config import SLIDING, ModelConfig, gemma_26b_a4b


@dataclasses.dataclass(frozen=True)
class Device:
  name: str
  bf16_tflops: float  # dense tensor-core peak
  fp8_tflops: float | None  # None: no FP8 tensor cores
  hbm_tbps: float


DEVICES = (Device("H100 SXM", 989.4, 1978.9, 3.35), Device("H200 SXM", 989.4, 1978.9, 4.8),
           Device("A100 SXM 80GB", 312.0, None, 2.039))
# Each format: (bytes per weight, bytes per KV-cache / activation value, uses FP8 math).
FORMATS = {"bf16": (2, 2, False), "fp8": (1, 2, True)}
# The report: one denoising step on an H100 in FP8, batch 1, 4096 input tokens (end to end, of
# which 12.63 ms GPU time); 1456 tokens/s at TPF 19.74; 84 of 128 experts per canvas (PG-19).
REPORT_STEP_MS = 13.56
REPORT_GPU_MS = 12.63
REPORT_TOKENS_PER_SECOND = 1456
REPORT_EXPERTS_PER_CANVAS = 84


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
  """E (1 - (1 - k/E)^N): expected experts used by N tokens, each choosing k of E uniformly."""
  return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def experts_for_batch(num_experts: int, per_canvas: float, batch: int) -> float:
  """Distinct experts of B independent canvases that each use `per_canvas` of E."""
  return num_experts * (1.0 - (1.0 - per_canvas / num_experts) ** batch)


def layer_weight_counts(cfg: ModelConfig, layer: int) -> dict[str, int]:
  """Parameters of one layer's linear maps: attention, dense MLP, router, one expert."""
  d, h = cfg.hidden_size, cfg.num_heads
  hd, kv = cfg.layer_head_dim(layer), cfg.layer_kv_heads(layer)
  has_v = cfg.layer_types[layer] == SLIDING  # full layers take values from the keys
  return {"attention": d * h * hd * 2 + d * kv * hd * (2 if has_v else 1),
          "mlp": 3 * d * cfg.intermediate_size,
          "router": d * cfg.num_experts,
          "expert": 3 * d * cfg.moe_intermediate_size}


def visible_prefix(cfg: ModelConfig, layer: int, prefix: int) -> int:
  """Cached prefix slots a canvas query sees on this layer."""
  if cfg.layer_types[layer] == SLIDING:
    return min(prefix, cfg.sliding_window - 1)
  return prefix


def step_cost(cfg: ModelConfig, batch: int, prefix: int, experts_per_layer: float,
              weight_bytes: float, value_bytes: float) -> dict[str, float]:
  """Bytes and FLOPs of one decoder pass, the sampling step, and one canvas commit.

  `experts_per_layer`: distinct experts a layer reads (same for every layer). Returns a dict of
  bytes_* and flops_* entries (decoder, sampling, commit)."""
  c, d, v = cfg.canvas_length, cfg.hidden_size, cfg.vocab_size
  tokens = batch * c
  out = dict.fromkeys(("bytes_dense", "bytes_experts", "bytes_embedding", "bytes_kv",
                       "flops_dense", "flops_experts", "flops_attention", "flops_lm_head"), 0.0)
  for i in range(cfg.num_layers):
    w = layer_weight_counts(cfg, i)
    dense = w["attention"] + w["mlp"] + w["router"]
    out["bytes_dense"] += dense * weight_bytes
    out["bytes_experts"] += experts_per_layer * w["expert"] * weight_bytes
    out["flops_dense"] += 2 * tokens * dense
    out["flops_experts"] += 2 * tokens * cfg.top_k_experts * w["expert"]
    hd, kv = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
    seen = visible_prefix(cfg, i, prefix)
    out["bytes_kv"] += 2 * batch * seen * kv * hd * value_bytes
    # Scores and values: q.k and p.v over the canvas itself and the visible prefix.
    out["flops_attention"] += 2 * 2 * tokens * cfg.num_heads * hd * (c + seen)
  self_cond = 3 * d * cfg.intermediate_size
  out["bytes_dense"] += self_cond * weight_bytes
  out["flops_dense"] += 2 * tokens * self_cond
  out["bytes_embedding"] = v * d * weight_bytes  # the LM head (tied embedding)
  out["flops_lm_head"] = 2 * tokens * v * d
  # Sampling: the float32 logits written by the LM head are read back once (softmax, draw,
  # entropy fused), and probs @ E reads the embedding again.
  out["bytes_sampling"] = v * d * weight_bytes + 2 * tokens * v * 4
  out["flops_sampling"] = 2 * tokens * v * d
  # Commit: the encoder over the C canvas tokens (no LM head, no self-conditioning), which also
  # writes their K/V.
  commit = dict(out)
  out["bytes_commit"] = (commit["bytes_dense"] - self_cond * weight_bytes
                         + commit["bytes_experts"] + commit["bytes_kv"])
  out["flops_commit"] = (commit["flops_dense"] - 2 * tokens * self_cond
                         + commit["flops_experts"] + commit["flops_attention"])
  out["bytes_decoder"] = sum(out[k] for k in ("bytes_dense", "bytes_experts", "bytes_embedding",
                                              "bytes_kv"))
  out["flops_decoder"] = sum(out[k] for k in ("flops_dense", "flops_experts", "flops_attention",
                                              "flops_lm_head"))
  return out


def floor_seconds(flops: float, nbytes: float, device: Device, fmt: str) -> tuple[float, str]:
  """max(compute time, memory time) and which bound it is."""
  fp8_math = FORMATS[fmt][2] and device.fp8_tflops is not None
  peak = (device.fp8_tflops if fp8_math else device.bf16_tflops) * 1e12
  compute, memory = flops / peak, nbytes / (device.hbm_tbps * 1e12)
  return max(compute, memory), "compute" if compute > memory else "memory"


def step_floor(cost: dict, device: Device, fmt: str, steps_per_canvas: float) -> dict:
  """Floors of the decoder pass, sampling, the amortised commit, and their sum (ms)."""
  parts = {}
  for part in ("decoder", "sampling", "commit"):
    parts[part], parts[part + "_bound"] = floor_seconds(cost["flops_" + part],
                                                        cost["bytes_" + part], device, fmt)
  parts["commit"] /= steps_per_canvas
  parts["step"] = parts["decoder"] + parts["sampling"] + parts["commit"]
  return parts


def format_counts(cfg: ModelConfig, batch: int, prefix: int, routing: str, experts: float,
                  cost: dict) -> str:
  gb, tf = 1e9, 1e12
  return (f"| {batch} | {routing} | {experts:.1f} | {cost['bytes_dense'] / gb:.2f} | "
          f"{cost['bytes_experts'] / gb:.2f} | {cost['bytes_embedding'] / gb:.2f} | "
          f"{cost['bytes_kv'] / gb:.3f} | {cost['flops_decoder'] / tf:.2f} | "
          f"{cost['flops_attention'] / tf:.3f} | {cost['bytes_sampling'] / gb:.2f} | "
          f"{cost['flops_sampling'] / tf:.3f} |")


def main(argv):
  del argv
  cfg = gemma_26b_a4b()
  prefix, tpf = flags.FLAGS.prefix, flags.FLAGS.tpf
  steps_per_canvas = cfg.canvas_length / tpf
  print(f"26B-A4B denoising step: canvas {cfg.canvas_length}, prefix {prefix}, "
        f"{cfg.num_layers} layers, {cfg.num_experts} experts top-{cfg.top_k_experts}; "
        f"commit amortised over {steps_per_canvas:.2f} steps per canvas (C / TPF {tpf})")
  print("\nBytes (bf16 weights; FP8 halves the weight columns) and FLOPs per step:\n")
  print("| batch | routing | experts / layer | dense weights GB | expert weights GB | "
        "LM head GB | KV cache GB | decoder TFLOP | of which attention | sampling GB | "
        "sampling TFLOP |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  rows = []
  for batch in map(int, flags.FLAGS.batches):
    routings = {
        "uniform": expected_distinct_experts(cfg.num_experts, cfg.top_k_experts,
                                             batch * cfg.canvas_length),
        f"report ({REPORT_EXPERTS_PER_CANVAS}/canvas)": experts_for_batch(
            cfg.num_experts, REPORT_EXPERTS_PER_CANVAS, batch)}
    for routing, experts in routings.items():
      print(format_counts(cfg, batch, prefix, routing, experts,
                          step_cost(cfg, batch, prefix, experts, 2, 2)))
      rows.append((batch, routing, experts))
  print(f"\nFloor per step in ms (decoder + sampling + commit / {steps_per_canvas:.2f}; "
        f"m = memory-bound decoder, c = compute-bound) and tokens/s at TPF {tpf} "
        f"(batch B: B x TPF tokens per step). Report: {REPORT_STEP_MS} ms per step "
        f"({REPORT_GPU_MS} ms GPU), {REPORT_TOKENS_PER_SECOND} tokens/s, H100 FP8 batch 1.\n")
  header = "| device | format | " + " | ".join(f"B={b} {r}" for b, r, _ in rows) + " |"
  print(header)
  print("|---|---|" + "---|" * len(rows))
  for device in DEVICES:
    for fmt, (weight_bytes, value_bytes, _) in FORMATS.items():
      label = fmt if device.fp8_tflops or fmt == "bf16" else "fp8 storage, bf16 math"
      cells = []
      for batch, _, experts in rows:
        cost = step_cost(cfg, batch, prefix, experts, weight_bytes, value_bytes)
        f = step_floor(cost, device, fmt, steps_per_canvas)
        tokens = batch * tpf / f["step"]
        cells.append(f"{f['step'] * 1e3:.2f} ms {f['decoder_bound'][0]}, {tokens:,.0f} tok/s")
      print(f"| {device.name} | {label} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  # Defined here, not at import: tests import this module's functions.
  flags.DEFINE_list("batches", ["1", "8"], "Batch sizes (canvases per step).")
  flags.DEFINE_integer("prefix", 4096, "Cached prefix tokens.")
  flags.DEFINE_float("tpf", 19.74, "Tokens per forward for the tokens/s column (the report's "
                     "average over its 7 benchmarks).")
  cli.run(main)
