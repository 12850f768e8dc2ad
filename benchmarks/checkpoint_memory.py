"""Host memory of a checkpoint import: peak RSS against the size of the loaded parameters.

  python benchmarks/checkpoint_memory.py [--hidden_size=1024 --num_layers=6 --num_experts=32]

Writes a random model in transformers' layout (sharded safetensors) to a temporary directory,
then imports it in a fresh process for each dtype and prints the peak resident memory, the
parameter bytes and their difference. A streaming import needs one copy of the parameters plus
a few copies of the largest tensor, never two copies of the model.
"""

import os
import subprocess
import sys
import tempfile

from absl import flags

from diffgemma import cli

_HIDDEN = flags.DEFINE_integer("hidden_size", 1024, "Hidden size of the test model.")
_LAYERS = flags.DEFINE_integer("num_layers", 6, "Layers.")
_EXPERTS = flags.DEFINE_integer("num_experts", 32, "Experts per layer.")
_VOCAB = flags.DEFINE_integer("vocab_size", 32768, "Vocabulary.")
_SHARD_MB = flags.DEFINE_integer("shard_mb", 256, "Shard size of the written checkpoint.")
_LOAD = flags.DEFINE_string("load", None, "Internal: import this directory and report.")
_DTYPE = flags.DEFINE_string("dtype", "float32", "Internal: import dtype.")

GIB = 2**30


def _peak_rss_gib() -> float:
  """This process's peak resident memory (Linux VmHWM; ru_maxrss would carry over the parent's
  peak across exec)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024 / GIB
  raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def load_and_report(path: str, dtype: str) -> None:
  import jax

  from diffgemma.io import model_dirs

  before = _peak_rss_gib()
  _, params = model_dirs.load_model(path, dtype=dtype, log=lambda _: None)
  jax.block_until_ready(params)
  param_gib = sum(x.nbytes for x in jax.tree_util.tree_leaves(params)) / GIB
  peak = _peak_rss_gib()
  print(f"{dtype:>9}: params {param_gib:.2f} GiB | peak RSS {peak:.2f} GiB (before import "
        f"{before:.2f}) | peak - before - params = {peak - before - param_gib:.2f} GiB")


def main(argv):
  del argv
  if _LOAD.value:
    load_and_report(_LOAD.value, _DTYPE.value)
    return
  import jax

  from diffgemma.io import model_dirs
  from diffgemma.model import transformer
  from diffgemma.model.config import ModelConfig

  cfg = ModelConfig(vocab_size=_VOCAB.value, hidden_size=_HIDDEN.value,
                    intermediate_size=_HIDDEN.value, num_layers=_LAYERS.value, num_heads=8,
                    num_kv_heads=4, head_dim=128, global_head_dim=256, num_global_kv_heads=2,
                    num_experts=_EXPERTS.value, top_k_experts=4,
                    moe_intermediate_size=_HIDDEN.value // 2)
  counts = transformer.param_counts(cfg)
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "ckpt")
    model_dirs.save_hf(cfg, transformer.init_params(cfg, jax.random.PRNGKey(0)), path,
                          max_shard_bytes=_SHARD_MB.value * 2**20)
    on_disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / GIB
    largest = max(x.size for x in jax.tree_util.tree_leaves(transformer.abstract_params(cfg)))
    print(f"model: {counts['total'] / 1e6:.0f}M parameters, {on_disk:.2f} GiB on disk "
          f"(float32), largest tensor {largest * 4 / GIB:.3f} GiB")
    for dtype in ("float32", "bfloat16"):
      subprocess.run([sys.executable, os.path.abspath(__file__), f"--load={path}",
                      f"--dtype={dtype}"], check=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))


if __name__ == "__main__":
  cli.run(main)
