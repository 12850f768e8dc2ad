"""Helpers shared by several test files (no test file imports another): command lines of the
scripts, tiny configs, saved tiny runs, test tokenizers and chat data files, and
`run_tool_cases`, which runs many command lines of the tools in one process.
"""

import glob
import importlib.util
import io
import json
import os
import re
import subprocess
import sys

from configs import sdrl_sudoku, sft_chat, sft_sudoku

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, cwd=ROOT, env=None):
  env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
  return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                        env=env, timeout=300)


def entry_points() -> list[str]:
  """Every command of the repository (relative paths): the Python files with a `__main__` block
  at the root, in scripts/ and in benchmarks/."""
  found = []
  for pattern in ("*.py", "scripts/*.py", "benchmarks/*.py"):
    for path in sorted(glob.glob(os.path.join(ROOT, pattern))):
      with open(path, encoding="utf-8") as f:
        if re.search(r"^if __name__ == .__main__.:", f.read(), re.M):
          found.append(os.path.relpath(path, ROOT))
  return found


# Runs each command of a JSON list of argv (stdin) in this one process, as `python SCRIPT ARGS`
# would (its folder first on sys.path, its own flags only), and prints one JSON object:
# {index: [exit code, stdout, stderr]}.
_IN_ONE_PROCESS = """
import contextlib, io, json, os, runpy, sys, traceback
from absl import flags

results = {}
for i, argv in enumerate(json.load(sys.stdin)):
  for module, defined in list(flags.FLAGS.flags_by_module_dict().items()):
    if not module.startswith("absl."):  # a command's flags, defined when it is run
      for name in [flag.name for flag in defined]:
        if name in flags.FLAGS:
          delattr(flags.FLAGS, name)
  flags.FLAGS.unparse_flags()
  folder = os.path.dirname(os.path.abspath(argv[0]))
  sys.argv, out, err, code = list(argv), io.StringIO(), io.StringIO(), 0
  sys.path.insert(0, folder)
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
      traceback.print_exc()
      code = 1
  sys.path.remove(folder)
  results[i] = [code, out.getvalue(), err.getvalue()]
sys.stdout.write(json.dumps(results))
"""


