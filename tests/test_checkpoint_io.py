"""Checkpoint import/export against transformers: logits within 1e-4 in float32, round trips
bit-exact, Gemma 4 backbones fully used, and bad checkpoints rejected with one-line errors."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DiffusionGemmaForBlockDiffusion

from diffgemma.io import model_dirs, hf_weights, safetensors_dir
from diffgemma.model import transformer
from diffgemma.model.config import gemma_26b_a4b
from tests import reference

TOL = 1e-4
SHARD = "20KB"  # small shards, so the tiny checkpoints exercise the sharded index


def _leaves_equal(a, b):
  pairs = zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
  return all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)) for x, y in pairs)


@pytest.fixture(scope="module")
def saved_reference(tmp_path_factory):
  """A tiny reference saved by transformers itself (sharded, decoder-copy layout)."""
  ref = reference.tiny_reference(seed=3, num_hidden_layers=7)
  path = str(tmp_path_factory.mktemp("hf") / "tiny")
  ref.save_pretrained(path, max_shard_size=SHARD)
  return ref, path


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
  """A tiny Sudoku SFT run of 2 steps (full fine-tuning), read but never written by the tests."""
  from diffgemma.training import loop
  from tests.helpers import tiny_sudoku_config

  path = str(tmp_path_factory.mktemp("trained") / "run")
  loop.train(tiny_sudoku_config(workdir_steps=2), path)
  return path


def test_import_reproduces_reference_logits(saved_reference):
  ref, path = saved_reference
  assert os.path.exists(os.path.join(path, safetensors_dir.INDEX_FILE))
  cfg, params = model_dirs.load_model(path, log=lambda _: None)
  # The import is exact: the same pytree as mapping the in-memory state dict (which
  # test_parity checks over three configs)...
  in_memory = hf_weights.params_from_hf(reference.state_dict_numpy(ref), cfg)
  assert _leaves_equal(params, in_memory)
  # ...and it reproduces transformers' logits. (float32 rounding differs between the two
  # implementations; with these 0.2-std random weights it stays below 1e-4 for most seeds, but
  # some seeds amplify it to ~3e-4 at single positions.)
  assert reference.max_logit_diff(ref, cfg, params) < TOL


def test_export_loads_in_transformers_and_round_trips(saved_reference, tmp_path):
  _, path = saved_reference
  cfg = hf_weights.config_from_hf(json.load(open(os.path.join(path, "config.json"))))
  # Our own random weights (not the imported ones), perturbed like the reference's.
  params = transformer.init_params(cfg, jax.random.PRNGKey(3), 0.2)
  params = jax.tree_util.tree_map(
      lambda x: x + 0.3 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape), params)
  out = str(tmp_path / "export")
  files = model_dirs.save_hf(cfg, params, out, max_shard_bytes=30_000)
  assert safetensors_dir.INDEX_FILE in files and len(files) > 3
  theirs = DiffusionGemmaForBlockDiffusion.from_pretrained(out, dtype=torch.float32).eval()
  theirs.config._attn_implementation = "eager"
  assert reference.max_logit_diff(theirs, cfg, params, seed=1) < TOL
  # import -> export -> import is bit-exact, and so is a second export.
  cfg2, params2 = model_dirs.load_model(out, log=lambda _: None)
  assert cfg2 == cfg and _leaves_equal(params, params2)
  out2 = str(tmp_path / "export2")
  model_dirs.save_hf(cfg2, params2, out2, max_shard_bytes=30_000)
  first, second = safetensors_dir.SafetensorsDir(out), safetensors_dir.SafetensorsDir(out2)
  assert sorted(first) == sorted(second)
  assert all(np.array_equal(first[n], second[n]) for n in first)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_orbax_and_bfloat16_round_trips_are_exact(saved_reference, tmp_path, dtype):
  _, path = saved_reference
  cfg, params = model_dirs.load_model(path, dtype=dtype, log=lambda _: None)
  assert all(x.dtype == jnp.dtype(dtype) for x in jax.tree_util.tree_leaves(params))
  model_dirs.save_orbax(cfg, params, str(tmp_path / "orbax"))
  cfg_o, params_o = model_dirs.load_model(str(tmp_path / "orbax"))
  assert cfg_o == cfg and _leaves_equal(params, params_o)
  model_dirs.save_hf(cfg_o, params_o, str(tmp_path / "hf"))
  cfg_h, params_h = model_dirs.load_model(str(tmp_path / "hf"), log=lambda _: None)
  assert cfg_h == cfg and _leaves_equal(params, params_h)


def test_import_places_each_tensor_on_its_sharding(saved_reference):
  _, path = saved_reference
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  _, params = model_dirs.load_model(path, shardings=lambda p: sharding, log=lambda _: None)
  assert all(x.sharding == sharding for x in jax.tree_util.tree_leaves(params))


_TWO_DEVICE_IMPORT = """
import os, sys
import chex; chex.set_n_cpu_devices(2)  # two simulated host devices, before jax starts
import jax, numpy as np
from diffgemma.io import model_dirs
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
layout = lambda path: split if path == ("embedding",) else replicated
_, params = model_dirs.load_model(sys.argv[1], shardings=layout, log=lambda _: None)
_, host = model_dirs.load_model(sys.argv[1], log=lambda _: None)
emb = params["embedding"]
assert [s.data.shape for s in emb.addressable_shards] == [(32, 32), (32, 32)], emb.sharding
assert {s.device for s in emb.addressable_shards} == set(jax.devices())
jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, host)
print("ok")
"""


def test_import_splits_tensors_across_two_devices(saved_reference):
  from tests.helpers import run

  r = run("-c", _TWO_DEVICE_IMPORT, saved_reference[1])
  assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_gemma4_import_loads_every_backbone_tensor(tmp_path):
  ref = reference.tiny_gemma4_reference(seed=5)
  path = str(tmp_path / "gemma4")
  ref.save_pretrained(path, max_shard_size=SHARD)
  notes = []
  cfg, params = model_dirs.load_model(path, canvas_length=8, rng=jax.random.PRNGKey(9),
                                         log=notes.append)
  assert any("self-conditioning block freshly initialised" in n for n in notes)
  # Every text tensor of the checkpoint went somewhere (strict mode raises otherwise), and
  # each backbone leaf equals its source tensor.
  state = reference.state_dict_numpy(ref)
  for path_keys, name, layout, group in hf_weights.tensor_table(cfg):
    leaf = params
    for k in path_keys:
      leaf = leaf[k]
    if group == hf_weights.BACKBONE:
      np.testing.assert_array_equal(layout.to_hf(np.asarray(leaf)),
                                    state["model.language_model." + name])
  expected_sc = transformer.init_self_conditioning(cfg, jax.random.PRNGKey(9))
  assert _leaves_equal(params["self_conditioning"], expected_sc)
  # The imported backbone, run as our causal encoder, is the Gemma 4 AR model.
  tokens = np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 13))
  with torch.no_grad():
    theirs = ref(input_ids=torch.as_tensor(tokens)).logits.numpy()
  hidden, _ = transformer.encode(params, cfg, jnp.asarray(tokens),
                                 transformer.init_cache(cfg, 2, 13))
  np.testing.assert_array_less(np.abs(np.asarray(transformer.lm_head(params, hidden, cfg)) - theirs)
                               .max(), TOL)


def test_preset_parameter_counts_match_the_report():
  counts = transformer.param_counts(gemma_26b_a4b())
  assert f"{counts['total'] / 1e9:.3g}" == "25.2"  # report: 25.2B total
  assert f"{counts['active'] / 1e9:.2g}" == "3.8"  # report: 3.8B active (ours: 3.82B)


# ----------------------------------------------------------------------------- bad input


def _copy_checkpoint(src, dst):
  os.makedirs(dst)
  for name in os.listdir(src):
    with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
      g.write(f.read())
  return dst


def test_missing_shard_names_the_file(saved_reference, tmp_path):
  path = _copy_checkpoint(saved_reference[1], str(tmp_path / "ckpt"))
  shard = sorted(f for f in os.listdir(path) if f.startswith("model-"))[1]
  os.remove(os.path.join(path, shard))
  with pytest.raises(safetensors_dir.CheckpointFormatError, match=shard):
    model_dirs.load_model(path)


def test_config_mismatch_names_the_tensor(saved_reference, tmp_path):
  path = _copy_checkpoint(saved_reference[1], str(tmp_path / "ckpt"))
  config_path = os.path.join(path, "config.json")
  config = json.load(open(config_path))
  config["text_config"]["hidden_size"] = 48
  json.dump(config, open(config_path, "w"))
  with pytest.raises(hf_weights.WeightMappingError, match="embed_tokens.weight.*config expects"):
    model_dirs.load_model(path, log=lambda _: None)


def test_unknown_tensor_is_named(saved_reference, tmp_path):
  path = _copy_checkpoint(saved_reference[1], str(tmp_path / "ckpt"))
  index_path = os.path.join(path, safetensors_dir.INDEX_FILE)
  index = json.load(open(index_path))
  extra = np.ones((3,), np.float32)
  (tmp_path / "extra").mkdir()
  safetensors_dir.write_dir([("model.decoder.mystery.weight", extra.shape, extra.dtype,
                             lambda: extra)], str(tmp_path / "extra"))
  os.rename(str(tmp_path / "extra" / safetensors_dir.SINGLE_FILE),
            os.path.join(path, "model-extra.safetensors"))
  index["weight_map"]["model.decoder.mystery.weight"] = "model-extra.safetensors"
  json.dump(index, open(index_path, "w"))
  with pytest.raises(hf_weights.WeightMappingError, match="unexpected tensor 'model.decoder.mystery"):
    model_dirs.load_model(path, log=lambda _: None)



def test_safetensors_files_agree_with_the_safetensors_package(tmp_path):
  """Our writer's shards read by the `safetensors` package, and its files read by us: the same
  names, dtypes, shapes and bytes (every dtype a checkpoint holds, an empty and a 0-d tensor)."""
  import ml_dtypes
  from safetensors import safe_open
  from safetensors.numpy import save_file

  rng = np.random.default_rng(0)
  tensors = {
      "bf16": rng.standard_normal((5, 7)).astype(ml_dtypes.bfloat16),
      "f32": rng.standard_normal((3, 2, 4)).astype(np.float32),
      "f16": rng.standard_normal(6).astype(np.float16),
      "i64": rng.integers(-2**40, 2**40, (2, 3)), "i8": rng.integers(-128, 128, 9, np.int8),
      "u8": rng.integers(0, 256, 4, np.uint8), "bool": rng.random(5) < 0.5,
      "empty": np.zeros((0, 3), np.float32), "scalar": np.array(2.5, np.float64),
  }
  ours = str(tmp_path / "ours")
  os.makedirs(ours)
  files = safetensors_dir.write_dir([(n, t.shape, t.dtype, lambda t=t: t) for n, t in
                                     tensors.items()], ours, max_shard_bytes=100)
  assert safetensors_dir.INDEX_FILE in files and len(files) > 3
  theirs = {}
  for fname in files[:-1]:
    with safe_open(os.path.join(ours, fname), framework="numpy") as f:
      assert f.metadata() == {"format": "pt"}
      theirs.update({n: f.get_tensor(n) for n in f.keys()})
  lib = str(tmp_path / "lib")
  os.makedirs(lib)
  save_file(tensors, os.path.join(lib, safetensors_dir.SINGLE_FILE), metadata={"format": "pt"})
  read_back = safetensors_dir.SafetensorsDir(lib)
  for got in (theirs, read_back):
    assert sorted(got) == sorted(tensors)
    for n, t in tensors.items():
      assert got[n].dtype == t.dtype and got[n].shape == t.shape, n
      assert got[n].tobytes() == t.tobytes(), n

def test_failed_or_refused_writes_leave_nothing(saved_reference, tmp_path, monkeypatch):
  cfg, params = model_dirs.load_model(saved_reference[1], log=lambda _: None)
  # Parameters that do not fit the config are refused before anything is written.
  broken = jax.tree_util.tree_map(lambda x: x, params)
  broken["layers"][3]["mlp"]["down"] = jnp.zeros((2, 2))
  with pytest.raises(hf_weights.WeightMappingError, match=r"\['layers'\]\[3\]\['mlp'\]"):
    model_dirs.save_hf(cfg, broken, str(tmp_path / "out"))
  # A write that dies halfway (after some shards are on disk) leaves no destination behind.
  real_write, calls = safetensors_dir._write_file, []

  def write_then_die(*args):
    calls.append(real_write(*args))
    if len(calls) == 3:
      raise OSError("disk full")
    return calls[-1]

  monkeypatch.setattr(safetensors_dir, "_write_file", write_then_die)
  with pytest.raises(OSError, match="disk full"):
    model_dirs.save_hf(cfg, params, str(tmp_path / "out"), max_shard_bytes=30_000)
  assert len(calls) == 3 and os.listdir(tmp_path) == []
  monkeypatch.undo()
  # An existing destination is never overwritten.
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "keep.txt").write_text("mine")
  with pytest.raises(safetensors_dir.CheckpointFormatError, match="already exists"):
    model_dirs.save_orbax(cfg, params, str(tmp_path / "taken"))
  assert os.listdir(tmp_path / "taken") == ["keep.txt"]
  assert sorted(os.listdir(tmp_path)) == ["taken"]


# ----------------------------------------------------------------------------- CLI and --init_from


def test_convert_cli_and_init_from_a_converted_run(trained_run, tmp_path):
  from diffgemma.runs import checkpointing
  from diffgemma.training import loaded, loop, run_config, training_state
  from tests.helpers import one_line_error, run
  from tests.helpers import tiny_sudoku_config

  source_run = trained_run
  exported = str(tmp_path / "exported")
  r = run("scripts/convert_checkpoint.py", f"--from={source_run}", f"--to={exported}")
  assert r.returncode == 0 and "transformers' DiffusionGemma layout" in r.stdout, r.stderr
  orbax_dir = str(tmp_path / "orbax_bf16")
  r = run("scripts/convert_checkpoint.py", f"--from={exported}", f"--to={orbax_dir}",
          "--dtype=bfloat16")
  assert r.returncode == 0 and "orbax model" in r.stdout, r.stderr
  one_line_error(run("scripts/convert_checkpoint.py", f"--from={exported}", f"--to={orbax_dir}"),
                 "already exists")
  one_line_error(run("scripts/convert_checkpoint.py", f"--from={tmp_path / 'nowhere'}",
                     f"--to={tmp_path / 'x'}"), "not found")
  # eval.py evaluates a converted checkpoint under a task config (architecture from the
  # checkpoint); a config whose prompt vocabulary does not fit the model is refused.
  from diffgemma.tasks import sudoku_puzzles

  csv = str(tmp_path / "puzzles.csv")
  sudoku_puzzles.write_csv(csv, *sudoku_puzzles.generate_puzzles(7, 4, 40, 44))
  r = run("eval.py", f"--init_from={orbax_dir}", f"--data={csv}", "--config=sft_sudoku",
          "--config.data.prompt_format=digits", "--config.sampler.max_denoising_steps=4",
          "--trajectory_stats")
  assert r.returncode == 0, r.stderr
  metrics = json.loads(r.stdout.strip().splitlines()[-1])
  assert metrics["num_puzzles"] == metrics["num_examples"] == 4
  assert 1 <= metrics["settle_steps_per_canvas"] <= metrics["steps_per_canvas"]
  profile = metrics["step_profile"]
  assert profile["rows"][0] == 4 and len(profile["rows"]) <= 4
  # Every puzzle ran step 1; the profile's step counts add up to the decoder passes.
  assert sum(profile["rows"]) == 4 * metrics["decoder_passes"]
  assert "step  puzzles" in r.stdout
  one_line_error(run("eval.py", f"--init_from={exported}", f"--data={csv}", "--config=sft_sudoku",
                     "--config.data.prompt_format=cell_tokens"), "too small")

  # A new run whose config asks for a different architecture adopts the checkpoint's, starts
  # from its exact parameters, records where it came from, and resumes under it.
  wider = tiny_sudoku_config(workdir_steps=2)
  wider.model.hidden_size = 24
  # The entry point adopts the checkpoint's architecture first; loading never changes it.
  with pytest.raises(ValueError, match="hidden_size.* differ from the run"):
    training_state.load_initial_params(run_config.build(wider).model, exported, wider.seed)
  training_state.adopt_checkpoint_architecture(wider, exported)
  assert wider.model.hidden_size == 16
  init_params = training_state.load_initial_params(run_config.build(wider).model, exported,
                                                   wider.seed)
  source = loaded.load_run(source_run)
  assert _leaves_equal(init_params, source.params)
  wider = tiny_sudoku_config(workdir_steps=2)
  wider.model.hidden_size = 24
  finetune = str(tmp_path / "finetune")
  loop.train(wider, finetune, stop_at=1, init_from=exported)
  saved = checkpointing.load_config(finetune)
  assert saved.model.hidden_size == 16 and saved.init_from == os.path.abspath(exported)
  last = loop.train(wider, finetune, init_from=exported)
  assert np.isfinite(last["loss"]) and checkpointing.latest_step(finetune) == 2


def _record_restored_leaves(monkeypatch) -> list[str]:
  """Names of the checkpoint leaves orbax deserializes from now on (its per-leaf handlers)."""
  from orbax.checkpoint import type_handlers

  names = []
  for handler in (type_handlers.ArrayHandler, type_handlers.NumpyHandler,
                  type_handlers.ScalarHandler):
    original = handler.deserialize

    async def spy(self, infos, args=None, _original=original):
      names.extend(info.name for info in infos)
      return await _original(self, infos, args)

    monkeypatch.setattr(handler, "deserialize", spy)
  return names


def test_eval_of_a_full_fine_tuning_workdir_reads_no_optimizer_state(trained_run, monkeypatch):
  from diffgemma.training import loaded
  from tests.helpers import restore_run

  workdir = trained_run
  read = _record_restored_leaves(monkeypatch)
  restore_run(workdir)  # the trainer's restore: the spy sees the optimizer state
  assert any(name.startswith("opt_state") for name in read), sorted(set(read))[:10]
  read.clear()
  run = loaded.load_run(workdir)  # what eval.py and sample.py do
  num_params = len(jax.tree_util.tree_leaves(run.params))
  assert read and all(name.startswith("params.") for name in read), sorted(set(read))[:10]
  assert len(read) == num_params
