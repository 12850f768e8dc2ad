"""Convert model checkpoints between transformers' layout and ours.

  # released DiffusionGemma (transformers safetensors) -> our orbax format, in bfloat16
  python scripts/convert_checkpoint.py --from=diffusiongemma-26B-A4B-it --to=ckpt/dg26b \
      --format=orbax --dtype=bfloat16
  # a training run or an orbax model -> transformers (DiffusionGemmaForBlockDiffusion)
  python scripts/convert_checkpoint.py --from=runs/sudoku --to=export/sudoku --format=hf
  # Gemma 4 AR checkpoint -> a new DiffusionGemma (self-conditioning block freshly initialised)
  python scripts/convert_checkpoint.py --from=gemma-4-26B-A4B --to=ckpt/dg_init --format=orbax

The destination must not exist yet; it is written under a temporary name and renamed when
complete, so a failed conversion leaves nothing behind. Tokenizer files travel along.
"""

import os

from absl import flags

from diffgemma import cli

_FROM = flags.DEFINE_string("from", None, "Source: transformers checkpoint dir (DiffusionGemma or "
                            "Gemma 4), orbax model dir, or training workdir.")
_TO = flags.DEFINE_string("to", None, "Destination directory (must not exist).")
_FORMAT = flags.DEFINE_enum("format", None, ["hf", "orbax"],
                            "Output format (default: orbax from a transformers dir, else hf).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                           "Parameter dtype of the output (default: the source's).")
_CANVAS = flags.DEFINE_integer("canvas_length", None,
                               "Canvas length of a model made from Gemma 4 (default 256).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the fresh self-conditioning block (Gemma 4).")
_SHARD_GB = flags.DEFINE_float("max_shard_gb", 5.0, "Largest safetensors shard (hf output), GB.")


def main(argv):
  del argv
  source, dest = flags.FLAGS["from"].value, _TO.value
  if not source or not dest:
    raise cli.UserError("--from and --to are required")
  if _SHARD_GB.value <= 0:
    raise cli.UserError(f"--max_shard_gb must be positive, got {_SHARD_GB.value}")
  if _CANVAS.value is not None and _CANVAS.value < 1:
    raise cli.UserError(f"--canvas_length must be >= 1, got {_CANVAS.value}")
  if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
    raise cli.UserError(f"destination {dest} already exists and is not empty; choose a new "
                        "directory")  # checked before the weights load (minutes for a big model)
  import jax

  from diffgemma.io import model_dirs
  from diffgemma.model import transformer

  kind = model_dirs.directory_kind(source)
  out_format = _FORMAT.value or ("orbax" if kind == model_dirs.HF else "hf")
  overrides = {} if _CANVAS.value is None else {"canvas_length": _CANVAS.value}
  cfg, params = model_dirs.load_model(source, dtype=_DTYPE.value,
                                         rng=jax.random.PRNGKey(_SEED.value), **overrides)
  counts = transformer.param_counts(cfg)
  tower = (f", and a vision tower of {counts['vision'] / 1e9:.3f}B" if cfg.vision is not None
           else "")
  print(f"loaded {source} ({kind}): {counts['total'] / 1e9:.3f}B parameters, "
        f"{counts['active'] / 1e9:.3f}B active per token{tower}, {cfg.param_dtype}")
  if out_format == "hf":
    files = model_dirs.save_hf(cfg, params, dest, max_shard_bytes=int(_SHARD_GB.value * 2**30),
                                  companions_from=source)
    print(f"wrote {dest}: {len(files)} files in transformers' DiffusionGemma layout")
  else:
    model_dirs.save_orbax(cfg, params, dest, companions_from=source)
    print(f"wrote {dest}: orbax model (config.json + params/)")


if __name__ == "__main__":
  cli.run(main)