def run_in_one_process(argvs: list[list[str]]) -> list[tuple[int, str, str]]:
  """(exit code, stdout, stderr) of each command line [SCRIPT, ARG, ...], all run one after
  another in one Python process (each `python SCRIPT` would import jax again)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", _IN_ONE_PROCESS], input=json.dumps(argvs), cwd=ROOT,
                     capture_output=True, text=True, env=env, timeout=600)
  assert r.returncode == 0, r.stderr
  results = json.loads(r.stdout)
  return [tuple(results[str(i)]) for i in range(len(argvs))]


def one_line_error(result, *needles):
  assert result.returncode == 2, result.stderr
  lines = [l for l in result.stderr.strip().splitlines() if l.strip()]
  assert len(lines) == 1, result.stderr
  assert lines[0].startswith("error: ")
  for needle in needles:
    assert needle in lines[0], lines[0]


def load_script(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "scripts", name + ".py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def tiny_sudoku_config(workdir_steps=4):
  config = sft_sudoku.get_config()
  config.model.update(dict(
      vocab_size=16, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
      num_kv_heads=1, head_dim=8, global_head_dim=8, num_global_kv_heads=1, num_experts=4,
      top_k_experts=2, moe_intermediate_size=8, moe_tile_size=8, layer_types=()))
  config.data.prompt_format = "digits"
  config.data.num_threads = 0
  config.batch_size = 4
  config.num_train_steps = workdir_steps
  config.log_every = 1
  config.checkpoint_every = 100
  config.eval.every_steps = 0
  config.optimizer.warmup_steps = 1
  return config


def tiny_configs():
  """A tiny SFT config and the SD·RL config on top of it (same model, tiny sampler budgets)."""
  sft = sft_sudoku.get_config()
  sft.model.update({
      "vocab_size": 16, "hidden_size": 16, "intermediate_size": 24, "num_layers": 1,
      "num_heads": 2, "num_kv_heads": 1, "head_dim": 8, "global_head_dim": 8,
      "num_global_kv_heads": 1, "num_experts": 4, "top_k_experts": 2,
      "moe_intermediate_size": 8, "moe_impl": "ragged_dot", "layer_types": (),
      "canvas_length": 27})  # three canvases per solution
  sft.data.update({"prompt_format": "digits", "num_threads": 0})
  sft.eval.every_steps = 0
  config = sdrl_sudoku.get_config()
  config.update({key: sft[key] for key in ("model", "data", "eval")})
  config.update({"num_train_steps": 4, "checkpoint_every": 2, "log_every": 1})
  config.optimizer.warmup_steps = 1
  config.sdrl.update({"group_size": 2, "prompts_per_rollout": 2, "updates_per_rollout": 2,
                      "states_per_trajectory": 2, "anchor": "none"})
  config.rl.reward.partial_credit = "cells"
  # Stop on a stable argmax alone (threshold above log V), so rows stop at different steps.
  config.sdrl.rollout_sampler.update({"max_denoising_steps": 4, "confidence_threshold": 100.0})
  config.rl.prompts.update({"min_givens": 44, "max_givens": 46})
  return sft, config


def sharded_sft_losses(fsdp, tensor, steps=5):
  """(losses [steps], the trained embedding) of the tiny SFT config's update step on a
  fsdp x tensor mesh (as the training loop builds the step and places state and batches);
  needs fsdp * tensor devices, e.g. XLA_FLAGS=--xla_force_host_platform_device_count=2."""
  import jax
  import numpy as np
  from diffgemma.model import sharding
  from diffgemma.tasks import make_task
  from diffgemma.training import training_state, update_step
  from diffgemma.training.stages import sft

  config = tiny_sudoku_config(workdir_steps=steps)
  config.model.update(dict(num_heads=4, num_kv_heads=2, intermediate_size=32))
  config.sharding.update(dict(fsdp=fsdp, tensor=tensor))
  setup = setup_of(config)
  assert setup.mesh.size == fsdp * tensor
  state = training_state.init_state(setup)
  target = training_state.abstract_state(setup)
  state = jax.device_put(state, jax.tree_util.tree_map(lambda x: x.sharding, target))
  stage = sft.SftStage(None, make_task(config), setup)
  step = update_step.make_update_step(setup, stage.loss_fn,
                                      jax.tree_util.tree_map(lambda x: x.sharding, target), None,
                                      update_step.batch_shardings(setup, stage.batch_shapes()))
  stage.start(state, None, 0, ".")
  out = []
  for _ in range(steps):
    batch, _ = stage.next_batch(0, state, None)
    state, metrics = step(state, None, sharding.global_batch(batch, setup.mesh, setup.rules))
    out.append(float(metrics["loss"]))
  return np.array(out), state["params"]["embedding"]


def save_sft_run(sft, workdir):
  """A saved SFT run at step 0 (trainer layout: config.json + an orbax state checkpoint).

  The default (small) init: a large-weight random model is chaotic along a trajectory (float
  rounding differences between two compiled programs grow into flipped expert choices and
  argmaxes within a few steps), so the replay checks need a tame one, as a trained model is.
  """
  import jax
  from diffgemma.model import transformer
  from diffgemma.runs import checkpointing
  from diffgemma.training import training_state

  setup = setup_of(sft)
  params = transformer.init_params(setup.model_cfg, jax.random.key(0, impl="rbg"))
  checkpointing.save_config(workdir, sft)
  with checkpointing.manager(workdir) as mngr:
    checkpointing.save(mngr, 0, training_state.init_state(setup, params))
  return params


def setup_of(config, mesh=None):
  """The run's `Setup` as train.py's entry point builds it: the ConfigDict typed once
  (`run_config.build`, with the stage's section), then the setup."""
  from diffgemma.training import run_config, stages, training_state

  return training_state.make_setup(run_config.build(config, **stages.stage_settings(config)),
                                   mesh)


def restore_run(workdir: str, step: int | None = None):
  """(config, setup, state, frozen, step) of a workdir's checkpoint (the newest readable one by
  default), under its saved config: the whole training state, e.g. to compare two runs."""
  from diffgemma.runs import checkpointing
  from diffgemma.training import run_config, training_state

  config = checkpointing.load_config(workdir)
  setup = training_state.make_setup(run_config.build(config))
  state, frozen, step = training_state.restore_state(workdir, setup, step=step)
  return config, setup, state, frozen, step


def dequantize_params(params):
  """Plain params: every `QuantizedWeight` dequantized (in its scale dtype)."""
  import jax
  from diffgemma.model import quantize

  is_q = lambda w: isinstance(w, quantize.QuantizedWeight)
  return jax.tree_util.tree_map(lambda w: w.astype(w.dtype) if is_q(w) else w, params,
                                is_leaf=is_q)


CORPUS = ["the quick brown fox jumps over the lazy dog\n", "hello world, how are you?\n",
          "user\nmodel\nthought\n", "a block diffusion model denoises a canvas of tokens\n"]


SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<|turn>", "<turn|>", "<|channel>", "<channel|>"]
# Gemma 4's image tokens, and its audio tokens (transformers' Gemma4Processor refuses a tokenizer
# without them, even for images).
IMAGE_TOKENS = {"boi_token": "<|image>", "image_token": "<|image|>", "eoi_token": "<image|>",
                "boa_token": "<|audio>", "audio_token": "<|audio|>", "eoa_token": "<audio|>"}
# Gemma 4's handling of content lists: text parts trimmed, an image part as the image token
# between blank lines (as the released template writes it).
IMAGE_TEMPLATE = """{{ bos_token }}
{%- for message in messages -%}
{{ '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}
{%- if message['content'] is string -%}{{ message['content'] | trim }}
{%- else -%}{%- for item in message['content'] -%}
{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}
{%- elif item['type'] == 'image' -%}{{ '\n\n<|image|>\n\n' }}{%- endif -%}
{%- endfor -%}{%- endif -%}
{{ '<turn|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<|turn>model\n' }}{%- endif -%}"""


def write_tokenizer_json(directory, vocab_size=64, specials=SPECIALS, template=None,
                         config_extra=None):
  """A Gemma-like BPE tokenizer.json (normalizer ' ' -> '▁', Gemma's decoder) of exactly
  `vocab_size` ids, plus tokenizer_config.json and, if given, chat_template.jinja."""
  import tokenizers
  from tokenizers import decoders, normalizers, trainers

  os.makedirs(directory, exist_ok=True)
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
  tok.normalizer = normalizers.Replace(" ", "▁")
  tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                   decoders.Fuse()])
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=vocab_size,
                                                      special_tokens=specials,
                                                      show_progress=False))
  assert tok.get_vocab_size() == vocab_size
  tok.save(os.path.join(directory, "tokenizer.json"))
  config = {"tokenizer_class": "GemmaTokenizer", "bos_token": "<bos>", "eos_token": "<eos>",
            "pad_token": "<pad>", "unk_token": "<unk>", **(config_extra or {})}
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(config, f)
  if template is not None:
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
      f.write(template)
  return directory


