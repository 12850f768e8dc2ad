"""The network as flax.linen modules (diffgemma/model/transformer.py): the same parameter tree and
values as the hand-written init it replaced, the same logits from a run written before it, and
the entry points through `Model.apply`."""

import os
import shutil

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from diffgemma.model import initializers, sharding, transformer
from diffgemma.model.config import SLIDING, ModelConfig

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "pre_flax_run")


def _cfg(**kw):
  base = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
              num_kv_heads=2, head_dim=8, global_head_dim=16, num_global_kv_heads=1,
              num_experts=4, top_k_experts=2, moe_intermediate_size=24, canvas_length=8,
              layer_types=(SLIDING, SLIDING, "full_attention"))
  base.update(kw)
  return ModelConfig(**base)


def _init_params_before_modules(cfg, rng, std=None):
  """`transformer.init_params` as it was written by hand before the modules (commit bd81db2)."""
  std = jnp.float32(cfg.initializer_range if std is None else std)
  dt = jnp.dtype(cfg.param_dtype)
  d, f = cfg.hidden_size, cfg.intermediate_size
  keys = iter(list(jax.random.split(rng, 8 + 12 * cfg.num_layers)))
  normal = lambda shape: initializers._normal_leaf(next(keys), std, tuple(shape), dt)
  ones = lambda shape: initializers._ones_leaf(tuple(shape), dt)
  layers = []
  for i in range(cfg.num_layers):
    hd, kv = cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
    attn = {"q": normal((d, cfg.num_heads, hd)), "k": normal((d, kv, hd)),
            "o": normal((cfg.num_heads, hd, d)),
            "q_norm": cfg.qk_norm_init * ones((hd,)), "k_norm": cfg.qk_norm_init * ones((hd,))}
    if cfg.layer_types[i] == SLIDING:
      attn["v"] = normal((d, kv, hd))
    e, moe_i = cfg.num_experts, cfg.moe_intermediate_size
    layers.append({
        "attn": attn,
        "mlp": {"gate": normal((d, f)), "up": normal((d, f)), "down": normal((f, d))},
        "router": {"proj": normal((d, e)), "scale": ones((d,)), "per_expert_scale": ones((e,))},
        "experts": {"gate_up": normal((e, d, 2 * moe_i)), "down": normal((e, moe_i, d))},
        **{name: ones((d,)) for name in transformer.LAYER_NORMS},
        "layer_scalar": ones(()),
    })
  return {"embedding": normal((cfg.vocab_size, d)), "final_norm": ones((d,)), "layers": layers,
          "self_conditioning": {"pre_norm": ones((d,)), "gate": normal((d, f)),
                                "up": normal((d, f)), "down": normal((f, d))}}


def test_init_is_the_tree_and_draw_of_before():
  for cfg in (_cfg(), _cfg(param_dtype="bfloat16", qk_norm_init=0.5)):
    rng = jax.random.PRNGKey(3)
    before = _init_params_before_modules(cfg, rng)
    now = transformer.init_params(cfg, rng)
    chex.assert_trees_all_equal_structs(before, now)
    chex.assert_trees_all_equal_shapes_and_dtypes(before, now)
    chex.assert_trees_all_equal(before, now)
    chex.assert_trees_all_equal_shapes_and_dtypes(transformer.abstract_params(cfg), now)
  before = _init_params_before_modules(cfg, rng, std=0.5)
  chex.assert_trees_all_equal(before, transformer.init_params(cfg, rng, std=0.5))


def test_linen_collection_is_the_params_tree():
  cfg = _cfg()
  variables = transformer.Model(cfg).init(jax.random.PRNGKey(0), method=transformer.Model.declare)
  params = transformer.abstract_params(cfg)
  chex.assert_trees_all_equal_shapes_and_dtypes(
      transformer.to_variables(params)["params"], nn.unbox(variables)["params"])
  chex.assert_trees_all_equal_shapes_and_dtypes(transformer.from_variables(variables), params)
  # Layer paths are the only difference: "layers_{i}" there, "layers"[i] here.
  assert set(variables["params"]) == {"embedding", "final_norm", "self_conditioning",
                                      "layers_0", "layers_1", "layers_2"}


def test_logical_axes_come_from_the_modules():
  cfg = _cfg()
  boxed = transformer.init_variables(cfg, jax.random.PRNGKey(0), boxed=True)["params"]
  specs = nn.get_partition_spec(boxed)
  assert tuple(specs["layers_0"]["experts"]["gate_up"]) == ("experts", "embed", "expert_mlp")
  assert tuple(specs["embedding"]) == ("vocab", "embed")
  for path, spec in jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))[0]:
    dotted = ".".join(str(k.key) for k in path).replace("layers_", "layers.")
    if len(spec):
      assert sharding.logical_axes(dotted, len(spec)) == tuple(spec), dotted


