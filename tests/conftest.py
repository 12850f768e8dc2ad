"""Suite-wide setup: a persistent XLA compilation cache shared by every test of one run.

Many tests build the same tiny programs (a train step per `trainer.train` call, the sampler per
`generate`); each jit of a fresh closure recompiles, and on a 2-core CPU compiles dominate the
suite's time. The cache is set through the environment before jax is imported, so the CLI
subprocesses some tests start share it too; it lives in a temporary directory removed at exit,
so no run sees another run's executables.
"""

import atexit
import os
import shutil
import tempfile

import pytest

_CACHE_DIR = tempfile.mkdtemp(prefix="diffgemma_xla_cache_")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


@pytest.fixture(scope="module")
def fast_compile():
  """For modules of tiny programs (`pytestmark = pytest.mark.usefixtures("fast_compile")`):
  XLA's CPU optimisations cost far more compile time than these programs run."""
  import jax  # here: this module sets XLA's environment before anything imports jax

  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)