def write_image_tokenizer(directory):
  """A tiny Gemma-like tokenizer with Gemma 4's image (and audio) tokens, named in
  tokenizer_config.json as Gemma 4 names them, and `IMAGE_TEMPLATE`."""
  return write_tokenizer_json(directory, vocab_size=72,
                              specials=SPECIALS + list(IMAGE_TOKENS.values()),
                              template=IMAGE_TEMPLATE,
                              config_extra={"extra_special_tokens": IMAGE_TOKENS})


def write_png(path, height, width, seed=0, mode="RGB"):
  """A random image of `height` x `width` pixels saved at `path` (PNG); returns the path."""
  import numpy as np
  from PIL import Image

  channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
  pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), np.uint8)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  Image.fromarray(pixels[..., 0] if mode == "L" else pixels).save(path)
  return str(path)


def write_sentencepiece(directory, template=None):
  """A tiny SentencePiece BPE model with Gemma's trainer settings and special ids."""
  import sentencepiece

  os.makedirs(directory, exist_ok=True)
  model = io.BytesIO()
  sentencepiece.SentencePieceTrainer.train(
      sentence_iterator=iter(CORPUS * 3), model_writer=model, vocab_size=90, model_type="bpe",
      pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
      bos_piece="<bos>", unk_piece="<unk>", user_defined_symbols=SPECIALS[4:],
      add_dummy_prefix=False, remove_extra_whitespaces=False, normalization_rule_name="identity",
      split_digits=True, allow_whitespace_only_pieces=True, character_coverage=1.0,
      hard_vocab_limit=False, minloglevel=2)
  with open(os.path.join(directory, "tokenizer.model"), "wb") as f:
    f.write(model.getvalue())
  if template is not None:
    with open(os.path.join(directory, "chat_template.jinja"), "w") as f:
      f.write(template)
  return directory


