"""Every GPU figure of the 26B-A4B in one command: one table, printed and written to --out.

  python benchmarks/gpu_suite.py --out=DIR           # one H100 / H200 (its run time is unmeasured;
                                                     # --budget_minutes bounds it)
  python benchmarks/gpu_suite.py --smoke --out=DIR   # CPU, tiny shapes, the suite's code paths

Writes DIR/gpu_suite.md (the table, with device name, date and measured peaks) and
DIR/gpu_suite.json. Sections:
  (a) kernels against their XLA paths at the 26B-A4B layer shapes (bfloat16, canvas 256, prefix
      4096, batch 1 and 8): canvas attention on a sliding and a full layer (`layers.attend` on a
      materialised mask vs the Pallas kernel), the expert MLP (`jax.lax.ragged_dot` vs the Pallas
      grouped kernel); achieved TFLOP/s and GB/s, and the share of the roofline floor
      max(FLOPs / peak, bytes / bandwidth) against the peaks measured here (a large matmul, a
      large copy).
  (b) the 26B-A4B with random bfloat16 weights: prefill of 4096 tokens, one decoder step at
      batch 1 and 8, the sampling step (fused vs unfused), the canvas commit (an encoder pass
      over 256 tokens), each with kernels on (attention_impl / moe_impl "pallas", fused step) and
      off (XLA attention, ragged_dot experts, unfused step).
  (c) generation of 1024 tokens at batch 1 after a 4096-token prompt. Random weights never
      converge, so the step count per canvas is fixed at the report's average: TPF 19.74 on
      256-token canvases is 256 / 19.74 = 12.97 -> 13 steps (max_denoising_steps=13, and
      confidence_threshold=0, which no mean entropy is below, so the adaptive stop never
      fires; eos_token_id=-1, so no row ends early). Prints ms per decoder step (generation time
      minus the prefill, over the decoder passes, commits included) and the tokens/s that implies
      at TPF 19.74 (the report: 13.56 ms, 1,456 tokens/s, H100 FP8), and the latency fields of
      eval.py's JSON: cold seconds (the first call, compile included), warm seconds, seconds per
      canvas and warm tokens/s. The JSON also holds the device (kind, jax, CPU model).
  (d) the LoRA SFT step of the 26B on one device at batch 1 (the sft_sudoku_lora recipe: rank 16
      on every linear, remat, "tiled_scan" experts; then the Pallas kernels; then a QLoRA int4
      base): ms per step and memory (XLA's plan, and the device's peak when it reports one).
A measurement that fails (out of memory, a kernel the backend rejects) becomes a row saying so;
once --budget_minutes is spent, the remaining rows are marked skipped.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import pallas_kernels as kernel_bench  # benchmarks/pallas_kernels.py, beside this script
from diffgemma import cli, errors
from diffgemma.model import quantize, transformer
from diffgemma.runs import provenance
from diffgemma.sampling import sampler
from diffgemma.tasks import make_task
from diffgemma.model.config import FULL, SLIDING, ModelConfig, gemma_26b_a4b
from sft_step import make_step  # benchmarks/sft_step.py, beside this script

_OUT = flags.DEFINE_string("out", None, "Directory for gpu_suite.md and gpu_suite.json.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Tiny shapes on any backend (CI on a CPU).")
_SECTIONS = flags.DEFINE_list("sections", ["a", "b", "c", "d"], "Sections to run.")
_REPEATS = flags.DEFINE_integer("repeats", 5, "Timed calls per measurement (median).")
_BUDGET = flags.DEFINE_float("budget_minutes", None, "Skip what is left after this long "
                             "(default 7.5 on a device; no limit with --smoke).")

REPORT_TPF = 19.74  # the report's average tokens per forward (7 benchmarks)
REPORT_STEP_MS = 13.56  # the report's end-to-end denoising step, H100 FP8, batch 1
PROMPT_TOKENS = 4096
NEW_TOKENS = 1024
GIB = 2**30
# (d): (name, Pallas kernels, lora.base_dtype)
LORA_VARIANTS = (("LoRA (bf16 base), tiled_scan experts", False, "bfloat16"),
                 ("LoRA (bf16 base), Pallas kernels", True, "bfloat16"),
                 ("QLoRA (int4 base), tiled_scan experts", False, "int4"))


class Suite:
  """Rows of the table; each measurement runs under a time budget and its failures become
  rows."""

  def __init__(self, budget_s: float, peaks):
    self.start = time.perf_counter()
    self.budget_s = budget_s
    self.peaks = peaks
    self.rows: list[dict] = []

  def run(self, section: str, name: str, kernels: str, fn):
    """Row(s) from fn() -> dict or list of dicts (ms, achieved, roofline, note); failures and
    the budget become notes."""
    base = {"section": section, "measurement": name, "kernels": kernels}
    if time.perf_counter() - self.start > self.budget_s:
      self._add({**base, "note": "skipped (time budget)"})
      return None
    try:
      out = fn()
    except Exception as e:  # a row that says what failed, then the next measurement
      text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
      self._add({**base, "note": f"failed: {text[:200]}"})
      traceback.print_exc(limit=3)
      return None
    for row in out if isinstance(out, list) else [out]:
      self._add({**base, **row})
    return out

  def _add(self, row):
    self.rows.append(row)
    print(format_row(row), flush=True)

  def rates(self, seconds: float, flops: float, nbytes: float) -> dict:
    """ms, achieved TFLOP/s and GB/s, and the roofline floor's share of the measured time."""
    floor = max(flops / self.peaks[0], nbytes / self.peaks[1])
    return {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "gbps": nbytes / seconds / 1e9,
            "roofline": floor / seconds}


