"""Total and per-token active parameter counts of a model preset, without allocating weights.

  python scripts/param_counts.py [--preset=gemma_26b_a4b]

"Active" counts what one token's forward pass touches: the embedding (tied with the LM head),
all attention, dense-MLP, router and norm weights, and top_k of num_experts experts per layer.
The decoder-only self-conditioning block is listed separately and not in the totals.
"""

from absl import flags

from diffgemma import cli
from diffgemma.model import config, transformer

_PRESET = flags.DEFINE_enum("preset", "gemma_26b_a4b", sorted(config.PRESETS), "Model preset.")


def main(argv):
  del argv
  cfg = config.PRESETS[_PRESET.value]()
  counts = transformer.param_counts(cfg)
  print(f"preset {_PRESET.value}: {cfg.num_layers} layers, {cfg.num_experts} experts "
        f"(top {cfg.top_k_experts}), hidden {cfg.hidden_size}")
  for name in ("total", "active", "embedding", "experts", "self_conditioning"):
    print(f"  {name:<18} {counts[name]:>15,d}  ({counts[name] / 1e9:.3g}B)")


if __name__ == "__main__":
  cli.run(main)
