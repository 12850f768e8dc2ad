"""LoRA (adapters on every linear, merge, checkpoint resume) and training sharded over devices."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffgemma.io import model_dirs
from diffgemma.model import lora, moe, sharding, transformer
from diffgemma.model.config import tiny
from diffgemma.runs import checkpointing
from diffgemma.training import loop
from tests.helpers import run
from tests.helpers import restore_run, tiny_sudoku_config

CFG = tiny(moe_impl="ragged_dot")


def _random_adapters(params, lora_cfg, seed):
  """Adapters with non-zero B, so the low-rank path contributes."""
  adapters = lora.init(params, lora_cfg, jax.random.PRNGKey(seed))
  keys = iter(jax.random.split(jax.random.PRNGKey(seed + 1), len(adapters)))
  return {name: {"a": f["a"], "b": 0.3 * jax.random.normal(next(keys), f["b"].shape)}
          for name, f in adapters.items()}


@functools.partial(jax.jit, static_argnums=1)  # one compile per pytree, not op-by-op dispatch
def _decode_logits(params, cfg):
  rng = jax.random.PRNGKey(3)
  prompt = jax.random.randint(rng, (2, 11), 3, cfg.vocab_size)
  canvas = jax.random.randint(jax.random.fold_in(rng, 1), (2, cfg.canvas_length), 3,
                              cfg.vocab_size)
  cache = transformer.init_cache(cfg, 2, 11 + cfg.canvas_length)
  _, cache = transformer.encode(params, cfg, prompt, cache)
  sc = jax.random.normal(jax.random.fold_in(rng, 2), (2, cfg.canvas_length, cfg.vocab_size))
  return transformer.decode(params, cfg, canvas, cache, self_cond_logits_BxCxV=sc)


@pytest.mark.parametrize("moe_impl", ["ragged_dot", "tiled"])
def test_merge_reproduces_the_lora_model(moe_impl):
  cfg = CFG.replace(moe_impl=moe_impl)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  lora_cfg = lora.LoraConfig(enabled=True, rank=3, alpha=6.0)
  adapters = _random_adapters(params, lora_cfg, seed=1)
  with_lora = _decode_logits(lora.wrap(params, adapters, lora_cfg), cfg)
  merged = _decode_logits(lora.merge(params, adapters, lora_cfg), cfg)
  base = _decode_logits(params, cfg)
  # float32 on CPU: the two computation orders agree to rounding.
  np.testing.assert_allclose(with_lora, merged, atol=2e-5, rtol=0)
  assert float(jnp.max(jnp.abs(with_lora - base))) > 1e-2  # the adapters do change the model


def test_expert_adapter_gradients_agree_across_moe_layouts():
  """Gradients through per-expert adapters (frozen base): the one-tile-per-step scan, whose
  backward skips the base's weight gradient, equals ragged_dot and the batched tiles."""
  params = transformer.init_params(CFG, jax.random.PRNGKey(0))
  lora_cfg = lora.LoraConfig(enabled=True, rank=3, alpha=6.0)
  adapters = _random_adapters(params, lora_cfg, seed=1)
  x = jax.random.normal(jax.random.PRNGKey(2), (19, CFG.hidden_size))
  weights = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(3), (19, CFG.top_k_experts)))
  index = jax.random.randint(jax.random.PRNGKey(4), (19, CFG.top_k_experts), 0, CFG.num_experts)

  @functools.partial(jax.jit, static_argnums=2)
  def grads(x, adapters, impl):
    def loss(x, adapters):
      experts = lora.wrap(params, adapters, lora_cfg)["layers"][0]["experts"]
      cfg = CFG.replace(moe_impl=impl, moe_tile_size=4)
      return (moe.moe(x, weights, index, experts, cfg) ** 2).sum()
    return jax.grad(loss, (0, 1))(x, adapters)

  reference = grads(x, adapters, "ragged_dot")
  assert float(jnp.abs(reference[1]["layers.0.experts.down"]["b"]).max()) > 0
  for impl in ("tiled", "tiled_scan"):
    chex.assert_trees_all_close(grads(x, adapters, impl), reference, atol=1e-4, rtol=1e-4)