# A Gemma-like template exercising what transformers' environment provides: a system turn,
# namespace, loop controls, raise_exception, tojson, a {% generation %} block, trim_blocks /
# lstrip_blocks (the indented block tags), a model-specific special token variable.
GEMMA_LIKE_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(users=0) -%}
{%- for message in messages -%}
  {%- if message['role'] not in ['system', 'user', 'assistant'] -%}
    {{ raise_exception('unknown role ' + message['role']) }}
  {%- endif -%}
  {%- if message['role'] == 'user' %}{% set ns.users = ns.users + 1 %}{% endif -%}
  {%- if message.get('skip') %}{% continue %}{% endif %}
<|turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}
{% if message['role'] == 'assistant' %}
{% generation %}{{ message['content'] | trim }}{% endgeneration %}
{% else %}
{{ message['content'] | trim }}{% if message.get('meta') %} {{ message['meta'] | tojson }}{% endif %}
{% endif %}
{{ '<turn|>' }}
{%- endfor %}
{% if add_generation_prompt %}
<|turn>model
{{ sot_token if false else '' }}{% endif %}"""


def write_jsonl(path, records):
  with open(path, "w") as f:
    for r in records:
      f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
  return str(path)


def chat(user, reply, system=None):
  msgs = ([{"role": "system", "content": system}] if system else [])
  return {"messages": msgs + [{"role": "user", "content": user},
                              {"role": "assistant", "content": reply}]}


def make_config(train="", canvas_length=4, **data):
  c = sft_chat.get_config()
  c.model.canvas_length = canvas_length
  c.data.train = train
  c.data.update(data)
  return c



def infill_chat(user, prefix, middle, suffix):
  """A chat record whose reply is prefix + middle + suffix, with its "infill" split
  (scripts/make_chat_task.py --task=infill_count's format)."""
  record = chat(user, prefix + middle + suffix)
  record["infill"] = {"prefix": prefix, "middle": middle, "suffix": suffix}
  return record


def byte_ids(text):
  """The byte tokenizer's ids of `text` by hand (ids 0-4 are its specials, then byte b is
  5 + b): a reference for encoding."""
  return [5 + b for b in text.encode("utf-8")]


def tiny_chat_config(train="", canvas_length=8, num_canvases=2, prompt_len=24, **data):
  """make_config (sft_chat, byte tokenizer) with a tiny model that compiles in seconds, the
  sampler's budget the layout's K canvases and few denoising steps."""
  c = make_config(train, canvas_length, prompt_len=prompt_len, num_canvases=num_canvases,
                  num_threads=0, **data)
  c.model.update(dict(
      hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2, num_kv_heads=1,
      head_dim=8, global_head_dim=8, num_global_kv_heads=1, num_experts=4, top_k_experts=2,
      moe_intermediate_size=8, moe_tile_size=8, layer_types=()))
  c.sampler.update(dict(max_new_tokens=num_canvases * canvas_length, max_denoising_steps=3))
  c.eval.update(dict(every_steps=0, batch_size=4))
  return c


def add_vision_tower(config, soft_tokens=16, patch=8, pooling=2, vision=True):
  """A chat config's model with a tiny vision tower (one layer of width 16; the image
  processor's sizes from it: `patch` px patches pooled `pooling` x `pooling`, `soft_tokens` per
  image; none if not `vision`) and the image token ids of its tokenizer (data.tokenizer)."""
  import ml_collections

  from diffgemma.io import tokenizer as tokenizer_lib

  tok = tokenizer_lib.load_tokenizer(config.data.tokenizer)
  config.model.vocab_size = max(tok.vocab_size, 264)
  if vision:
    config.model.vision = ml_collections.ConfigDict(dict(
        patch_size=patch, pooling_kernel_size=pooling, default_output_length=soft_tokens,
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, position_embedding_size=64))
  if tok.image_token_ids is not None:
    boi, image, eoi = tok.image_token_ids
    config.model.update(boi_token_id=boi, image_token_id=image, eoi_token_id=eoi)
  return config


# ----------------------------------------------------------------------------- many CLI cases


def run_tool_cases(groups, env=None, timeout=600):
  """Run command lines of the entry scripts through `cli.run` in ONE Python process (one JAX
  import for all of them): `groups` is [(tool, sections, [argv, ...])], tool a path such as
  "eval.py" or "scripts/make_sudoku_csv.py", sections its `cli.run` sections. Returns, per
  group, per argv, {"code": exit status, "stderr", "stdout", "traceback": text or "",
  "seconds"}.

  The tool's module is loaded afresh for each command line (the previous one's flags removed),
  so a command line does what `python TOOL ARGV` does (same flags, same `cli.run`), minus the
  interpreter start."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
  code = "from tests.helpers import _tool_cases_main; _tool_cases_main()"
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, input=json.dumps(groups),
                     capture_output=True, text=True, env=env, timeout=timeout)
  assert r.returncode == 0, r.stderr[-5000:]
  return json.loads(r.stdout.splitlines()[-1])


def _tool_cases_main():
  """The process `run_tool_cases` starts: reads the groups from stdin, prints the outcomes."""
  import contextlib
  import time
  import traceback

  from absl import flags

  from diffgemma import cli

  out = sys.stdout
  groups = json.load(sys.stdin)
  baseline = set(flags.FLAGS)
  results = []
  for tool, sections, argvs in groups:
    outcomes = []
    for argv in argvs:
      # A fresh module per command line: config_flags registers the `--config.KEY` overrides
      # it finds in sys.argv when the tool defines --config.
      for name in set(flags.FLAGS) - baseline:
        delattr(flags.FLAGS, name)
      sys.argv = [tool, *argv]
      spec = importlib.util.spec_from_file_location(
          "tool_" + os.path.basename(tool)[:-3], os.path.join(ROOT, tool))
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
      if hasattr(module, "define_flags"):  # scripts that define their flags under __main__
        module.define_flags()
      stderr, stdout = io.StringIO(), io.StringIO()
      outcome = {"code": 0, "traceback": "", "start": time.time()}
      with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
        try:
          cli.run(module.main, [tool, *argv], sections=tuple(sections))
        except SystemExit as e:
          outcome["code"] = e.code
        except BaseException:  # pylint: disable=broad-except
          outcome.update(code=1, traceback=traceback.format_exc())
      outcome.update(stderr=stderr.getvalue(), stdout=stdout.getvalue(),
                     seconds=time.time() - outcome.pop("start"))
      outcomes.append(outcome)
    results.append(outcomes)
  out.write(json.dumps(results) + "\n")
