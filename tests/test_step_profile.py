"""benchmarks/step_profile.py: its FLOP count against hand counts (scan, cond, nested jit, a
gradient) and XLA's cost analysis, and its classes of compiled operations on a known program."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import step_profile


def test_dot_flops_by_hand():
  def f(a_MxK, b_KxN, c_SxNxN):
    y = a_MxK @ b_KxN  # 2 * 3 * 4 * 5 = 120
    y, _ = jax.lax.scan(lambda y, c: (y @ c, None), y, c_SxNxN)  # 7 * 2 * 3 * 5 * 5 = 1050
    y = jax.lax.cond(y.sum() > 0, lambda y: y @ c_SxNxN[0] @ c_SxNxN[1],  # 2 * 150 = 300
                     lambda y: y, y)
    return jax.jit(lambda y: jnp.einsum("mn,mn->", y, y))(y)  # 2 * 15 = 30

  args = (jnp.ones((3, 4)), jnp.ones((4, 5)), jnp.ones((7, 5, 5)))
  assert step_profile.dot_flops(jax.make_jaxpr(f)(*args).jaxpr) == 120 + 1050 + 300 + 30


def test_dot_flops_of_a_gradient_agree_with_xla():
  # Forward 2 M K N; backward 2 M K N for each of the two operands' gradients.
  loss = lambda w_KxN, x_MxK: jnp.sum(jnp.tanh(x_MxK @ w_KxN))
  grad = jax.jit(jax.grad(loss))
  args = (jnp.ones((64, 32)), jnp.ones((16, 64)))
  counted = step_profile.dot_flops(jax.make_jaxpr(grad)(*args).jaxpr)
  assert counted == 2 * (2 * 16 * 64 * 32)  # x's gradient is not asked for: no third dot
  cost = grad.lower(*args).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  # XLA adds the elementwise work (tanh and its derivative): within 10% at these sizes.
  np.testing.assert_allclose(cost["flops"], counted, rtol=0.1)


def test_operation_classes_of_a_compiled_program():
  def f(x_NxD, w_DxD, index_N):
    y = jnp.tanh(x_NxD @ w_DxD)
    return jnp.sum(y, axis=1), y[index_N], y.T

  compiled = jax.jit(f).lower(jnp.ones((64, 64)), jnp.ones((64, 64)),
                              jnp.zeros((8,), jnp.int32)).compile()
  classes = step_profile.operation_classes(compiled.as_text())
  assert "matmul" in classes.values()
  assert {"reduction", "gather"} & set(classes.values())
  assert set(classes.values()) <= {"matmul", "elementwise", "copy", "reduction", "gather",
                                   "scatter", "sort", "custom call", "while", "conditional",
                                   "call"}


def test_operation_regions_follow_the_named_scopes_through_the_gradient():
  def loss(w_DxD, x_NxD):
    with jax.named_scope("attention"):
      y = jnp.tanh(x_NxD @ w_DxD)
    with jax.named_scope("moe"):
      y = jnp.sin(y @ w_DxD)
    return jnp.sum(y)

  compiled = jax.jit(jax.grad(loss)).lower(jnp.ones((32, 32)), jnp.ones((16, 32))).compile()
  text = compiled.as_text()
  regions = step_profile.operation_regions(text)
  classes = step_profile.operation_classes(text)
  dot_regions = {regions[name] for name, kind in classes.items() if kind == "matmul"}
  assert {"attention", "moe"} <= dot_regions  # the backward's dots keep their forward's scope
