"""Every kernel and jitted program, lowered for an accelerator on this host (no device needed).

`jax.export(jax.jit(fn), platforms=[P])` lowers a program for platform P ("cuda", "rocm",
"tpu") on a CPU-only machine, Pallas kernels included (they become Triton custom calls for
CUDA). A kernel whose block shapes, dtypes or primitives a backend does not support fails here,
not on the first GPU. Inputs are `jax.ShapeDtypeStruct`s: nothing is allocated, so the programs
have the 26B-A4B shapes.

`programs(platform, ...)` builds the catalogue for one platform: on "cuda" the Pallas kernels
(forward and backward) and the model programs with `attention_impl="pallas"`,
`moe_impl="pallas"`, `fused_step=True`; on "tpu" the same programs on the XLA paths, since the
Pallas kernels are GPU (Triton) kernels that refuse TPU with a one-line error
(`kernels.platform`). `lower` exports one program and reports what it became.

Shape suffixes as in diffgemma/model/transformer.py.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from diffgemma.model import attention_mask, layers, moe, sharding, transformer
from diffgemma.model.config import FULL, SLIDING, ModelConfig, gemma_26b_a4b
from diffgemma.model.kernels import attention as attention_kernel
from diffgemma.model.kernels import moe as moe_kernel
from diffgemma.model.kernels import platform as kernel_platform
from diffgemma.sampling import sampler

# Custom-call targets of the Pallas kernels, per platform: they have no export compatibility
# guarantee, so jax.export must be told to accept them.
KERNEL_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu", "tpu_custom_call")
CANVAS = 256
PREFIX = 4096
S = jax.ShapeDtypeStruct


@dataclasses.dataclass
class Program:
  """A function and abstract arguments to lower; `pallas` says it should contain kernels."""
  name: str
  fn: Callable
  args: tuple
  pallas: bool = False


@dataclasses.dataclass
class Lowered:
  name: str
  platform: str
  ok: bool
  seconds: float
  kernels: int = 0  # Pallas custom calls in the lowered module
  error: str = ""


def model_config(num_layers: int = 2, pallas: bool = False, **overrides) -> ModelConfig:
  """The 26B-A4B in bfloat16 with `num_layers` layers (2: one sliding and one full layer)."""
  types = (SLIDING,) * (num_layers - 1) + (FULL,)
  impls = (dict(attention_impl="pallas", moe_impl="pallas") if pallas
           else dict(attention_impl="xla", moe_impl="tiled"))
  return gemma_26b_a4b(num_layers=num_layers, layer_types=types, param_dtype="bfloat16",
                       compute_dtype="bfloat16", **{**impls, **overrides})


def abstract_cache(cfg: ModelConfig, batch: int, slots: int):
  return jax.tree_util.tree_map(lambda x: S(x.shape, x.dtype),
                                jax.eval_shape(lambda: transformer.init_cache(cfg, batch, slots)))


# ----------------------------------------------------------------------------- kernels


def attention_programs(cfg: ModelConfig, batch: int, pallas: bool) -> list[Program]:
  """Canvas attention on a sliding and a full layer, forward and backward (w.r.t. q, k, v), with
  segment ids (packed rows: the kernel's every input)."""
  out = []
  for layer_type in (SLIDING, FULL):
    hd = cfg.head_dim if layer_type == SLIDING else cfg.global_head_dim
    kv = cfg.num_kv_heads if layer_type == SLIDING else cfg.num_global_kv_heads
    window = cfg.sliding_window if layer_type == SLIDING else None
    slots = PREFIX + CANVAS
    dt = jnp.dtype(cfg.compute_dtype)
    args = (S((batch, CANVAS, cfg.num_heads, hd), dt), S((batch, slots, kv, hd), dt),
            S((batch, slots, kv, hd), dt), S((batch, CANVAS), jnp.int32),
            S((batch, CANVAS), jnp.int32), S((batch, slots), jnp.int32), S((batch, slots), bool),
            S((batch, CANVAS), jnp.int32), S((batch, slots), jnp.int32))

    def fwd(q, k, v, anchor, limit, pos, valid, q_seg, kv_seg, window=window):
      if pallas:
        return attention_kernel.canvas_attention(q, k, v, anchor, limit, pos, valid, window,
                                                 q_segment_BxT=q_seg, kv_segment_BxS=kv_seg)
      return layers.attend(q, k, v, attention_mask.attention_mask(anchor, limit, pos, valid,
                                                                window, q_seg, kv_seg))

    def bwd(q, k, v, anchor, limit, pos, valid, q_seg, kv_seg, fwd=fwd):
      out, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, anchor, limit, pos, valid, q_seg, kv_seg),
                         q, k, v)
      return vjp(out)

    name = f"attention_{layer_type.split('_')[0]}_B{batch}"
    out += [Program(f"{name}_fwd", fwd, args, pallas), Program(f"{name}_bwd", bwd, args, pallas)]
  return out


def moe_programs(cfg: ModelConfig, batch: int, pallas: bool) -> list[Program]:
  """The grouped expert MLP over one canvas's token-expert rows, forward and backward."""
  m = batch * CANVAS * cfg.top_k_experts
  e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
  dt = jnp.dtype(cfg.compute_dtype)
  args = (S((m, d), dt), S((e,), jnp.int32), S((e, d, 2 * i), dt), S((e, i, d), dt),
          S((m,), jnp.float32))

  def fwd(x, group_sizes, gate_up, down, row_weights):
    if pallas:
      return moe_kernel.expert_mlp(x, group_sizes, gate_up, down, row_weights)
    groups = moe.ExpertGroups.make(group_sizes, m, cfg)
    gate, up = jnp.split(moe.expert_matmul(groups.to_rows(x), gate_up, groups), 2, axis=-1)
    y = groups.from_rows(moe.expert_matmul(layers.gelu_tanh(gate) * up, down, groups))
    return y * row_weights[:, None].astype(y.dtype)

  def bwd(x, group_sizes, gate_up, down, row_weights):
    out, vjp = jax.vjp(lambda x, gu, dn, w: fwd(x, group_sizes, gu, dn, w), x, gate_up, down,
                       row_weights)
    return vjp(out)

  return [Program(f"moe_B{batch}_fwd", fwd, args, pallas),
          Program(f"moe_B{batch}_bwd", bwd, args, pallas)]


