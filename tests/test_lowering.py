"""Every kernel and jitted program lowers for CUDA and TPU on this CPU-only host (jax.export).

The programs have the 26B-A4B shapes in bfloat16 (canvas 256, prefix 4096, batch 1 and 8) and
are built from jax.ShapeDtypeStructs, so nothing is allocated. On CUDA the Pallas kernels must
appear as Triton custom calls (not interpret mode); on TPU the XLA paths lower and selecting a
Pallas kernel is a one-line KernelPlatformError. The 2-device LoRA train step runs in a
subprocess with two simulated CPU devices, so this process keeps its single device.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from diffgemma.model.kernels import attention as attention_kernel
from diffgemma.model.kernels import platform
from diffgemma.tools import lowering

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lower_all(programs, target):
  results = [(p, lowering.lower(p, target)) for p in programs]
  failed = [f"{r.name}: {r.error}" for _, r in results if not r.ok]
  assert not failed, "did not lower for " + target + ":\n" + "\n".join(failed)
  return results


def test_kernels_forward_and_backward_lower_for_cuda_as_triton_calls():
  cfg = lowering.model_config(pallas=True)
  results = lower_all(lowering.kernel_programs(cfg, batches=(1, 8)), "cuda")
  names = [p.name for p, _ in results]
  for kernel in ("attention_sliding", "attention_full", "moe"):
    for batch in (1, 8):
      assert f"{kernel}_B{batch}_fwd" in names and f"{kernel}_B{batch}_bwd" in names
  assert "fused_sample_B1" in names and "fused_sample_B8" in names
  for program, result in results:
    if program.pallas:  # compiled kernels: Triton custom calls in the module
      assert result.kernels >= 1, program.name
  moe_bwd = next(r for p, r in results if p.name == "moe_B1_bwd")
  assert moe_bwd.kernels == 6  # forward recomputation (2) + activation grad + dx + 2 x dW


def test_model_programs_lower_for_cuda_with_the_kernels_selected():
  cfg = lowering.model_config(pallas=True)
  results = lower_all(lowering.model_programs(cfg, batches=(1, 8)), "cuda")
  for program, result in results:
    # 2 layers: one attention and two MoE kernels (gate/up, down) each.
    assert result.kernels == 6, program.name


def test_xla_paths_lower_for_tpu():
  cfg = lowering.model_config(pallas=False)
  results = lower_all(lowering.kernel_programs(cfg, batches=(1, 8), pallas=False)
                      + lowering.model_programs(cfg, batches=(1, 8)), "tpu")
  assert all(r.kernels == 0 for _, r in results)


def test_selecting_a_pallas_kernel_on_tpu_is_a_one_line_config_error():
  cfg = lowering.model_config(pallas=True)
  for program in (lowering.attention_programs(cfg, 1, True)[0],
                  lowering.moe_programs(cfg, 1, True)[0], lowering.decoder_step_program(cfg, 1)):
    result = lowering.lower(program, "tpu")
    assert not result.ok
    assert result.error.startswith("KernelPlatformError") and "\n" not in result.error
    assert "attention_impl='xla'" in result.error or "moe_impl='tiled'" in result.error


def test_an_interpret_mode_trace_never_lowers_for_an_accelerator():
  # Traced for the CPU (interpret mode chosen automatically), then exported for CUDA: refused.
  program = lowering.attention_programs(lowering.model_config(pallas=True), 1, True)[0]
  with pytest.raises(platform.KernelPlatformError, match="traced for the CPU"):
    jax.export.export(jax.jit(program.fn), platforms=["cuda"])(*program.args)
  # The same trace lowers for the CPU, where interpret mode is the rule.
  jax.jit(program.fn).lower(*program.args)
  # Explicit interpret=False on the CPU is not silently interpreted either.
  q = jnp.zeros((1, 16, 2, 16))
  pos = jnp.zeros((1, 16), jnp.int32)
  with pytest.raises(Exception, match="interpret"):
    jax.jit(lambda q: attention_kernel.canvas_attention(
        q, q, q, pos, pos, pos, pos > 0, None, interpret=False)).lower(q).compile()


def test_lora_train_step_on_a_two_device_mesh_lowers_for_cuda_and_tpu(tmp_path):
  out = tmp_path / "lowered.json"
  proc = subprocess.run(
      [sys.executable, "scripts/lower_programs.py", "--groups=train_step", "--devices=2",
       f"--json={out}"], cwd=ROOT, capture_output=True, text=True, timeout=600,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  results = {r["platform"]: r for r in json.loads(out.read_text())}
  assert results["cuda"]["ok"] and results["tpu"]["ok"]
  assert results["cuda"]["name"] == "train_step_lora_2dev"
  assert results["cuda"]["kernels"] > 0 and results["tpu"]["kernels"] == 0
