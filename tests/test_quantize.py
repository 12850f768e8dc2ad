"""Weight-only int8 / int4 quantization (diffgemma/model/quantize.py): the quantizer against a float64
numpy reference, the model on a quantized tree against the same model on its dequantized float
weights, the logits cost on a tiny random model, and QLoRA training.

Tolerances:
  round trip: values equal the float64 reference's except at rounding ties (w / scale within
    1e-5 of a half-integer, e.g. a negative absmax at -(qmax + 1/2), where float32 division may
    land on the other side: off by one step); scales to 1e-6 relative;
    |dequantized - w| <= scale / 2 + 1e-6 |w| (round to nearest; absmax maps to qmax + 1/2).
  quantized tree vs dequantized float weights, logits: 2e-5 absolute (same weights; only the
    order of float32 operations may differ).
  one matmul through a quantized weight: |dy| <= sum_i |x_i| scale_i / 2 for every output (the
    rounding bound), and its RMS within 20% of sqrt(sum_i x_i^2 scale_i^2 / 12) (independent
    errors uniform on +-scale/2); the scales equal per-group absmax / (qmax + 1/2) to 1e-6.
  logits vs float32 on a 2-layer tiny random model (observed: int8 relative RMS 0.037-0.044,
    int4 0.52-0.57 per channel, with XLA optimisations off / on): int8 <= 0.07, int4 <= 0.75
    relative RMS (about 1.3x the observed), and int8 below int4 / 4.
  QLoRA adapter gradients vs LoRA on the dequantized float base: 1e-5 relative.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffgemma.model import lora, quantize, sharding, transformer
from diffgemma.model.config import tiny
from diffgemma.tasks import make_task
from diffgemma.training import training_state, update_step
from diffgemma.training.stages import sft
from tests.helpers import dequantize_params, setup_of, tiny_sudoku_config


def numpy_quantize(w, layout, bits: int, group: int):
  """float64 reference: symmetric absmax per output channel (and per group of `group` rows of
  the last input axis), scale = absmax / (qmax + 1/2), q = clip(round_half_even(w / scale))."""
  w = np.asarray(w, np.float64)
  num_expert, num_in = layout
  last_in = num_expert + num_in - 1
  qmax, qmin = 2 ** (bits - 1) - 1, -2 ** (bits - 1)
  split = w.reshape(w.shape[:last_in] + (w.shape[last_in] // group, group)
                    + w.shape[last_in + 1:])
  reduce = tuple(range(num_expert, last_in)) + (last_in + 1,)
  absmax = np.max(np.abs(split), axis=reduce, keepdims=True)
  scale = np.where(absmax > 0, absmax / (qmax + 0.5), 1.0)
  q = np.clip(np.round(split / scale), qmin, qmax)
  return q.reshape(w.shape), (q * scale).reshape(w.shape), np.squeeze(scale, last_in + 1)


@pytest.mark.parametrize("dtype,bits,group_size,shape,layout", [
    ("int8", 8, 0, (48, 24), (0, 1)),  # dense [in, out], one scale per output channel
    ("int4", 4, 16, (48, 24), (0, 1)),  # groups of 16 input rows
    ("int4", 4, 8, (3, 4, 16, 24), (0, 2)),  # attn.o-like [H, hd, D]: groups along hd
    ("int8", 8, 12, (5, 36, 20), (1, 1)),  # experts [E, in, out]: per expert and channel
])
def test_round_trip_matches_float64_reference(dtype, bits, group_size, shape, layout):
  rng = np.random.default_rng(0)
  w = rng.normal(0, 0.02, shape).astype(np.float32)
  w[..., 0] = 0.0  # an all-zero channel (scale 1, values 0)
  last_in = sum(layout) - 1
  group = quantize.group_size_for(shape[last_in], group_size)
  q = quantize.quantize_weight(jnp.asarray(w), layout, quantize.QuantizeConfig(dtype, group_size))
  ref_q, ref_deq, ref_scale = numpy_quantize(w, layout, bits, group)
  assert q.qvalue.dtype == quantize.QTYPES[dtype] and q.shape == shape
  values = np.asarray(q.qvalue, np.float64)
  mismatch = values != ref_q
  step = np.broadcast_to(np.repeat(ref_scale, group, axis=last_in), shape)
  ratio = np.abs(w / step)
  at_tie = np.abs(ratio - np.floor(ratio) - 0.5) < 1e-5
  assert np.all(at_tie[mismatch]) and np.all(np.abs(values - ref_q)[mismatch] == 1)
  assert mismatch.sum() <= ref_scale.size  # at most one absmax tie per scale
  np.testing.assert_allclose(np.asarray(q.scale, np.float64).reshape(ref_scale.shape), ref_scale,
                             rtol=1e-6, atol=0)
  deq = np.asarray(q.astype(jnp.float32), np.float64)
  np.testing.assert_allclose(deq[~mismatch], ref_deq[~mismatch], rtol=1e-6, atol=1e-9)
  assert np.all(np.abs(deq - w) <= step / 2 + 1e-6 * np.abs(w))  # + float32 rounding


@pytest.mark.parametrize("dtype,bits,group_size", [("int4", 4, 16), ("int4", 4, 0),
                                                     ("int8", 8, 0)])
def test_matmul_error_is_bounded_by_the_quantization_step(dtype, bits, group_size):
  """y = x @ w through the quantized weight, against bounds derived from each weight's step
  (scale = per-group absmax / (qmax + 1/2); rounding errs by at most scale / 2):
    every output: |dy| <= sum_i |x_i| scale_i / 2 (+ float32 rounding, 1e-5 relative);
    RMS over outputs: rounding errors ~ uniform on [-scale/2, scale/2] and independent, so
      E dy^2 = sum_i x_i^2 scale_i^2 / 12; the measured RMS is within 20% of its square root
      (192 outputs: the estimate's own spread is ~5%; the clipped absmax entries err by a full
      scale / 2, which raises the RMS by a few percent).
  """
  rng = np.random.default_rng(3)
  w = rng.normal(0, 0.02, (64, 24)).astype(np.float32)
  x = rng.normal(0, 1.0, (8, 64))
  q = quantize.quantize_weight(jnp.asarray(w), (0, 1), quantize.QuantizeConfig(dtype, group_size))
  group = quantize.group_size_for(64, group_size)
  scale = np.asarray(q.scale, np.float64)
  assert scale.shape == (64 // group, 24)
  # The step, by hand: per group of `group` input rows and output channel.
  absmax = np.abs(w.astype(np.float64)).reshape(64 // group, group, 24).max(1)
  np.testing.assert_allclose(scale, absmax / (2 ** (bits - 1) - 1 + 0.5), rtol=1e-6)
  step = np.repeat(scale, group, axis=0)  # [64, 24]
  dy = x @ np.asarray(q.astype(jnp.float32), np.float64) - x @ w.astype(np.float64)
  bound = np.abs(x) @ (step / 2)
  assert np.all(np.abs(dy) <= bound * (1 + 1e-5) + 1e-7), np.max(np.abs(dy) / bound)
  expected_rms = np.sqrt(np.mean((x ** 2) @ (step ** 2) / 12))
  rms = np.sqrt(np.mean(dy ** 2))
  assert 0.8 * expected_rms <= rms <= 1.2 * expected_rms, (rms, expected_rms)


def _logits(params, cfg, batch=2, prompt_len=12):
  rng = np.random.default_rng(1)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt_len)))
  canvas = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, cfg.canvas_length)))

  @jax.jit
  def run(params):
    cache = transformer.init_cache(cfg, batch, prompt_len + cfg.canvas_length)
    _, cache = transformer.encode(params, cfg, prompt, cache)
    return transformer.decode(params, cfg, canvas, cache)

  return run(params)


@pytest.mark.parametrize("moe_impl", ["tiled", "tiled_scan", "pallas"])
def test_model_consumes_quantized_weights_as_their_dequantized_values(moe_impl):
  # "tiled" takes w[tile experts], "tiled_scan" w[e] in a loop, "pallas" the whole dequantized
  # stack (as linear and ragged_dot do).
  cfg = tiny(num_layers=2, moe_impl=moe_impl, moe_tile_size=8)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0), 0.2)
  qparams = quantize.quantize_params(params, quantize.QuantizeConfig("int4", group_size=16))
  assert isinstance(qparams["layers"][0]["experts"]["gate_up"], quantize.QuantizedWeight)
  assert not isinstance(qparams["layers"][0]["router"]["proj"], quantize.QuantizedWeight)
  assert qparams["embedding"] is params["embedding"]
  np.testing.assert_allclose(_logits(qparams, cfg),
                             _logits(dequantize_params(qparams), cfg), atol=2e-5)


def test_logits_cost_on_a_tiny_random_model():
  cfg = tiny(num_layers=2, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
             head_dim=32, global_head_dim=64, vocab_size=128, moe_impl="tiled",
             moe_tile_size=8)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  ref = _logits(params, cfg, batch=4, prompt_len=16)
  rel_rms = {}
  for dtype in ("int8", "int4"):
    out = _logits(quantize.quantize_params(params, quantize.QuantizeConfig(dtype, group_size=0)),
                  cfg, batch=4, prompt_len=16)
    rel_rms[dtype] = float(jnp.sqrt(jnp.mean((out - ref) ** 2) / jnp.mean(ref ** 2)))
  assert rel_rms["int8"] <= 0.07 and rel_rms["int4"] <= 0.75, rel_rms
  assert rel_rms["int8"] < rel_rms["int4"] / 4, rel_rms


def _qlora_setup(base_dtype, moe_impl):
  config = tiny_sudoku_config(workdir_steps=2)
  config.model.moe_impl = moe_impl
  config.lora.update({"enabled": True, "rank": 2, "alpha": 4.0, "base_dtype": base_dtype})
  config.optimizer.lr = 1e-2
  import ml_collections
  config.quantize = ml_collections.ConfigDict(dict(group_size=8))
  return config, setup_of(config)


def sft_step(config, setup):
  """The jitted SFT update step of `config` (as the training loop builds it, unsharded)."""
  return update_step.make_update_step(setup, sft.SftStage(None, make_task(config),
                                                          setup).loss_fn)


def test_qlora_step_trains_only_adapters_with_the_dequantized_base_gradients():
  # "tiled_scan": the expert weights go through a custom VJP (integer values: float0
  # cotangents), one expert dequantized at a time.
  moe_impl = "tiled_scan"
  from diffgemma.tasks import sudoku

  config, setup = _qlora_setup("int4", moe_impl)
  assert setup.quantize_cfg.dtype == "int4" and setup.quantize_cfg.group_size == 8
  float_base = transformer.init_params(setup.model_cfg, jax.random.PRNGKey(0), 0.1)
  frozen = quantize.quantize_params(float_base, setup.quantize_cfg)
  shapes = training_state.base_params_shape(setup)
  assert jax.tree_util.tree_structure(shapes) == jax.tree_util.tree_structure(frozen)
  state = training_state.init_state(setup, frozen=frozen)
  assert set(state["params"]) == set(lora.target_paths(frozen, setup.lora_cfg))
  batch = next(sudoku.train_batches(config.data, config.batch_size, 2))
  step = sft_step(config, setup)
  adapters = state["params"]

  def two_steps(step, base):  # the first step's learning rate is 0 (warmup)
    new_state = jax.tree_util.tree_map(jnp.copy, state)
    for _ in range(2):
      new_state, metrics = step(new_state, base, batch)
    return new_state, metrics

  new_state, metrics = two_steps(step, frozen)
  assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
  # Only the adapters are trained state (the base is an input, never updated), and they move.
  assert set(new_state["params"]) == set(adapters)
  assert any(not np.array_equal(new_state["params"][k]["b"], adapters[k]["b"]) for k in adapters)

  # The same step on the dequantized float base: the same loss, gradients and new adapters.
  float_config = _qlora_setup("float32", moe_impl)[0]
  float_step = sft_step(float_config, setup_of(float_config))
  float_state, float_metrics = two_steps(float_step, dequantize_params(frozen))
  np.testing.assert_allclose(float(metrics["loss"]), float(float_metrics["loss"]), rtol=1e-5)
  np.testing.assert_allclose(float(metrics["grad_norm"]), float(float_metrics["grad_norm"]),
                             rtol=1e-5)
  for k in adapters:
    for f in ("a", "b"):
      np.testing.assert_allclose(new_state["params"][k][f], float_state["params"][k][f],
                                 rtol=1e-4, atol=1e-6, err_msg=f"{k}.{f}")


def test_quantized_base_bytes_and_sharding_axes():
  sizes = {}
  for base_dtype in ("float32", "int8", "int4"):
    _, setup = _qlora_setup(base_dtype, "tiled")
    sizes[base_dtype] = quantize.nbytes(training_state.base_params_shape(setup))
  assert sizes["int4"] < sizes["int8"] < sizes["float32"]
  cfg = tiny()
  shapes = transformer.abstract_params(cfg)
  experts = shapes["layers"][0]["experts"]["gate_up"]
  # Values take the weight's logical axes; a scale's size-1 axes stay unsplit.
  assert sharding.logical_axes("layers.0.experts.gate_up.qvalue", 3) == (
      "experts", "embed", "expert_mlp")
  assert sharding.logical_axes("layers.0.attn.q.scale", 3) == ("embed", "heads", "head_dim")
  q = jax.eval_shape(lambda w: quantize.quantize_weight(w, (1, 1), quantize.QuantizeConfig(
      "int4", group_size=16)), experts)
  assert q.scale.shape == (cfg.num_experts, cfg.hidden_size // 16, experts.shape[2])
  # The same names from the tree's own key paths (dataclass fields), so an FSDP mesh splits a
  # quantized base instead of replicating it.
  mesh = jax.sharding.AbstractMesh((1, 2, 1, 1), sharding.MESH_AXES)
  specs = sharding.tree_shardings({"layers": [{"experts": {"gate_up": q}}]}, mesh,
                                  sharding.DEFAULT_RULES)["layers"][0]["experts"]["gate_up"]
  assert specs.qvalue.spec == jax.sharding.PartitionSpec(None, "fsdp", None)
  assert specs.scale.spec == jax.sharding.PartitionSpec(None, "fsdp", None)
  assert quantize.bits_per_value(jnp.int4) == 4