def test_apply_methods_are_the_entry_points():
  cfg = _cfg()
  params = transformer.init_params(cfg, jax.random.PRNGKey(1))
  variables = transformer.to_variables(params)
  model = transformer.Model(cfg)
  tokens = jnp.arange(10, dtype=jnp.int32).reshape(2, 5) % cfg.vocab_size
  cache = transformer.init_cache(cfg, 2, 16)
  h, cache1 = model.apply(variables, tokens, cache, method=transformer.Model.encode)
  h2, cache2 = transformer.encode(params, cfg, tokens, cache)
  chex.assert_trees_all_equal((h, cache1), (h2, cache2))
  canvas = (tokens[:, :4] * 3) % cfg.vocab_size
  logits = model.apply(variables, canvas, cache1, method=transformer.Model.decode)
  chex.assert_shape(logits, (2, 4, cfg.vocab_size))
  chex.assert_trees_all_equal(logits, transformer.decode(params, cfg, canvas, cache1))
  chex.assert_trees_all_equal(model.apply(variables, h, method=transformer.Model.lm_head),
                              transformer.lm_head(params, h, cfg))


def test_a_run_written_before_the_modules_restores_with_its_logits(tmp_path):
  from tests.helpers import restore_run
  workdir = str(tmp_path / "run")
  shutil.copytree(FIXTURE, workdir)
  _, setup, state, _, step = restore_run(workdir)
  assert step == 1
  params, cfg = state["params"], setup.model_cfg
  chex.assert_trees_all_equal_shapes_and_dtypes(params, transformer.abstract_params(cfg))
  expected = np.load(os.path.join(FIXTURE, "expected_logits.npz"))
  cache = transformer.init_cache(cfg, 2, 16)
  h, cache = transformer.encode(params, cfg, jnp.asarray(expected["tokens"]), cache)
  # The saved logits came from XLA's optimised programs; the suite runs unoptimised ones
  # (conftest.py), which round differently (1e-7 here, the code before the modules included).
  # Under the flags that wrote them, the new code reproduces them bitwise.
  chex.assert_trees_all_close(transformer.lm_head(params, h, cfg), expected["encoder"],
                              rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(
      transformer.decode(params, cfg, jnp.asarray(expected["canvas"]), cache),
      expected["decoder"], rtol=1e-5, atol=1e-5)


def test_nnx_users_wrap_the_model_with_to_nnx():
  from flax import nnx
  cfg = _cfg(num_layers=1, layer_types=("full_attention",))
  # Without a mesh, NNX must not place the logically partitioned weights eagerly.
  with nnx.use_eager_sharding(False):
    model = nnx.bridge.ToNNX(transformer.Model(cfg), rngs=nnx.Rngs(0)).lazy_init(
        method=transformer.Model.declare)
  tokens = jnp.zeros((1, 3), jnp.int32)
  h, _ = model(tokens, transformer.init_cache(cfg, 1, 8), method="encode")
  chex.assert_shape(h, (1, 3, cfg.hidden_size))


class WithAndWithoutJit(chex.TestCase):
  """The loss and the sampler's decoder step give the same values traced under jit and run op
  by op (chex.variants), so the modules hold no trace-time state."""

  CFG = _cfg(num_layers=1, layer_types=("full_attention",))

  @chex.variants(with_jit=True, without_jit=True)
  def test_sft_loss(self):
    from diffgemma.tasks import Layout
    from diffgemma.training import losses
    cfg = self.CFG
    params = transformer.init_params(cfg, jax.random.PRNGKey(0), std=0.3)
    p, k, b, c = 3, 2, 2, cfg.canvas_length
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (b, p + k * c)),
                         jnp.int32)
    loss_mask = jnp.asarray(np.arange(p + k * c) >= p)[None].repeat(b, 0)
    batch = {"tokens": tokens, "valid": jnp.ones_like(loss_mask), "loss_mask": loss_mask}
    loss_cfg = losses.LossConfig(self_conditioning_prob=0.5)
    loss = self.variant(lambda params, batch, rng: losses.sft_loss(
        params, cfg, loss_cfg, Layout(p, k, c), batch, rng)[0])
    reference = jax.jit(lambda params, batch, rng: losses.sft_loss(
        params, cfg, loss_cfg, Layout(p, k, c), batch, rng)[0])
    rng = jax.random.PRNGKey(3)
    chex.assert_trees_all_close(loss(params, batch, rng), reference(params, batch, rng),
                                rtol=1e-5, atol=1e-6)

  @chex.variants(with_jit=True, without_jit=True)
  def test_decoder_step(self):
    cfg = self.CFG
    params = transformer.init_params(cfg, jax.random.PRNGKey(1))
    prompt = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    _, cache = jax.jit(transformer.encode, static_argnums=1)(
        params, cfg, prompt, transformer.init_cache(cfg, 2, 16))
    canvas = jnp.ones((2, cfg.canvas_length), jnp.int32)
    sc_logits = jax.random.normal(jax.random.PRNGKey(2), (2, cfg.canvas_length, cfg.vocab_size))
    step = self.variant(lambda params, canvas, cache, sc: transformer.decode(
        params, cfg, canvas, cache, None, sc, jnp.array([True, False])))
    reference = jax.jit(lambda params, canvas, cache, sc: transformer.decode(
        params, cfg, canvas, cache, None, sc, jnp.array([True, False])))
    chex.assert_trees_all_close(step(params, canvas, cache, sc_logits),
                                reference(params, canvas, cache, sc_logits), rtol=1e-5, atol=1e-5)
