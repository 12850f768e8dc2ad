"""Suite-wide setup: a persistent XLA compilation cache shared by every test of one run, and
XLA's optimisations off.

Many tests build the same tiny programs (a train step per `loop.train` call, the sampler per
`generate`); each jit of a fresh closure recompiles, and on a 2-core CPU compiles dominate the
suite's time. The cache is set through the environment before jax is imported, so the CLI
subprocesses some tests start share it too; it lives in a temporary directory removed at exit,
so no run sees another run's executables. For the same reason `jax_disable_most_optimizations`
is on, through the environment too, and XLA:CPU's faster-compiling emitters (below): XLA's CPU
optimisation passes cost far more compile time than these tiny programs run, and no test
measures speed (tolerances compare values, and an unoptimised program only rounds closer to
the order the code states). tests/test_optimized.py
runs a subset (parity, resume, two devices) on optimised programs in every run; a test command
with JAX_DISABLE_MOST_OPTIMIZATIONS=0 runs the whole suite on them.
"""

import atexit
import glob
import importlib.util
import mmap
import os
import shutil
import tempfile

import hypothesis


_CACHE_DIR = tempfile.mkdtemp(prefix="diffgemma_xla_cache_")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE_DIR)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# The scripts and benchmarks the tests start import the installed package (no sys.path edits);
# this tree comes first for them, so they run the code under test whether or not it is
# installed, and an install of another checkout cannot shadow it.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p)

# XLA:CPU's fusion emitters compile these tiny programs about twice as slowly as its elemental
# emitters (measured on the tiny train step: 4.5 s against 2.3 s, benchmarks/RESULTS.md), and
# a suite of subprocess trainings is mostly compiles. Set only where the installed jaxlib
# knows the flag (XLA aborts on an unknown one); tests/test_optimized.py, which checks the
# programs users run, sets its own XLA_FLAGS without it.
FAST_COMPILE_FLAG = "--xla_cpu_use_fusion_emitters=false"


def _jaxlib_knows(flag: str) -> bool:
  """Whether a shared library of the installed jaxlib names `flag` (without importing jax)."""
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    return False
  name = flag.lstrip("-").split("=")[0].encode()
  for path in glob.glob(os.path.join(spec.submodule_search_locations[0], "**", "*.so"),
                        recursive=True):
    with open(path, "rb") as f:
      try:
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
          if data.find(name) >= 0:
            return True
      except ValueError:  # an empty file
        continue
  return False


if "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "") and \
    _jaxlib_knows(FAST_COMPILE_FLAG):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()


# Property-based tests draw the same examples on every run and machine (CI reproduces a
# failure), keep no example database between runs, and have no per-example deadline (a shared
# 2-core CPU makes timings noisy); each test states its own max_examples.
hypothesis.settings.register_profile("diffgemma", derandomize=True, deadline=None,
                                     database=None, print_blob=False)
hypothesis.settings.load_profile("diffgemma")


# The files that take longest (minutes of subprocess training and compiles), in that order: they
# are collected first, so `--dist loadfile` hands them out first and the short files fill the
# other worker's time around them instead of one long file ending the run alone.
LONGEST_FIRST = ("test_lora.py", "test_many_hosts.py", "test_host_failures.py", "test_sdrl.py",
                 "test_ablation.py", "test_quantize.py", "test_checkpoint_io.py",
                 "test_reliability.py", "test_tokenizer.py", "test_chat_training.py",
                 "test_gpu_suite.py", "test_readme.py", "test_training.py", "test_nemo_parity.py",
                 "test_bad_inputs.py", "test_optimized.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within kept