COLUMNS = ("section", "measurement", "kernels", "ms", "achieved", "of roofline", "note")


def format_row(row: dict) -> str:
  ms = f"{row['ms']:.3f}" if "ms" in row else ""
  achieved = (f"{row['tflops']:.3g} TFLOP/s, {row['gbps']:.3g} GB/s" if "tflops" in row else "")
  roofline = f"{100 * row['roofline']:.0f}%" if "roofline" in row else ""
  return (f"| {row['section']} | {row['measurement']} | {row['kernels']} | {ms} | {achieved} | "
          f"{roofline} | {row.get('note', '')} |")


def timed(fn, *args, repeats: int) -> float:
  return kernel_bench.timed(fn, *args, repeats=repeats)


def memory_stats() -> dict:
  """The device's allocator statistics, {} where the backend has none (CPU)."""
  try:
    return dict(jax.devices()[0].memory_stats() or {})
  except Exception:  # not every backend implements it
    return {}


# ----------------------------------------------------------------------------- configs


def model_configs(smoke: bool) -> tuple[ModelConfig, dict]:
  """(26B-A4B in bfloat16, shapes) or the same structure at CPU size."""
  cfg = gemma_26b_a4b(param_dtype="bfloat16", compute_dtype="bfloat16")
  shapes = {"prefix": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "batches": (1, 8),
            "kernel_batches": (1, 8), "steps_per_canvas": round(cfg.canvas_length / REPORT_TPF),
            "generate_kernels": (True, False), "lora_variants": LORA_VARIANTS}
  if smoke:
    # Every section's code once, at CPU size: where two settings run the same suite code, only
    # one of them (the kernels themselves are tested in tests/).
    cfg = cfg.replace(**{**kernel_bench.SMOKE_OVERRIDES, "canvas_length": 16}, num_layers=1,
                      layer_types=())
    shapes = {"prefix": 32, "new_tokens": 32, "batches": (2,), "kernel_batches": (1,),
              "steps_per_canvas": 2, "generate_kernels": (True,),
              "lora_variants": tuple(v for v in LORA_VARIANTS if v[2] == "int4")}
  return cfg, shapes


def with_kernels(cfg: ModelConfig, on: bool) -> ModelConfig:
  if on:
    return cfg.replace(attention_impl="pallas", moe_impl="pallas")
  return cfg.replace(attention_impl="xla", moe_impl="ragged_dot")


def onoff(on: bool) -> str:
  return "on" if on else "off"


# ----------------------------------------------------------------------------- (a) kernels


def section_kernels(suite: Suite, cfg: ModelConfig, shapes: dict, repeats: int):
  rng = jax.random.PRNGKey(0)
  dtype = jnp.dtype(cfg.compute_dtype)

  def both(result):
    rows = []
    for impl, key in (("off", "xla_s"), ("on", "pallas_s")):
      rates = suite.rates(result[key], result["flops"], result["bytes"])
      rows.append({**rates, "kernels": impl, "note": result["name"].split("(")[-1].rstrip(")")})
    return rows

  for batch in shapes["kernel_batches"]:
    for layer_type in (SLIDING, FULL):
      suite.run("a", f"attention {layer_type.split('_')[0]} B={batch}", "", lambda: both(
          kernel_bench.bench_attention(cfg, layer_type, batch, shapes["prefix"], dtype, repeats,
                                       rng)))
    suite.run("a", f"MoE expert MLP B={batch}", "", lambda: both(
        kernel_bench.bench_moe(cfg, batch, dtype, repeats, rng)))


