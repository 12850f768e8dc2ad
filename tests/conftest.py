"""Suite-wide setup: a persistent XLA compilation cache shared by every test of one run, and
XLA's optimisations off.

Many tests build the same tiny programs (a train step per `loop.train` call, the sampler per
`generate`); each jit of a fresh closure recompiles, and on a 2-core CPU compiles dominate the
suite's time. The cache is set through the environment before jax is imported, so the CLI
subprocesses some tests start share it too; it lives in a temporary directory removed at exit,
so no run sees another run's executables. For the same reason `jax_disable_most_optimizations`
is on, through the environment too: XLA's CPU optimisation passes cost far more compile time
than these tiny programs run, and no test measures speed (tolerances compare values, and an
unoptimised program only rounds closer to the order the code states). tests/test_optimized.py
runs a subset (parity, resume, two devices) on optimised programs in every run; a test command
with JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the whole suite on them.
"""

import atexit
import os
import shutil
import tempfile


_CACHE_DIR = tempfile.mkdtemp(prefix="diffgemma_xla_cache_")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


# The files that take longest (minutes of subprocess training and compiles), in that order: they
# are collected first, so `--dist loadfile` hands them out first and the short files fill the
# other worker's time around them instead of one long file ending the run alone.
LONGEST_FIRST = ("test_lora.py", "test_many_hosts.py", "test_sdrl.py", "test_ablation.py",
                 "test_quantize.py", "test_checkpoint_io.py", "test_reliability.py",
                 "test_tokenizer.py", "test_chat_training.py", "test_gpu_suite.py",
                 "test_training.py", "test_nemo_parity.py", "test_optimized.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within kept
