"""Chat SFT end to end through the command line: a tiny transformers checkpoint (made here, with
its own tokenizer and chat template) fine-tuned on a JSONL file, then evaluated, sampled, and
used as the start of an SD·RL run whose reward is a user function."""

import dataclasses
import json
import os

import jax
import numpy as np

from diffgemma.io import model_dirs
from diffgemma.model import transformer
from diffgemma.model.config import tiny
from diffgemma.runs import checkpointing, provenance
from diffgemma.sampling import sampler
from tests.helpers import GEMMA_LIKE_TEMPLATE, chat, write_jsonl
from tests.helpers import run
from tests.helpers import write_tokenizer_json

STEPS = ["--config.num_train_steps=2", "--config.log_every=1", "--config.checkpoint_every=2",
         "--config.optimizer.warmup_steps=1", "--config.batch_size=4",
         "--config.data.num_threads=0", "--config.eval.every_steps=0"]
SMALL_SAMPLER = ["--config.sampler.max_denoising_steps=3", "--config.data.prompt_len=32",
                 "--config.data.num_canvases=2", "--config.sampler.max_new_tokens=16"]

REWARD_MODULE = '''
def reply_length(prompt, reply, reference):
  """A user reward: 1 for an empty reply, falling with its length."""
  return 1.0 / (1.0 + len(reply))
'''


def tiny_hf_checkpoint(directory):
  """A transformers DiffusionGemma directory whose vocabulary is its tokenizer's."""
  cfg = tiny(vocab_size=64, canvas_length=8, num_layers=2, layer_types=())
  params = transformer.init_params(cfg, jax.random.PRNGKey(0))
  model_dirs.save_hf(cfg, params, str(directory))
  write_tokenizer_json(directory, vocab_size=64, template=GEMMA_LIKE_TEMPLATE)
  return str(directory)


def test_fine_tune_a_transformers_checkpoint_on_chat_jsonl_then_eval_and_sdrl(tmp_path):
  ckpt = tiny_hf_checkpoint(tmp_path / "ckpt")
  data = write_jsonl(tmp_path / "train.jsonl",
                     [chat("hello world", "the lazy dog"), chat("how are you?", "the quick fox")] * 4)
  workdir = str(tmp_path / "run")
  r = run("train.py", "--config=sft_chat", f"--workdir={workdir}", f"--init_from={ckpt}",
          f"--config.data.train={data}", "--config.data.tokenizer=", *STEPS, *SMALL_SAMPLER)
  assert r.returncode == 0, r.stderr[-3000:]
  saved = checkpointing.load_config(workdir)
  assert saved.model.vocab_size == 64 and saved.model.canvas_length == 8  # the checkpoint's
  assert saved.init_from == ckpt and checkpointing.latest_step(workdir) == 2
  # sft_chat packs: 2 steps of 4 rows saw more than 8 examples, and counted their tokens.
  (invocation,) = provenance.load_run_info(workdir)["invocations"]
  assert invocation["examples_seen"] > 8 and invocation["real_tokens_seen"] > 0
  assert invocation["train_seconds"] > 0

  r = run("eval.py", f"--workdir={workdir}", f"--data={data}", "--limit=3")
  assert r.returncode == 0, r.stderr[-3000:]
  metrics = json.loads(r.stdout.strip().splitlines()[-1])
  for key in ("accuracy", "num_examples", "tokens_per_forward", "steps_per_canvas",
              "canvases_per_reply", "tokens_per_second"):
    assert np.isfinite(metrics[key]), key
  assert metrics["num_examples"] == 3
  with open(metrics["predictions"]) as f:
    records = [json.loads(line) for line in f]
  assert [r_["reference"] for r_ in records] == ["the lazy dog", "the quick fox", "the lazy dog"]
  assert metrics["headline_metric"] == "accuracy" and metrics["sampler_overrides"] == {}

  # Any sampler key from the command line: one denoising step per canvas accepts the whole
  # canvas at once, so TPF is the canvas length (8) and steps per canvas exactly 1.
  r = run("eval.py", f"--workdir={workdir}", f"--data={data}", "--limit=3",
          "--sampler.max_denoising_steps=1", "--sampler.stability_threshold=0")
  assert r.returncode == 0, r.stderr[-3000:]
  one_step = json.loads(r.stdout.strip().splitlines()[-1])
  assert one_step["sampler_overrides"] == {"max_denoising_steps": 1, "stability_threshold": 0}
  assert one_step["steps_per_canvas"] == 1.0
  assert one_step["tokens_per_forward"] >= metrics["tokens_per_forward"]
  r = run("eval.py", f"--workdir={workdir}", f"--data={data}", "--sampler.entropy=1")
  assert r.returncode == 2 and r.stderr.strip().splitlines() == [
      "error: unknown sampler key 'entropy'; choose one of "
      f"{tuple(f.name for f in dataclasses.fields(sampler.SamplerConfig))}"], r.stderr

  # SD·RL from the SFT workdir: its tokenizer is found through the run's init_from; the reward
  # is a function the user names in the config.
  with open(tmp_path / "my_reward.py", "w") as f:
    f.write(REWARD_MODULE)
  sdrl_dir = str(tmp_path / "sdrl")
  r = run("train.py", "--config=sdrl_chat", f"--workdir={sdrl_dir}", f"--init_from={workdir}",
          f"--config.data.train={data}", "--config.data.tokenizer=",
          "--config.rl.reward_fn=my_reward:reply_length", "--config.sdrl.group_size=2",
          "--config.sdrl.prompts_per_rollout=2", *STEPS, *SMALL_SAMPLER,
          "--config.sdrl.rollout_sampler.max_denoising_steps=3",
          "--config.sdrl.rollout_sampler.max_new_tokens=16",
          env={"PYTHONPATH": str(tmp_path)})
  assert r.returncode == 0, r.stderr[-3000:]
  assert checkpointing.latest_step(sdrl_dir) == 2