# ----------------------------------------------------------------------------- (b) model


def random_params(cfg: ModelConfig):
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  jax.block_until_ready(params)
  return params


def repeat_batch(cache, batch: int):
  """A batch-1 cache repeated to `batch` rows."""
  return {"layers": [{k: jnp.repeat(v, batch, axis=0) for k, v in layer.items()}
                     for layer in cache["layers"]],
          "valid": jnp.repeat(cache["valid"], batch, axis=0), "end": cache["end"]}


def unfused_sample(params, cfg: ModelConfig, tempered_BxCxV, rng):
  """The unfused step's sampling work: log-softmax, entropy, draw and argmax here, and the
  next decoder pass's self-conditioning embedding from the logits."""
  log_probs = jax.nn.log_softmax(tempered_BxCxV, axis=-1)
  out = (sampler.sample_categorical(rng, log_probs), jnp.argmax(tempered_BxCxV, axis=-1),
         sampler._entropy(log_probs))  # pylint: disable=protected-access
  return out + (transformer.self_conditioning_embedding(params, tempered_BxCxV, cfg),)


def section_model(suite: Suite, cfg: ModelConfig, shapes: dict, params, repeats: int):
  """Prefill, decoder step, sampling step and commit, kernels on and off; returns the batch-1
  prefill seconds per setting (for (c))."""
  prefix, c = shapes["prefix"], cfg.canvas_length
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, prefix)), jnp.int32)
  canvas = jnp.asarray(rng.integers(3, cfg.vocab_size, (1, c)), jnp.int32)
  prefill_s = {}
  for on in (True, False):
    mcfg = with_kernels(cfg, on)
    encode = jax.jit(lambda p, tokens, cache, mcfg=mcfg: transformer.encode(p, mcfg, tokens, cache))
    empty = transformer.init_cache(mcfg, 1, prefix + c)

    def prefill():
      seconds = timed(encode, params, prompt, empty, repeats=max(1, repeats // 2))
      prefill_s[on] = seconds
      return {"ms": seconds * 1e3, "note": f"{prefix / seconds:,.0f} tokens/s"}

    suite.run("b", f"prefill {prefix} tokens B=1", onoff(on), prefill)
    cache = encode(params, prompt, empty)[1]
    decode = jax.jit(lambda p, x, cache, emb, mcfg=mcfg: transformer.decode(
        p, mcfg, x, cache, None, None, jnp.ones((x.shape[0],), bool), emb))
    for batch in shapes["batches"]:
      def step(batch=batch):
        cache_b = repeat_batch(cache, batch)
        emb = jnp.zeros((batch, c, cfg.hidden_size), cfg.compute_dtype)
        x = jnp.repeat(canvas, batch, axis=0)
        seconds = timed(decode, params, x, cache_b, emb, repeats=repeats)
        return {"ms": seconds * 1e3, "note": f"prefix {prefix}, self-conditioning on"}

      suite.run("b", f"decoder step B={batch}", onoff(on), step)

    def commit():
      seconds = timed(encode, params, canvas, cache, repeats=repeats)
      return {"ms": seconds * 1e3, "note": f"encoder pass over {c} tokens after {prefix}"}

    suite.run("b", "canvas commit B=1", onoff(on), commit)
    del cache
  for batch in shapes["batches"]:
    logits = jax.random.normal(jax.random.PRNGKey(1), (batch, c, cfg.vocab_size), jnp.float32)
    nbytes = logits.size * 4 + params["embedding"].size * params["embedding"].dtype.itemsize
    flops = 2 * batch * c * cfg.vocab_size * cfg.hidden_size
    for on in (True, False):
      fn = jax.jit((lambda p, t, r: sampler.fused_sample(p, cfg, t, r)) if on
                   else (lambda p, t, r: unfused_sample(p, cfg, t, r)))
      note = "fused" if on else "unfused"
      suite.run("b", f"sampling step B={batch}", onoff(on), lambda fn=fn, note=note: {
          **suite.rates(timed(fn, params, logits, jax.random.PRNGKey(2), repeats=repeats),
                        flops, nbytes), "note": note})
    del logits
  return prefill_s


# ----------------------------------------------------------------------------- (c) generation


def section_generate(suite: Suite, cfg: ModelConfig, shapes: dict, params, prefill_s: dict):
  steps = shapes["steps_per_canvas"]
  new_tokens, prefix = shapes["new_tokens"], shapes["prefix"]
  prompt = jnp.asarray(np.random.default_rng(3).integers(3, cfg.vocab_size, (1, prefix)),
                       jnp.int32)
  valid = jnp.ones_like(prompt, bool)
  for on in shapes["generate_kernels"]:
    # No row ends early (eos -1 is no token) and the adaptive stop never fires (entropy >= 0).
    mcfg = with_kernels(cfg, on)
    # No row ends early: an end id no token can equal (ModelConfig's own check would refuse it).
    object.__setattr__(mcfg, "eos_token_id", -1)
    scfg = sampler.SamplerConfig(max_denoising_steps=steps, confidence_threshold=0.0,
                                 max_new_tokens=new_tokens, fused_step=on)
    generate = sampler.make_generate_fn(mcfg, scfg)

    def run(generate=generate, on=on):
      start = time.perf_counter()
      out = jax.device_get(generate(params, prompt, valid, jax.random.PRNGKey(4)))  # compile
      cold_s = time.perf_counter() - start
      start = time.perf_counter()
      out = jax.device_get(generate(params, prompt, valid, jax.random.PRNGKey(5)))
      seconds = time.perf_counter() - start
      passes, canvases = int(out.decoder_passes[0]), int(out.num_canvases[0])
      tokens = int(out.num_tokens[0])
      decode_s = seconds - prefill_s.get(on, 0.0)
      step_ms = decode_s / passes * 1e3
      # The latency fields of eval.py's JSON (training/evaluation.latency_metrics), batch 1.
      return {"ms": seconds * 1e3, "cold_seconds": cold_s, "warm_seconds": seconds,
              "seconds_per_canvas": seconds / canvases,
              "tokens_per_second_warm": tokens / seconds, "note": (
          f"{passes} decoder passes ({steps}/canvas), {int(out.commit_passes[0])} commits; "
          f"cold {cold_s:.2f} s (compile included), warm {seconds:.3f} s, "
          f"{seconds / canvases:.3f} s per canvas, {tokens / seconds:,.0f} tokens/s warm; "
          f"{step_ms:.2f} ms per step after the prefill; {new_tokens / decode_s:,.0f} tokens/s "
          f"measured; {REPORT_TPF / step_ms * 1e3:,.0f} tokens/s at TPF {REPORT_TPF} "
          f"(report: {REPORT_STEP_MS} ms, 1,456)")}

    suite.run("c", f"generate {new_tokens} tokens after {prefix}, B=1", onoff(on), run)


# ----------------------------------------------------------------------------- (d) LoRA step


def lora_step_config(cfg: ModelConfig, kernels: bool, base_dtype: str):
  """The sft_sudoku_lora recipe on one device at batch 1, on `cfg`'s architecture."""
  from configs import sft_sudoku_lora

  config = sft_sudoku_lora.get_config()
  numerics = dict(attention_impl="pallas", moe_impl="pallas") if kernels else {}
  for field, value in {**dataclasses_dict(cfg), "remat": "full", "moe_impl": "tiled_scan",
                       "attention_impl": "xla", **numerics}.items():
    config.model[field] = list(value) if isinstance(value, tuple) else value
  config.batch_size, config.grad_accum_steps, config.sharding.fsdp = 1, 1, 1
  config.lora.base_dtype = base_dtype
  if base_dtype in quantize.QTYPES:
    import ml_collections

    config.quantize = ml_collections.ConfigDict(dict(group_size=128, scale_dtype="bfloat16"))
  return config


def dataclasses_dict(cfg: ModelConfig) -> dict:
  import dataclasses

  return dataclasses.asdict(cfg)


def section_lora(suite: Suite, cfg: ModelConfig, params, variants, repeats: int):
  rng = np.random.default_rng(6)
  for name, kernels, base_dtype in variants:
    def run(kernels=kernels, base_dtype=base_dtype):
      config = lora_step_config(cfg, kernels, base_dtype)
      task = make_task(config)
      p, seq_len = task.layout.prompt_len, task.layout.seq_len
      batch = {"tokens": jnp.asarray(rng.integers(3, cfg.vocab_size, (1, seq_len)), jnp.int32),
               "valid": jnp.ones((1, seq_len), bool),
               "loss_mask": jnp.asarray(np.arange(seq_len)[None] >= p)}
      _, step_fn, state, frozen = make_step(config, frozen=params, task=task)
      compiled = step_fn.lower(state, frozen, batch).compile()
      mem = compiled.memory_analysis()
      state = jax.block_until_ready(compiled(state, frozen, batch)[0])  # the state is donated
      times = []
      for _ in range(max(1, repeats // 2)):
        start = time.perf_counter()
        state = jax.block_until_ready(compiled(state, frozen, batch)[0])
        times.append(time.perf_counter() - start)
      seconds = float(np.median(times))
      plan = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
              + mem.temp_size_in_bytes) / GIB
      peak = memory_stats().get("peak_bytes_in_use")
      note = (f"XLA plan {plan:.1f} GiB (base {quantize.nbytes(frozen) / GIB:.1f}, temporaries "
              f"{mem.temp_size_in_bytes / GIB:.1f})"
              + (f"; device peak so far {peak / GIB:.1f} GiB" if peak else ""))
      return {"ms": seconds * 1e3, "note": note}

    suite.run("d", f"SFT step B=1: {name}", "on" if kernels else "off", run)


# ----------------------------------------------------------------------------- main


def write(suite: Suite, out_dir: str, header: list[str]):
  errors.prepare_output_file(out_dir, "out", directory=True)
  table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
  table += [format_row(r) for r in suite.rows]
  text = "\n".join(header + [""] + table) + "\n"
  with open(os.path.join(out_dir, "gpu_suite.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out_dir, "gpu_suite.json"), "w") as f:
    json.dump({"header": header, "device": provenance.device_info(), "rows": suite.rows}, f,
              indent=1)
  print("\n" + text)


def main(argv):
  del argv
  if not _OUT.value:
    raise cli.UserError("--out=DIR is required")
  errors.check_output_file(_OUT.value, "out", directory=True)
  smoke, repeats = _SMOKE.value, _REPEATS.value
  if smoke:
    repeats = 1
  cfg, shapes = model_configs(smoke)
  device = jax.devices()[0]
  peaks = kernel_bench.device_peaks(jnp.bfloat16, smoke, repeats)
  limit = memory_stats().get("bytes_limit")
  info = provenance.device_info()
  header = [
      f"GPU suite, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}: "
      f"{device.device_kind} ({jax.default_backend()}), {len(jax.devices())} device(s), "
      f"jax {jax.__version__}, CPU {info['cpu']}" + (f", {limit / GIB:.0f} GiB" if limit else "")
      + (" [smoke: tiny shapes, times not meaningful]" if smoke else ""),
      f"measured peaks: {peaks[0] / 1e12:.3g} TFLOP/s (bf16 matmul), {peaks[1] / 1e9:.3g} GB/s "
      f"(copy); model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_experts} "
      f"experts top-{cfg.top_k_experts}, canvas {cfg.canvas_length}, prefix {shapes['prefix']}, "
      f"random bf16 weights"]
  print("\n".join(header), flush=True)
  budget = _BUDGET.value if _BUDGET.value is not None else (float("inf") if smoke else 7.5)
  suite = Suite(60 * budget, peaks)
  sections = set(_SECTIONS.value)
  if "a" in sections:
    section_kernels(suite, cfg, shapes, repeats)
  params = None
  if sections & {"b", "c", "d"}:
    start = time.perf_counter()
    params = random_params(cfg)
    print(f"random weights: {transformer.count_params(params) / 1e9:.2f}B parameters in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
  prefill_s = {}
  if "b" in sections:
    prefill_s = section_model(suite, cfg, shapes, params, repeats) or {}
  if "c" in sections:
    section_generate(suite, cfg, shapes, params, prefill_s)
  if "d" in sections:
    section_lora(suite, cfg, params, shapes["lora_variants"], repeats)
  header.append(f"total {time.perf_counter() - suite.start:.0f} s")
  write(suite, _OUT.value, header)


if __name__ == "__main__":
  cli.run(main)
