"""Lower every kernel and jitted program for GPU and TPU on this host, and list the results.

  python scripts/lower_programs.py                       # cuda and tpu, all groups
  python scripts/lower_programs.py --platforms=cuda --groups=train_step --devices=2 --json=F

Groups: "kernels" (canvas attention sliding/full, the MoE grouped matmul, forward and backward,
and the fused sampling step, at the 26B-A4B layer shapes in bfloat16, canvas 256, prefix 4096,
batch 1 and 8), "model" (the decoder step at batch 1 and 8 and the per-canvas sampler loop of a
2-layer 26B-shaped model) and "train_step" (the LoRA SFT step of `configs/sft_sudoku_lora.py` at
2 layers on a `--devices` mesh, simulated on the CPU). On "cuda" the Pallas kernels are selected
(attention_impl / moe_impl "pallas", fused_step); on "tpu" the XLA paths, plus one check that
selecting a Pallas kernel there is refused with a one-line error. Nothing is allocated.
Prints a markdown table; exits 1 if anything expected to lower did not.
"""

import json
import os
import sys

from absl import flags

from diffgemma import cli, errors

_PLATFORMS = flags.DEFINE_list("platforms", ["cuda", "tpu"], "Platforms to lower for.")
_GROUPS = flags.DEFINE_list("groups", ["kernels", "model", "train_step"], "Program groups.")
_DEVICES = flags.DEFINE_integer("devices", 2, "Simulated CPU devices for the train-step mesh.")
_LAYERS = flags.DEFINE_integer("train_layers", 2, "Layers of the 26B-shaped train-step model.")
_JSON = flags.DEFINE_string("json", None, "Also write the results here as JSON.")

GPU_PLATFORMS = ("cuda", "rocm")


def programs(platform: str, groups, lowering):
  """(program, expected to lower) pairs for one platform."""
  pallas = platform in GPU_PLATFORMS
  cfg = lowering.model_config(pallas=pallas)
  out = []
  if "kernels" in groups:
    out += [(p, True) for p in lowering.kernel_programs(cfg, pallas=pallas)]
    if not pallas:  # the Pallas kernels themselves must be refused, in one line
      kernels = lowering.kernel_programs(lowering.model_config(pallas=True), batches=(1,))
      out += [(p, False) for p in kernels if p.pallas and p.name.endswith("_fwd")]
  if "model" in groups:
    out += [(p, True) for p in lowering.model_programs(cfg)]
  if "train_step" in groups:
    from configs import sft_sudoku_lora

    config = sft_sudoku_lora.get_config()
    config.model.num_layers = _LAYERS.value
    config.model.layer_types = ()
    config.sharding.fsdp = _DEVICES.value
    out.append((lowering.train_step_program(config, pallas), True))
  return out


def main(argv):
  del argv
  os.environ["XLA_FLAGS"] = " ".join(
      [os.environ.get("XLA_FLAGS", ""),
       f"--xla_force_host_platform_device_count={_DEVICES.value}"]).strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from diffgemma.tools import lowering  # after XLA_FLAGS: jax starts here

  results, failures = [], []
  for platform in _PLATFORMS.value:
    for program, expected in programs(platform, _GROUPS.value, lowering):
      result = lowering.lower(program, platform)
      results.append(result)
      refused_in_one_line = (not result.ok and result.error.startswith("KernelPlatformError")
                             and "\n" not in result.error)
      if (result.ok != expected or (expected and program.pallas and result.kernels == 0)
          or (not expected and not refused_in_one_line)):
        failures.append(result.name)
  print(lowering.format_results(results))
  if _JSON.value:
    with open(errors.prepare_output_file(_JSON.value, "json"), "w") as f:
      json.dump([lowering.as_dict(r) for r in results], f, indent=1)
  if failures:
    print(f"unexpected: {', '.join(failures)}")
    sys.exit(1)


if __name__ == "__main__":
  cli.run(main)
