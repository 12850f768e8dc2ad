"""Training on images: the SFT batch's images reach the encoder, the vision tower is frozen by
default, trained with freeze_vision=False or through LoRA targets that add its linears; a run on
image data evaluates with its held-out images, and eval.py and sample.py --image read image
prompts, with one-line errors for images that cannot go in; --dry_run plans image batches and
counts the tower (tiny configs, one device).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diffgemma.model import lora, sharding, transformer
from diffgemma.tasks import make_task
from diffgemma.training import losses, memory_plan, stages, training_state, update_step
from tests.helpers import (add_vision_tower, load_script, run_tool_cases, setup_of,
                           tiny_chat_config, tiny_sudoku_config, write_png)

VISION_LINEARS = r"^vision_tower[.].*_proj$"


def image_task_files(directory, train=12, held_out=4):
  """scripts/make_image_task.py's training and held-out sets in `directory`."""
  script = load_script("make_image_task")
  paths = (os.path.join(directory, "train.jsonl"), os.path.join(directory, "test.jsonl"))
  script.write_task(num=train, seed=1, out=paths[0])
  script.write_task(num=held_out, seed=2, out=paths[1])
  return paths


def image_run_config(train="", held_out="", **changes):
  """A tiny chat model with a one-layer tower on the image task's layout (one image slot),
  batches of 4."""
  config = tiny_chat_config(train, tokenizer="bytes_image", max_images=1, prompt_len=64,
                            num_canvases=1, eval=held_out)
  config.update({"batch_size": 4, "num_train_steps": 10, **changes})
  config.optimizer.warmup_steps = 1
  return add_vision_tower(config)


@pytest.fixture(scope="module")
def image_data(tmp_path_factory):
  return image_task_files(str(tmp_path_factory.mktemp("shapes")))


def _step(config, batch, lora_targets=None):
  """(params before, params after) one update step of `config` on `batch` (full fine-tuning,
  or LoRA with `lora_targets` added to the defaults: then the adapters)."""
  if lora_targets:
    config.lora.update(enabled=True, base_dtype="float32",
                       targets=tuple(config.lora.targets) + tuple(lora_targets))
  setup = setup_of(config)
  task = make_task(config)
  stage = stages.make_stage(task, setup)
  frozen = None
  if lora_targets:
    frozen = transformer.init_params(setup.model_cfg, jax.random.PRNGKey(0))
  state = training_state.init_state(setup, frozen=frozen)
  before = jax.tree_util.tree_map(np.asarray, state["params"])
  step = update_step.make_update_step(setup, stage.loss_fn)
  state, metrics = step(state, frozen, jax.tree_util.tree_map(jnp.asarray, batch))
  assert np.isfinite(float(metrics["loss"]))
  return before, jax.tree_util.tree_map(np.asarray, state["params"])


