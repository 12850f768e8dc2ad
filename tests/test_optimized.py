"""A subset of the parity, resume and 2-device checks on programs compiled with XLA's
optimisations ON, the programs users run (the rest of the suite compiles with them off, see
conftest.py). One subprocess with two simulated host devices runs:

  * transformers parity: a 2-layer (sliding + full) reference's encoder and decoder logits, with
    a padded prompt and self-conditioning, within 1e-4 (test_parity's and test_checkpoint_io's
    tolerance);
  * exact resume: a run stopped at step 1 and resumed ends with the bit-identical training state
    of the uninterrupted run (test_training's check), both on the default fsdp=-1 mesh, i.e.
    sharded over the two devices (the embedding split across them);
  * sharded vs single device: the same run on one device (sharding.fsdp=1) ends with the same
    parameters within 1e-5 (test_lora's two-device tolerance).
The training runs use a 1-layer model: they check state, checkpoints and sharding, not the
architecture, and each optimised compile of the train step costs tens of seconds.
"""

import pytest

from tests.helpers import run

# The slow tier (`pytest -m slow`, run by CI after the suite): several processes or
# optimised compiles per test.
pytestmark = pytest.mark.slow

_OPTIMIZED = """
import os, sys
sys.path.insert(0, os.getcwd())
import jax, numpy as np
assert not jax.config.read("jax_disable_most_optimizations"), "optimisations are off"
assert len(jax.devices()) == 2, jax.devices()
workdir = sys.argv[1]

# Parity with transformers.
from diffgemma.io import hf_weights
from tests import reference
ref = reference.tiny_reference(seed=1, num_hidden_layers=2)
cfg = hf_weights.config_from_hf(ref.config.to_dict())
assert cfg.layer_types == ("sliding_attention", "full_attention"), cfg.layer_types
params = hf_weights.params_from_hf(reference.state_dict_numpy(ref), cfg)
diff = reference.max_logit_diff(ref, cfg, params)
assert diff < 1e-4, diff

# Resume equals the uninterrupted run, on both devices (fsdp=-1); one device agrees.
from diffgemma.training import loop
from tests.helpers import restore_run, tiny_sudoku_config

def config(fsdp):
  c = tiny_sudoku_config(workdir_steps=2)
  c.model.update(dict(num_layers=1, layer_types=()))  # the plumbing, not the architecture
  c.sharding.fsdp = fsdp
  return c

paths = {name: os.path.join(workdir, name) for name in ("straight", "resumed", "one_device")}
loop.train(config(-1), paths["straight"])
loop.train(config(-1), paths["resumed"], stop_at=1)
loop.train(config(-1), paths["resumed"])
loop.train(config(1), paths["one_device"])
states = {}
for name, path in paths.items():
  *_, states[name], _, step = restore_run(path)
  assert step == 2, (name, step)
jax.tree_util.tree_map(np.testing.assert_array_equal, states["straight"], states["resumed"])
emb = states["straight"]["params"]["embedding"]
assert len({s.device for s in emb.addressable_shards}) == 2, emb.sharding
jax.tree_util.tree_map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5, rtol=0),
                       states["straight"]["params"], states["one_device"]["params"])
print("parity", diff)
print("ok")
"""


def test_parity_resume_and_two_devices_with_xla_optimisations_on(tmp_path):
  r = run("-c", _OPTIMIZED, str(tmp_path),
          env={"JAX_DISABLE_MOST_OPTIMIZATIONS": "0",
               "XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
  assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-3000:]
