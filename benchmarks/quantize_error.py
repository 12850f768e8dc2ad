"""Round-trip error of the weight quantizer (qwix) against a plain absmax / qmax quantizer.

  python benchmarks/quantize_error.py [--workdir=RUN]

For each format (int8 per channel, int4 per channel, int4 in groups of 128 rows), the relative
RMS error ||dequantize(quantize(W)) - W|| / ||W|| over the linear weights that
diffgemma/model/quantize.py quantizes: of a training run's checkpoint (--workdir) and of Gaussian
[2816, 1408] matrices (the 26B-A4B's expert gate/up shape). qwix maps the absmax to qmax + 1/2
(the top bucket fully used); the plain quantizer maps it to qmax. Printed as ratios to the plain
quantizer's error.
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from diffgemma import cli
from diffgemma.model import lora, quantize

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run whose weights to measure.")

FORMATS = (("int8", 0), ("int4", 0), ("int4", 128))


def plain_round_trip(w, layout, dtype: str, group_size: int):
  """absmax / qmax scales over the same groups as quantize.quantize_weight."""
  w = np.asarray(w, np.float64)
  num_expert, num_in = layout
  last_in = num_expert + num_in - 1
  group = quantize.group_size_for(w.shape[last_in], group_size)
  qmax = 127 if dtype == "int8" else 7
  split = w.reshape(w.shape[:last_in] + (w.shape[last_in] // group, group) + w.shape[last_in + 1:])
  reduce = tuple(range(num_expert, last_in)) + (last_in + 1,)
  scale = np.max(np.abs(split), axis=reduce, keepdims=True) / qmax
  scale = np.where(scale > 0, scale, 1.0)
  return (np.clip(np.round(split / scale), -qmax - 1, qmax) * scale).reshape(w.shape)


def errors(weights: dict) -> dict:
  """{format: (qwix relative RMS error, plain relative RMS error)} pooled over `weights`."""
  out = {}
  for dtype, group in FORMATS:
    cfg = quantize.QuantizeConfig(dtype, group_size=group)
    sq_q = sq_p = total = 0.0
    for name, w in weights.items():
      layout = lora.linear_layout(name)
      deq = np.asarray(quantize.quantize_weight(jnp.asarray(w), layout, cfg).astype(jnp.float32),
                       np.float64)
      w64 = np.asarray(w, np.float64)
      sq_q += np.sum((deq - w64) ** 2)
      sq_p += np.sum((plain_round_trip(w, layout, dtype, group) - w64) ** 2)
      total += np.sum(w64 ** 2)
    out[f"{dtype}, {'per channel' if group == 0 else f'groups of {group}'}"] = (
        np.sqrt(sq_q / total), np.sqrt(sq_p / total))
  return out


def main(argv):
  del argv
  sets = {}
  rng = np.random.default_rng(0)
  sets["Gaussian [2816, 1408] x 4"] = {f"layers.{i}.mlp.gate": rng.normal(0, 0.02, (2816, 1408))
                                       .astype(np.float32) for i in range(4)}
  if _WORKDIR.value:
    from diffgemma.training import loaded

    run = loaded.load_run(_WORKDIR.value)
    leaves = jax.tree_util.tree_flatten_with_path(run.params)[0]
    targets = set(quantize.target_paths(run.params, quantize.QuantizeConfig()))
    sets[f"{_WORKDIR.value} (step {run.step})"] = {
        lora.dotted(p): np.asarray(x, np.float32) for p, x in leaves if lora.dotted(p) in targets}
  print("| weights | format | qwix rel. RMS error | plain absmax/qmax | qwix / plain |")
  print("|---|---|---|---|---|")
  for label, weights in sets.items():
    for fmt, (q, p) in errors(weights).items():
      print(f"| {label} | {fmt} | {q:.4f} | {p:.4f} | {q / p:.3f} |")


if __name__ == "__main__":
  cli.run(main)