def fused_sample_program(cfg: ModelConfig, batch: int) -> Program:
  """The fused sampling step on [B, C, V] tempered logits (draw, argmax, entropy, embedding)."""
  params = {"embedding": S((cfg.vocab_size, cfg.hidden_size), jnp.dtype(cfg.param_dtype))}

  def fn(params, tempered, rng):
    return sampler.fused_sample(params, cfg, tempered, rng)

  return Program(f"fused_sample_B{batch}", fn,
                 (params, S((batch, CANVAS, cfg.vocab_size), jnp.float32),
                  S((2,), jnp.uint32)))


# ----------------------------------------------------------------------------- model programs


def decoder_step_program(cfg: ModelConfig, batch: int) -> Program:
  """One decoder pass over a canvas after a 4096-token cached prefix, with self-conditioning
  from the previous step's embedding (as the fused sampler feeds it)."""
  params = jax.tree_util.tree_map(lambda x: S(x.shape, x.dtype), transformer.abstract_params(cfg))
  cache = abstract_cache(cfg, batch, PREFIX + CANVAS)
  dt = jnp.dtype(cfg.compute_dtype)

  def fn(params, canvas, cache, embedding):
    return transformer.decode(params, cfg, canvas, cache, None, None, jnp.ones((batch,), bool),
                              embedding)

  return Program(f"decoder_step_B{batch}", fn,
                 (params, S((batch, CANVAS), jnp.int32), cache,
                  S((batch, CANVAS, cfg.hidden_size), dt)),
                 cfg.attention_impl == "pallas")


def sampler_loop_program(cfg: ModelConfig, batch: int, fused: bool = True) -> Program:
  """The per-canvas denoising loop (`sampler.denoise_canvas`, report defaults)."""
  params = jax.tree_util.tree_map(lambda x: S(x.shape, x.dtype), transformer.abstract_params(cfg))
  cache = abstract_cache(cfg, batch, PREFIX + CANVAS)
  sampler_cfg = sampler.SamplerConfig(fused_step=fused)

  def fn(params, cache, rng):
    return sampler.denoise_canvas(params, cfg, sampler_cfg, cache, rng)

  return Program(f"sampler_loop_B{batch}", fn, (params, cache, S((2,), jnp.uint32)),
                 cfg.attention_impl == "pallas")


def train_step_program(config, pallas: bool) -> Program:
  """The training update step of `config` (an ml_collections config; LoRA or full) on the mesh
  of the process's devices, against abstract state and batch, as `--dry_run` builds it."""
  from diffgemma.training import memory_plan  # local: the training layers sit above this module

  config = config.copy_and_resolve_references()
  if pallas:
    config.model.attention_impl, config.model.moe_impl = "pallas", "pallas"
  step, args, setup, _ = memory_plan.training_program(config)
  name = f"train_step_{'lora' if setup.uses_lora else 'full'}_{setup.mesh.size}dev"
  return Program(name, step, args, pallas)


def kernel_programs(cfg: ModelConfig, batches=(1, 8), pallas: bool = True) -> list[Program]:
  out = []
  for batch in batches:
    out += attention_programs(cfg, batch, pallas) + moe_programs(cfg, batch, pallas)
    out.append(fused_sample_program(cfg, batch))
  return out


def model_programs(cfg: ModelConfig, batches=(1, 8)) -> list[Program]:
  return ([decoder_step_program(cfg, b) for b in batches]
          + [sampler_loop_program(cfg, batches[0])])


# ----------------------------------------------------------------------------- lowering


def lower(program: Program, platform: str) -> Lowered:
  """Export `program` for `platform`; the Pallas kernels are traced for that platform."""
  start = time.perf_counter()
  fn = program.fn if hasattr(program.fn, "lower") else jax.jit(program.fn)
  checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in KERNEL_TARGETS]
  try:
    with kernel_platform.target(platform):
      exported = jax.export.export(fn, platforms=[platform], disabled_checks=checks)(
          *program.args)
  except Exception as e:  # reported, not raised: the caller lists what does not lower
    text = str(e).strip().splitlines()
    return Lowered(program.name, platform, False, time.perf_counter() - start,
                   error=f"{type(e).__name__}: {text[0] if text else ''}"[:300])
  module = exported.mlir_module()
  kernels = sum(module.count(f"custom_call @{t}(") for t in KERNEL_TARGETS)
  return Lowered(program.name, platform, True, time.perf_counter() - start, kernels)


def format_results(results: list[Lowered]) -> str:
  lines = ["| platform | program | lowered | Pallas custom calls | seconds | note |",
           "|---|---|---|---|---|---|"]
  for r in results:
    lines.append(f"| {r.platform} | {r.name} | {'yes' if r.ok else 'no'} | {r.kernels} | "
                 f"{r.seconds:.1f} | {r.error} |")
  return "\n".join(lines)


def as_dict(result: Lowered) -> dict[str, Any]:
  return dataclasses.asdict(result)
