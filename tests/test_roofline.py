"""benchmarks/roofline.py against hand-computed counts on a tiny config, its expected number of
distinct experts against exact enumeration and a Monte Carlo count, and its weight counts
against the model's own parameter tree."""

import itertools

import numpy as np
import pytest

from benchmarks import roofline
from diffgemma.model import transformer
from diffgemma.model.config import FULL, SLIDING, ModelConfig

# Layer 0 sliding (window 3: sees 2 prefix slots), layer 1 full (sees all 5).
TINY = ModelConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_layers=2, num_heads=2,
                   num_kv_heads=1, head_dim=2, global_head_dim=6, num_global_kv_heads=1,
                   sliding_window=3, layer_types=(SLIDING, FULL), num_experts=4, top_k_experts=2,
                   moe_intermediate_size=2, canvas_length=2)


def test_counts_of_a_tiny_step_by_hand():
  cost = roofline.step_cost(TINY, batch=1, prefix=5, experts_per_layer=3, weight_bytes=2,
                            value_bytes=2)
  # Layer 0: q 4*2*2 + o 16 + k 4*1*2 + v 8 = 48; mlp 3*4*6 = 72; router 4*4 = 16.
  # Layer 1: q 4*2*6 + o 48 + k 4*1*6 (values from keys) = 120; mlp 72; router 16.
  # Self-conditioning MLP 72. Dense: 136 + 208 + 72 = 416 parameters, 2 bytes each.
  assert cost["bytes_dense"] == 832
  # One expert: 3 * 4 * 2 = 24 parameters; 3 experts in each of 2 layers.
  assert cost["bytes_experts"] == 2 * 3 * 24 * 2
  assert cost["bytes_embedding"] == 10 * 4 * 2
  # K and V, batch 1: layer 0 reads 2 slots x 1 head x 2 dims, layer 1 5 x 1 x 6.
  assert cost["bytes_kv"] == 2 * (2 * 2 + 5 * 6) * 2
  # 2 canvas tokens: dense 2*2*(136+208+72); experts 2*2 tokens*k 2*24*2 layers.
  assert cost["flops_dense"] == 2 * 2 * 416
  assert cost["flops_experts"] == 2 * 2 * 2 * 24 * 2
  # Scores + values, 2 tokens x 2 heads: layer 0 hd 2 over 2 + 2 keys, layer 1 hd 6 over 2 + 5.
  assert cost["flops_attention"] == 2 * 2 * 2 * 2 * (2 * 4 + 6 * 7)
  assert cost["flops_lm_head"] == 2 * 2 * 10 * 4
  assert cost["flops_decoder"] == 1664 + 384 + 800 + 160
  # Sampling: probs @ E over 2 tokens, and the float32 [2, 10] logits read back.
  assert cost["flops_sampling"] == 2 * 2 * 10 * 4
  assert cost["bytes_sampling"] == 80 + 2 * 2 * 10 * 4
  # Commit: the decoder's layers without the LM head and the self-conditioning MLP.
  assert cost["bytes_commit"] == (832 - 144) + 288 + 136
  assert cost["flops_commit"] == (1664 - 288) + 384 + 800


@pytest.mark.parametrize("cfg", [TINY, ModelConfig()], ids=["tiny", "26b_a4b"])
def test_weight_counts_match_the_parameter_tree(cfg):
  shapes = transformer.abstract_params(cfg)
  size = lambda *xs: sum(int(np.prod(x.shape)) for x in xs)
  for i, layer in enumerate(shapes["layers"]):
    counts = roofline.layer_weight_counts(cfg, i)
    assert counts["attention"] == size(*(layer["attn"][k] for k in ("q", "k", "v", "o")
                                         if k in layer["attn"]))
    assert counts["mlp"] == size(*layer["mlp"].values())
    assert counts["router"] == size(layer["router"]["proj"])
    assert counts["expert"] * cfg.num_experts == size(*layer["experts"].values())


def test_expected_distinct_experts_matches_enumeration_and_monte_carlo():
  # Exact: every way 2 tokens pick 2 of 4 experts.
  choices = list(itertools.combinations(range(4), 2))
  exact = np.mean([len(set(a) | set(b)) for a, b in itertools.product(choices, repeat=2)])
  assert roofline.expected_distinct_experts(4, 2, 2) == pytest.approx(exact, abs=1e-12)
  # Monte Carlo: 16 tokens picking 8 of 128 without replacement.
  rng = np.random.default_rng(0)
  trials = 4000
  counts = [len(np.unique(np.argsort(rng.random((16, 128)), axis=1)[:, :8]))
            for _ in range(trials)]
  expected = roofline.expected_distinct_experts(128, 8, 16)
  assert abs(np.mean(counts) - expected) < 4 * np.std(counts) / np.sqrt(trials)
  # A 256-token canvas under uniform routing touches every expert; the report measured 84.
  assert roofline.expected_distinct_experts(128, 8, 256) > 127.99
  assert roofline.experts_for_batch(128, 84, 1) == pytest.approx(84)


def test_floor_is_the_slower_of_compute_and_memory():
  device = roofline.Device("test", bf16_tflops=1.0, fp8_tflops=2.0, hbm_tbps=1.0)
  assert roofline.floor_seconds(3e12, 1e12, device, "bf16") == (3.0, "compute")
  assert roofline.floor_seconds(3e12, 1e12, device, "fp8") == (1.5, "compute")
  assert roofline.floor_seconds(1e12, 4e12, device, "fp8") == (4.0, "memory")
  no_fp8 = roofline.Device("old", bf16_tflops=1.0, fp8_tflops=None, hbm_tbps=1.0)
  assert roofline.floor_seconds(3e12, 1e12, no_fp8, "fp8") == (3.0, "compute")
