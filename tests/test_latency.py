"""Latency a user can trust: the first (cold, compiling) call kept apart from the warm ones, in
`evaluation.latency_metrics` (eval.py's JSON) and with the device that produced them."""

import types

import jax
import numpy as np
import pytest

from diffgemma.model import config, transformer
from diffgemma.runs import provenance
from diffgemma.sampling import sampler
from diffgemma.training import evaluation
from diffgemma.tasks.base import Prompts

P = 3


def prompts(n):
  ids = np.arange(1, n + 1, dtype=np.int32)
  return Prompts(np.repeat(ids[:, None], P, 1), np.ones((n, P), bool), [None] * n)


def stub(params, prompt_BxP, valid_BxP, rng):
  """Row i (its first prompt id) has i non-pad tokens over i canvases."""
  del params, valid_BxP, rng
  ids = np.asarray(prompt_BxP)[:, 0]
  return sampler.GenerateOutput(
      tokens=np.zeros((len(ids), 4), np.int32), num_tokens=ids.astype(np.int32),
      num_canvases=ids.astype(np.int32), tokens_per_forward=np.ones(len(ids)),
      steps_per_canvas=np.ones(len(ids)), decoder_passes=ids.astype(np.int32),
      commit_passes=np.maximum(ids - 1, 0).astype(np.int32))


def test_timing_splits_cold_from_warm_by_hand():
  """A clock reading 0, 1, 4, 9, ...: the warmup (ticks 0-1) is cold; batch b reads ticks
  2b+2, 2b+3 and takes 4b + 5 s. Warm figures are brute-force sums over the real rows."""
  orig = evaluation.time
  ticks = iter(range(1000))
  evaluation.time = types.SimpleNamespace(perf_counter=lambda: float(next(ticks) ** 2))
  timing = {}
  try:  # 5 rows in batches of 2: rows (1, 2), (3, 4), (5, padded with 5)
    evaluation.generate_in_batches(None, stub, prompts(5), 2, seed=0, warmup=True,
                                   timing=timing)
  finally:
    evaluation.time = orig
  warm = [5.0, 9.0, 13.0]
  assert timing["cold_seconds"] == 1.0
  np.testing.assert_array_equal(timing["warm_seconds_B"], warm)
  np.testing.assert_array_equal(timing["warm_tokens"], [1 + 2, 3 + 4, 5])  # padding not counted
  np.testing.assert_array_equal(timing["warm_canvases"], [2, 4, 5])  # the call's longest row
  got = evaluation.latency_metrics(timing, 2)
  assert got == {"cold_seconds": 1.0, "warm_calls": 3, "latency_batch_size": 2,
                 "warm_seconds": pytest.approx(sum(warm) / 3),
                 "seconds_per_canvas": pytest.approx(sum(warm) / 11),
                 "tokens_per_second_warm": pytest.approx(15 / sum(warm))}


def test_without_warmup_the_first_batch_is_cold_and_one_batch_has_no_warm_figure():
  timing = {}
  evaluation.generate_in_batches(None, stub, prompts(2), 4, seed=0, timing=timing)
  got = evaluation.latency_metrics(timing, 2)
  assert got["warm_calls"] == 0 and got["cold_seconds"] > 0
  assert got["warm_seconds"] is None and got["tokens_per_second_warm"] is None


def test_tiny_model_warm_is_faster_than_cold_and_tokens_per_second_is_consistent():
  """evaluate() on a tiny model: the cold call compiles, so it is slower than a warm one, and
  tokens_per_second_warm = the tokens of the warm calls / their seconds."""
  cfg = config.tiny(num_layers=2, layer_types=())
  params = transformer.init_params(cfg, jax.random.key(0, impl="rbg"))
  scfg = sampler.SamplerConfig(max_denoising_steps=2, max_new_tokens=cfg.canvas_length)

  class Task:
    def score(self, prompts, tokens, stats):
      return {"accuracy": 0.0}, []

  timing_prompts = prompts(4)
  metrics, _ = evaluation.evaluate(Task(), params, cfg, scfg, timing_prompts, 2, warmup=True)
  assert metrics["warm_calls"] == 2 and metrics["latency_batch_size"] == 2
  assert metrics["warm_seconds"] < metrics["cold_seconds"]
  # Every row ran one canvas here, so a call's canvases is 1 and seconds per canvas = warm.
  assert metrics["seconds_per_canvas"] == pytest.approx(metrics["warm_seconds"])
  fn = sampler.make_generate_fn(cfg, scfg)
  tokens = sum(int(np.sum(fn(params, timing_prompts.prompt_NxP[s:s + 2],
                             timing_prompts.valid_NxP[s:s + 2],
                             jax.random.fold_in(jax.random.PRNGKey(0), s)).num_tokens))
               for s in (0, 2))
  assert metrics["tokens_per_second_warm"] == pytest.approx(
      tokens / (metrics["warm_seconds"] * metrics["warm_calls"]), rel=1e-9)


def test_device_info_names_the_hardware():
  info = provenance.device_info()
  assert sorted(info) == ["accelerator", "cpu", "device_kind", "jax", "num_devices", "platform"]
  assert info["jax"] == jax.__version__ and info["num_devices"] == len(jax.devices())
  assert info["platform"] == jax.default_backend() and info["cpu"]
  assert (info["accelerator"] is None) == (info["platform"] == "cpu")
  assert info["device_kind"] in provenance.describe_device(info)