def test_merge_weight_matches_float64_numpy():
  rng = np.random.default_rng(0)
  base = rng.normal(size=(3, 5, 7)).astype(np.float32)  # stacked experts [E, in, out]
  a, b = rng.normal(size=(3, 5, 2)), rng.normal(size=(3, 2, 7))
  expected = base.astype(np.float64) + 1.5 * np.einsum("eir,ero->eio", a, b)
  got = lora.merge_weight(jnp.asarray(base), jnp.asarray(a, jnp.float32),
                          jnp.asarray(b, jnp.float32), 1.5)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
  q = rng.normal(size=(4, 2, 3)).astype(np.float32)  # attention q [D, H, hd]
  qa, qb = rng.normal(size=(4, 2)), rng.normal(size=(2, 2, 3))
  np.testing.assert_allclose(
      lora.merge_weight(jnp.asarray(q), jnp.asarray(qa, jnp.float32), jnp.asarray(qb, jnp.float32),
                        0.5), q + 0.5 * np.einsum("dr,rhk->dhk", qa, qb), rtol=1e-5, atol=1e-5)


def test_default_targets_cover_every_linear_with_rank_r_factors():
  params = transformer.init_params(CFG, jax.random.PRNGKey(0))
  lora_cfg = lora.LoraConfig(enabled=True, rank=4)
  adapters = lora.init(params, lora_cfg, jax.random.PRNGKey(1))
  leaves = {lora.dotted(p): x for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
  linears = {name for name in leaves if lora.linear_layout(name)}
  assert set(adapters) == linears
  full_layer = CFG.layer_types.index("full_attention")
  assert f"layers.{full_layer}.attn.v" not in adapters  # full layers take values from k
  for name in ("layers.0.attn.o", "layers.0.experts.gate_up", "self_conditioning.down",
               "layers.0.router.proj"):
    assert name in adapters
  e, d, two_i = leaves["layers.0.experts.gate_up"].shape
  assert adapters["layers.0.experts.gate_up"]["a"].shape == (e, d, 4)
  assert adapters["layers.0.experts.gate_up"]["b"].shape == (e, 4, two_i)
  h, hd, _ = leaves["layers.0.attn.o"].shape
  assert adapters["layers.0.attn.o"]["a"].shape == (h, hd, 4)
  assert all(not np.any(f["b"]) for f in adapters.values())  # training starts at the base


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
  """A tiny Sudoku SFT run to fine-tune from."""
  path = str(tmp_path_factory.mktemp("lora") / "base")
  loop.train(tiny_sudoku_config(workdir_steps=2), path)
  return path


def _lora_config(steps, targets=None, rank=2):
  config = tiny_sudoku_config(workdir_steps=steps)
  config.lora.update({"enabled": True, "rank": rank, "alpha": 4.0, "base_dtype": "float32",
                      "dropout": 0.1})
  if targets is not None:
    config.lora.targets = targets
  config.optimizer.lr = 1e-2
  return config


def test_lora_training_changes_exactly_the_targeted_leaves_and_resumes_exactly(base_run,
                                                                              tmp_path):
  targets = (r"attn\.q$", r"experts\.down$", r"self_conditioning\.up$")
  config = _lora_config(4, targets=targets, rank=3)
  straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
  loop.train(config, straight, init_from=base_run)
  loop.train(config, resumed, init_from=base_run, stop_at=2)
  loop.train(config, resumed)  # resumes: base re-read from the run's init_from

  _, setup, a, frozen, step_a = restore_run(straight)
  *_, b, _, step_b = restore_run(resumed)
  assert step_a == step_b == 4
  chex.assert_trees_all_equal(a, b)

  # Only the adapters are checkpointed, with rank-3 factors.
  assert set(a["params"]) == {n for n in a["params"] if any(
      n.endswith(s) for s in ("attn.q", "experts.down", "self_conditioning.up"))}
  assert all(f["a"].shape[-1] == 3 and f["b"].shape[-f["b"].ndim + (f["b"].ndim - 2 if
             "experts" in n else 0)] == 3 for n, f in a["params"].items())
  _, base_params, _ = model_dirs.load_workdir(base_run)
  merged = lora.merge(frozen, a["params"], setup.lora_cfg)
  changed = {lora.dotted(p) for p, x in jax.tree_util.tree_flatten_with_path(merged)[0]
             if not np.array_equal(x, _leaf(base_params, p))}
  assert changed == set(a["params"])


def _leaf(tree, path):
  for k in path:
    tree = tree[getattr(k, "key", getattr(k, "idx", None))]
  return tree


def _numpy_merge(base, a, b, scale, expert_axes):
  """float64 base + scale * A @ B, contracting A's last (rank) axis with B's first after the
  expert axes (one product per expert)."""
  base, a, b = (np.asarray(x, np.float64) for x in (base, a, b))
  if not expert_axes:
    return base + scale * np.tensordot(a, b, axes=1)
  delta = np.stack([np.tensordot(x, y, axes=1) for x, y in zip(a, b)])
  return base + scale * delta


def test_lora_run_exports_base_plus_scaled_adapters_and_transformers_agrees(base_run, tmp_path):
  """What eval.py, sample.py and convert_checkpoint read from a LoRA run: every adapted weight
  equals base + (alpha / rank) * A @ B (a float64 numpy product, 1e-5), every other weight the
  base exactly; the transformers export of it gives the same logits (1e-4, as
  test_checkpoint_io's export)."""
  import torch
  from transformers import DiffusionGemmaForBlockDiffusion

  from diffgemma.training import loaded
  from tests import reference

  config = _lora_config(2)  # two steps: the first has learning rate 0 (warmup), B moves after
  config.lora.save_base = True  # the base travels in the checkpoint: no need for init_from
  workdir = str(tmp_path / "run")
  loop.train(config, workdir, init_from=base_run)

  saved = checkpointing.load_config(workdir)
  with saved.unlocked():
    saved.init_from = str(tmp_path / "gone")  # restoring must not read it
  checkpointing.save_config(workdir, saved)

  _, setup, state, frozen, _ = restore_run(workdir)
  adapters, scale = state["params"], config.lora.alpha / config.lora.rank
  assert setup.lora_cfg.scale == scale
  assert any(np.any(np.asarray(f["b"])) for f in adapters.values())  # the adapters moved
  cfg, params = model_dirs.load_model(workdir)  # what convert_checkpoint exports
  model_dirs.check_params(cfg, params)
  run = loaded.load_run(workdir)  # what eval.py and sample.py use
  base = {lora.dotted(p): x for p, x in jax.tree_util.tree_flatten_with_path(frozen)[0]}
  for tree in (params, run.params):
    leaves = {lora.dotted(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    assert sorted(leaves) == sorted(base)
    for name, leaf in leaves.items():
      if name not in adapters:
        np.testing.assert_array_equal(leaf, base[name], err_msg=name)
        continue
      a, b = adapters[name]["a"], adapters[name]["b"]
      expected = _numpy_merge(base[name], a, b, scale, ".experts." in name)
      np.testing.assert_allclose(np.asarray(leaf, np.float64), expected, rtol=1e-5, atol=1e-6,
                                 err_msg=name)

  out = str(tmp_path / "export")
  model_dirs.save_hf(cfg, params, out)
  theirs = DiffusionGemmaForBlockDiffusion.from_pretrained(out, dtype=torch.float32).eval()
  theirs.config._attn_implementation = "eager"
  assert reference.max_logit_diff(theirs, cfg, params) < 1e-4


def test_qlora_run_quantizes_its_base_on_load_and_resumes(base_run, tmp_path):
  import ml_collections

  from diffgemma.model import quantize

  config = _lora_config(2)
  config.lora.base_dtype = "int4"
  config.quantize = ml_collections.ConfigDict(dict(group_size=8))
  workdir = str(tmp_path / "qlora")
  loop.train(config, workdir, init_from=base_run, stop_at=1)
  loop.train(config, workdir)  # resumes: the base re-read from init_from and re-quantized
  _, setup, state, frozen, step = restore_run(workdir)
  assert step == 2 and setup.quantize_cfg.dtype == "int4"
  q = frozen["layers"][0]["attn"]["q"]
  assert isinstance(q, quantize.QuantizedWeight) and q.qvalue.dtype == jnp.int4
  # The frozen base is the quantized float base of the run it started from.
  _, base_params, _ = model_dirs.load_workdir(base_run)
  expected = quantize.quantize_params(base_params, setup.quantize_cfg)
  np.testing.assert_array_equal(q.qvalue, expected["layers"][0]["attn"]["q"].qvalue)
  assert set(state["params"]) == set(lora.target_paths(frozen, setup.lora_cfg))


_TWO_DEVICES = """
import os, sys
import chex; chex.set_n_cpu_devices(2)  # two simulated host devices, before jax starts
sys.path.insert(0, os.getcwd())
import numpy as np
from tests.helpers import sharded_sft_losses as losses

one, _ = losses(1, 1)
two, emb = losses(2, 1)
tp, emb_tp = losses(1, 2)
print("losses", one, two, tp)
assert len({s.device for s in emb.addressable_shards}) == 2
assert emb.addressable_shards[0].data.shape[1] == emb.shape[1] // 2, emb.sharding  # fsdp: embed
assert emb_tp.addressable_shards[0].data.shape[0] == emb.shape[0] // 2, emb_tp.sharding  # vocab
np.testing.assert_allclose(two, one, atol=1e-5, rtol=0)
np.testing.assert_allclose(tp, one, atol=1e-5, rtol=0)
print("ok")
"""


def test_training_sharded_over_two_devices_matches_one_device():
  r = run("-c", _TWO_DEVICES)
  assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_dry_run_reports_per_device_memory_on_two_simulated_devices():
  r = run("train.py", "--config=sft_sudoku_lora_tiny", "--dry_run", "--dry_run_devices=2",
          "--config.model.num_layers=2", "--config.model.layer_types=()", "--config.batch_size=4")
  assert r.returncode == 0, r.stderr[-3000:]
  out = r.stdout
  assert "dry run: 2 devices" in out and "peak per device" in out and "fits" in out, out
  peak = float(out.split("| peak per device |")[1].split("|")[0])
  assert 0 < peak < 1.0, out


def test_logical_axes_and_partition_specs():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1, 1), sharding.MESH_AXES)
  assert sharding.logical_axes("layers.0.experts.gate_up", 3) == ("experts", "embed",
                                                                  "expert_mlp")
  assert sharding.logical_axes("0.mu.layers.0.experts.gate_up.a", 3) == ("experts", "embed",
                                                                         "lora_rank")
  assert sharding.logical_axes("layers.0.attn.o.b", 2) == ("lora_rank", "embed")
  assert sharding.logical_axes("layers.0.input_norm", 1) == (None,)
  spec = sharding.partition_spec(("experts", "embed"), (4, 8), mesh, sharding.DEFAULT_RULES)
  assert spec == jax.sharding.PartitionSpec(None, None)  # one device: nothing split
  with pytest.raises(ValueError, match="unknown mesh axis"):
    sharding.ShardingConfig(rules={"embed": "fsdpp"})
  with pytest.raises(ValueError, match="needs 4 devices"):
    sharding.make_mesh(sharding.ShardingConfig(fsdp=4), jax.devices()[:1])
