"""Expert parallelism (moe_impl="expert_parallel") against the one-program MoE, on 2 simulated
devices in a subprocess: the MoE layer (values and gradients, LoRA experts, a batch too small
to split), and the whole model's SFT loss and gradients."""

from tests.helpers import run

_PRELUDE = """
import os, sys
import chex; chex.set_n_cpu_devices(2)  # two simulated host devices, before jax starts
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp, numpy as np
from diffgemma.model import lora, moe, sharding, transformer
from diffgemma.model.config import tiny
from diffgemma.tasks import make_task
from diffgemma.training import training_state, update_step
from diffgemma.training.stages import sft
from tests.helpers import setup_of, tiny_sudoku_config

# Tolerances: float32 throughout; the two programs add the same products in different orders.
VALUE_TOL, GRAD_TOL = 1e-5, 1e-4

def close(a, b, tol):
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=tol, rtol=tol), a, b)
"""

_LAYER = _PRELUDE + """
cfg = tiny(num_experts=8, top_k_experts=3, moe_impl="tiled", moe_tile_size=4)
ep_cfg = cfg.replace(moe_impl="expert_parallel")
layer = transformer.init_params(cfg, jax.random.PRNGKey(0), std=0.3)["layers"][0]
shard_cfg = sharding.ShardingConfig(fsdp=2, rules={"experts": "fsdp"})
mesh = sharding.make_mesh(shard_cfg)

def inputs(b, t=5):
  keys = jax.random.split(jax.random.PRNGKey(b), 3)
  x = jax.random.normal(keys[0], (b, t, cfg.hidden_size))
  # Distinct experts per token; expert 0 gets none and expert 5 every token (groups that are
  # empty, and that span several tiles).
  e = jnp.arange(cfg.num_experts)
  scores = jax.random.normal(keys[1], (b, t, cfg.num_experts)) + jnp.where(e == 5, 100.0, 0.0)
  index = jax.lax.top_k(jnp.where(e == 0, -jnp.inf, scores), cfg.top_k_experts)[1]
  weights = jax.nn.softmax(jax.random.normal(keys[2], (b, t, cfg.top_k_experts)))
  return x, weights, index

def layer_grads(x, weights, index, experts, parallel, wrap=None):
  def loss(x, weights, experts):
    e = experts if wrap is None else wrap(experts)
    if parallel:
      with sharding.activation_rules(mesh, shard_cfg.rules):
        y = moe.moe_expert_parallel(x, weights, index, e, ep_cfg)
    else:
      flat = lambda a: a.reshape(-1, a.shape[-1])
      y = moe.moe(flat(x), flat(weights), flat(index), e, cfg).reshape(x.shape)
    return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape))), y
  if parallel:
    experts = jax.device_put(experts, sharding.tree_shardings(experts, mesh, shard_cfg.rules))
  (_, y), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(x, weights, experts)
  return y, grads

for b in (4, 1):  # 4 rows: tokens gathered and scattered; 1 row: replicated, outputs summed
  x, weights, index = inputs(b)
  y_ref, g_ref = layer_grads(x, weights, index, layer["experts"], False)
  y_ep, g_ep = layer_grads(x, weights, index, layer["experts"], True)
  assert float(jnp.abs(g_ref[2]["down"]).max()) > 0
  close(y_ep, y_ref, VALUE_TOL)
  close(g_ep, g_ref, GRAD_TOL)
  print("layer", b, float(jnp.abs(y_ep - y_ref).max()))

# LoRA experts: the adapters' gradients, computed where their experts live.
lora_cfg = lora.LoraConfig(enabled=True, rank=2, alpha=4.0, targets=(r"experts",))
params = {"layers": [layer]}
adapters = lora.init(params, lora_cfg, jax.random.PRNGKey(7))
adapters = {k: {"a": f["a"], "b": 0.3 * jax.random.normal(jax.random.PRNGKey(8), f["b"].shape)}
            for k, f in adapters.items()}
wrap = lambda adapters: lora.wrap(params, adapters, lora_cfg)["layers"][0]["experts"]
x, weights, index = inputs(4)
y_ref, g_ref = layer_grads(x, weights, index, adapters, False, wrap)
y_ep, g_ep = layer_grads(x, weights, index, adapters, True, wrap)
close(y_ep, y_ref, VALUE_TOL)
close(g_ep, g_ref, GRAD_TOL)
print("lora ok")

# Experts split along another axis as well: one line saying what to change.
try:
  bad = sharding.ShardingConfig(fsdp=2)  # default rules: experts on "expert", embed on fsdp
  with sharding.activation_rules(sharding.make_mesh(bad), bad.rules):
    jax.eval_shape(lambda: moe.moe_expert_parallel(x, weights, index, layer["experts"], ep_cfg))
  raise SystemExit("no error")
except ValueError as e:
  assert "rules.experts" in str(e), e
print("ok")
"""

_STEP = _PRELUDE + """
def loss_and_grads(moe_impl, rules):  # the SFT loss and its gradients, sharded as in training
  config = tiny_sudoku_config()
  config.model.update(dict(moe_impl=moe_impl, num_experts=8, top_k_experts=3, moe_tile_size=4))
  config.sharding.update(dict(fsdp=2, rules=rules))
  setup = setup_of(config)
  target = training_state.abstract_state(setup)
  params = jax.device_put(training_state.init_state(setup)["params"],
                          jax.tree_util.tree_map(lambda x: x.sharding, target["params"]))
  stage = sft.SftStage(None, make_task(config), setup)
  stage.start(None, None, 0, None)
  batch, _ = stage.next_batch(0, None, None)
  batch = sharding.global_batch(batch, setup.mesh, setup.rules)
  loss = lambda p, b: stage.loss_fn(p, b, jax.random.PRNGKey(3))[0]
  with sharding.activation_rules(setup.mesh, setup.rules):
    value, grads = jax.jit(jax.value_and_grad(loss))(params, batch)
  return value, grads

ref, ref_grads = loss_and_grads("tiled", {})
ep, ep_grads = loss_and_grads("expert_parallel", {"experts": "fsdp"})
gate_up = ep_grads["layers"][0]["experts"]["gate_up"]
assert float(jnp.abs(gate_up).max()) > 0
print("loss", float(ref), float(ep))
close(ep, ref, VALUE_TOL)
close(ep_grads, ref_grads, GRAD_TOL)
print("ok")
"""


def _check(script):
  r = run("-c", script)
  assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]


def test_expert_parallel_layer_equals_tiled_on_two_devices():
  """Values and gradients of the MoE layer; LoRA experts; a batch too small to split."""
  _check(_LAYER)


def test_expert_parallel_sft_loss_and_grads_equal_tiled_on_two_devices():
  """The whole model's SFT loss and every parameter's gradient against moe_impl="tiled"."""
  _check(_STEP)