def _moved(before, after, prefix):
  """{dotted path: whether it changed} of the leaves under `prefix`."""
  flat = lambda tree: {lora.dotted(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  b, a = flat(before), flat(after)
  return {k: not np.array_equal(b[k], a[k]) for k in b if k.startswith(prefix)}


def test_the_loss_reads_the_images(image_data):
  """The batch's images reach the encoder: other pixels give another loss on the same tokens
  and draws; the batch shapes the stage declares are the task's batches'."""
  config = image_run_config(image_data[0])
  setup = setup_of(config)
  task = make_task(config)
  stage = stages.make_stage(task, setup)
  batch = next(task.train_batches(config.batch_size, 1))
  shapes = stage.batch_shapes()
  assert {k: (v.shape, v.dtype) for k, v in shapes.items()} == {
      k: (np.shape(v), np.asarray(v).dtype) for k, v in batch.items()}
  params = transformer.init_params(setup.model_cfg, jax.random.PRNGKey(1))
  loss = jax.jit(lambda b: losses.sft_loss(params, setup.model_cfg, setup.loss_cfg,
                                            task.layout, b, jax.random.PRNGKey(2))[1])
  real = loss(batch)
  other = loss({**batch, "pixel_values": batch["pixel_values"][::-1]})
  assert float(real["encoder_loss"]) != float(other["encoder_loss"])


@pytest.mark.parametrize("mode", ["frozen", "trained", "lora"])
def test_the_tower_is_frozen_unless_asked(image_data, mode):
  """Full fine-tuning leaves the tower and its embedder as they were (freeze_vision, the
  default: no update, not even weight decay), trains them with freeze_vision=False; LoRA
  targets that add the tower's linears give them adapters that train."""
  config = image_run_config(image_data[0])
  config.optimizer.update(warmup_steps=0, weight_decay=0.1)
  config.freeze_vision = mode != "trained"
  batch = next(make_task(config).train_batches(config.batch_size, 1))
  before, after = _step(config, batch, [VISION_LINEARS] if mode == "lora" else None)
  tower = _moved(before, after, "vision_tower.")
  embedder = _moved(before, after, "embed_vision.")
  if mode == "frozen":
    assert tower and not any(tower.values()) and not any(embedder.values())
  elif mode == "trained":
    assert tower["vision_tower.layers.0.attn.q_proj"] and all(embedder.values())
  else:  # B starts at zero and moves only by its gradient (A moves by weight decay too)
    adapters = {k[:-2] for k in tower if k.endswith(".b")}
    assert adapters == {"vision_tower.patch_embedder.input_proj"} | {
        f"vision_tower.layers.0.{m}.{w}" for m, ws in (
            ("attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            ("mlp", ("gate_proj", "up_proj", "down_proj"))) for w in ws}
    assert all(tower[k + ".b"] for k in adapters)
  assert any(_moved(before, after, "layers.").values())  # the language model trains


def test_a_new_tower_tells_pictures_apart(image_data):
  """From scratch (configs/sft_image.py's tower), the soft tokens of different pictures start
  apart: the position table starts at normal(initializer_range); at transformers' ones every
  patch would start from one large shared vector, every soft token nearly the same."""
  from configs import sft_image
  from diffgemma.io import image_processing
  from diffgemma.training import run_config

  cfg = run_config.build(sft_image.get_config()).model
  folder = os.path.join(os.path.dirname(image_data[1]), "test_images")
  settings = image_processing.ImageSettings(patch_size=8, pooling_kernel_size=2,
                                            max_soft_tokens=16)
  images = image_processing.process_images(
      [os.path.join(folder, name) for name in sorted(os.listdir(folder))], settings)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  table = params["vision_tower"]["patch_embedder"]["position_embedding_table"]
  assert abs(float(np.std(table)) - cfg.vision.initializer_range) < 0.005

  def soft_tokens(model):
    tokens, valid = model.vision_tower(images.pixel_values, images.position_ids)
    return model.embed_vision(tokens)[valid]

  def mean_cosine(params):
    soft = np.asarray(transformer.Model(cfg).apply(transformer.to_variables(params),
                                                   method=soft_tokens))
    unit = soft / np.linalg.norm(soft, axis=-1, keepdims=True)
    return float((unit @ unit.T)[np.triu_indices(len(unit), 1)].mean())

  ones = jax.tree_util.tree_map(lambda x: x, params)
  ones["vision_tower"]["patch_embedder"]["position_embedding_table"] = jnp.ones_like(table)
  assert mean_cosine(params) < 0.8 and mean_cosine(ones) > 0.99


def test_vision_weights_carry_logical_axes():
  """The tower's linears split like the text model's (width on fsdp, heads and MLP on
  tensor), and so do LoRA adapters on them; norms and clip bounds stay whole."""
  assert sharding.logical_axes("vision_tower.layers.3.attn.q_proj", 3) == (
      "embed", "heads", "head_dim")
  assert sharding.logical_axes("vision_tower.layers.3.mlp.down_proj", 2) == ("mlp", "embed")
  assert sharding.logical_axes("vision_tower.layers.3.mlp.gate_proj.a", 2) == (
      "embed", sharding.LORA_RANK)
  assert sharding.logical_axes("embed_vision.projection", 2) == (None, "embed")
  assert sharding.logical_axes("vision_tower.layers.3.input_norm", 1) == (None,)
  # The text model's own names are untouched by the tower's.
  assert sharding.logical_axes("layers.0.attn.q", 3) == ("embed", "heads", "head_dim")


def test_dry_run_plans_images_and_counts_the_tower():
  """A memory plan of a text task on a model with a tower: the tower's weights counted,
  --dry_run_images=1 adds an image slot of the tower's budget to every row and lengthens the
  prompt by its placeholders; a model without a tower cannot plan images (one line)."""
  config = tiny_sudoku_config()
  config.lora.update(enabled=True, base_dtype="float32")
  config.model.vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                             patch_size=8, pooling_kernel_size=2, default_output_length=16,
                             position_embedding_size=16)
  plain = memory_plan.dry_run(config)
  planned = memory_plan.dry_run(config, images=1)
  assert plain["images_per_row"] == 0 and plain["vision_params_gib"] > 0
  assert planned["images_per_row"] == 1 and planned["image_patches"] == 16 * 4
  assert planned["row_tokens"] == plain["row_tokens"] + 16 + 2
  assert (planned["programs"]["update step"]["arguments_gib"]
          > plain["programs"]["update step"]["arguments_gib"])
  assert "1 image(s) of 64 patches" in memory_plan.format_report(planned)
  config.model.vision = None
  with pytest.raises(ValueError, match="--dry_run_images needs a model with a vision tower"):
    memory_plan.dry_run(config, images=1)


def test_sdrl_refuses_image_tasks(image_data):
  config = image_run_config(image_data[0])
  config.stage = "sdrl"
  from configs import sdrl_chat

  config.sdrl = sdrl_chat.get_config().sdrl
  config.rl = sdrl_chat.get_config().rl
  with pytest.raises(ValueError, match="SD·RL does not support image tasks"):
    stages.make_stage(make_task(config), setup_of(config))


# ----------------------------------------------------------------------------- a run, its tools


@pytest.fixture(scope="module")
def image_run(tmp_path_factory, image_data):
  """A tiny image run of two steps, evaluated at its end on the held-out images; a text-only
  chat run's directory (config only) beside it."""
  from diffgemma.runs import checkpointing
  from diffgemma.training import loop

  tmp = tmp_path_factory.mktemp("image_run")
  config = image_run_config(image_data[0], image_data[1], num_train_steps=2,
                            checkpoint_every=2, max_train_minutes=0.0)
  config.eval.update(every_steps=2, num_examples=0)
  metrics = loop.train(config, str(tmp / "run"))
  text_run = str(tmp / "text_run")  # a run's directory before its first checkpoint
  checkpointing.save_config(text_run, tiny_chat_config(tokenizer="bytes"))
  os.makedirs(checkpointing.checkpoint_dir(text_run))
  return str(tmp / "run"), text_run, metrics


def test_an_image_run_evaluates_and_samples_its_images(image_run, image_data, tmp_path):
  """The periodic eval ran on the held-out images; eval.py scores an image JSONL and
  sample.py --image answers an image question (one compiled program each); missing,
  unreadable and too many images, and an image for a model without a tower, are one line and
  write nothing."""
  workdir, text_run, metrics = image_run
  assert "eval/accuracy" in metrics and metrics["eval/num_examples"] == 4
  picture = json.loads(open(image_data[1]).readline())["messages"][0]["content"][0]["path"]
  picture = os.path.join(os.path.dirname(image_data[1]), picture)
  unreadable = tmp_path / "broken.png"
  unreadable.write_text("not a picture")
  other = write_png(tmp_path / "other.png", 64, 64)
  predictions = str(tmp_path / "predictions.jsonl")
  ok = [["--workdir=" + workdir, f"--data={image_data[1]}", f"--predictions={predictions}"]]
  sample_ok = [["--workdir=" + workdir, f"--image={picture}", "--prompt=How many shapes?",
                "--warm_runs=0"],
               ["--init_from=" + workdir, f"--image={picture}", "--prompt=How many shapes?",
                "--warm_runs=0", "--max_new_tokens=8"]]
  bad = [
      (["--workdir=" + workdir, f"--image={tmp_path}/none.png", "--prompt=Which?"], "none.png"),
      (["--workdir=" + workdir, f"--image={unreadable}", "--prompt=Which?"], "broken.png"),
      (["--workdir=" + workdir, f"--image={picture}", f"--image={other}", "--prompt=Which?"],
       "data.max_images=1"),
      (["--init_from=" + text_run, f"--image={picture}", "--prompt=Which?"], "no vision tower"),
      ([f"--init_from={workdir}", f"--image={picture}", "--prompt=Which?", "--chat=false"],
       "chat template")]
  before = sorted(os.listdir(tmp_path))
  (evaluated,), sampled = run_tool_cases([("eval.py", ["sampler"], ok),
                                          ("sample.py", ["sampler"],
                                           sample_ok + [argv for argv, _ in bad])])
  assert evaluated["code"] == 0, evaluated["stderr"][-2000:]
  result = json.loads(evaluated["stdout"].strip().splitlines()[-1])
  assert result["num_examples"] == 4 and 0.0 <= result["accuracy"] <= 1.0
  records = [json.loads(line) for line in open(predictions)]
  assert [len(r["images"]) for r in records] == [1] * 4
  for outcome in sampled[:2]:
    assert outcome["code"] == 0, outcome["stderr"][-2000:]
  assert "final reply" in sampled[0]["stdout"]
  assert "prompt tokens" in sampled[1]["stdout"]  # text mode's summary line
  for (argv, needle), outcome in zip(bad, sampled[2:]):
    lines = [line for line in outcome["stderr"].splitlines() if line.strip()]
    assert outcome["code"] == 2 and len(lines) == 1 and needle in lines[0], (argv, lines)
  assert sorted(os.listdir(tmp_path)) == before + ["predictions.jsonl"]
