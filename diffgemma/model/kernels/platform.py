"""Where the Pallas kernels run: interpret mode on CPU, Triton on GPUs, and nowhere else.

The rule, in one place (both kernels call `resolve_interpret` and `pallas_call`):
  * The target platform is `jax.default_backend()`, or the one named by `target(...)` around
    tracing: to lower for a GPU on a CPU-only host (`jax.export(..., platforms=["cuda"])`),
    trace inside `with platform.target("cuda"):`.
  * CPU: interpret mode (a slow reference; Pallas has no compiled CPU backend).
  * GPU ("cuda", "rocm"; jax calls both "gpu"): compiled, for the Triton backend.
  * TPU: `KernelPlatformError` when the kernel is traced. The kernels are written for Triton:
    their 1-D index blocks break Mosaic TPU's (8, 128) block rule, and the MoE kernel indexes
    whole expert-weight arrays that would have to sit in VMEM. A TPU config selects the XLA path
    (`model.attention_impl="xla"`, `model.moe_impl="tiled"`).
  * `interpret=True` passed explicitly is honoured anywhere (a debugging choice). When interpret
    mode was chosen only because the trace ran on a CPU, the call sits behind
    `jax.lax.platform_dependent`: lowering that program for an accelerator raises
    `KernelPlatformError` instead of running the interpreter there.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.extend.core
from jax.experimental import pallas as pl
from jax.interpreters import mlir

from diffgemma import errors

try:
  _ShapedArray = jax.core.ShapedArray
except AttributeError:  # newer jax keeps it only internally
  from jax._src.core import ShapedArray as _ShapedArray  # pylint: disable=g-import-not-at-top

GPU_PLATFORMS = ("gpu", "cuda", "rocm")
CPU = "cpu"

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("diffgemma_kernel_target",
                                                                     default=None)


class KernelPlatformError(errors.ConfigError):
  """A Pallas kernel selected for a platform it does not run on (a one-line config error)."""


@contextlib.contextmanager
def target(platform: str):
  """Trace the kernels for `platform` ("cpu", "cuda", "rocm", "tpu") instead of the default
  backend, e.g. around `jax.export(..., platforms=[platform])` on a CPU-only host."""
  token = _TARGET.set(platform.lower())
  try:
    yield
  finally:
    _TARGET.reset(token)


def current() -> str:
  """The platform the kernels are being traced for."""
  return _TARGET.get() or jax.default_backend()


def resolve_interpret(interpret: bool | None, what: str, alternative: str) -> bool:
  """Interpret mode for this trace: `interpret` if given, else True exactly on CPU.

  Raises KernelPlatformError (one line naming `alternative`, the config that avoids the kernel)
  when the target is neither CPU nor a GPU.
  """
  platform = current()
  if platform != CPU and platform not in GPU_PLATFORMS:
    raise KernelPlatformError(f"{what} is a Pallas kernel for GPUs (Triton) and CPUs (interpret "
                              f"mode); it does not run on {platform}: set {alternative}")
  return platform == CPU if interpret is None else bool(interpret)


def pallas_call(kernel, *, interpret: bool, guarded: bool, compiler_params, name: str,
                out_shape, **kwargs):
  """`pl.pallas_call` in the mode `resolve_interpret` chose.

  Compiled: with `compiler_params` (the Triton parameters). Interpreted and `guarded` (the mode
  was inferred from a CPU trace): only the CPU lowering runs the interpreter; any other
  platform's lowering raises KernelPlatformError.
  """
  call = pl.pallas_call(kernel, interpret=interpret,
                        compiler_params=None if interpret else compiler_params, name=name,
                        out_shape=out_shape, **kwargs)
  if not (interpret and guarded):
    return call
  message = (f"Pallas kernel {name!r} was traced for the CPU (interpret mode) but is being "
             "lowered for another platform; trace it inside diffgemma.model.kernels.platform.target("
             "PLATFORM)")
  leaves, treedef = jax.tree_util.tree_flatten(out_shape)
  avals = tuple(_ShapedArray(x.shape, x.dtype) for x in leaves)

  def interpreted(*args):
    return tuple(jax.tree_util.tree_leaves(call(*args)))

  def refuse(*_):
    return tuple(_refusal_p.bind(avals=avals, message=message))

  return lambda *args: jax.tree_util.tree_unflatten(
      treedef, jax.lax.platform_dependent(*args, cpu=interpreted, default=refuse))


# A nullary primitive whose lowering raises: the non-CPU branch of a guarded interpret call.
_refusal_p = jax.extend.core.Primitive("diffgemma_kernel_platform_refusal")
_refusal_p.multiple_results = True
_refusal_p.def_abstract_eval(lambda *, avals, message: avals)


def _refusal_lowering(ctx, *, avals, message):
  del ctx, avals
  raise KernelPlatformError(message)


mlir.register_lowering(_refusal_p, _refusal_lowering)
