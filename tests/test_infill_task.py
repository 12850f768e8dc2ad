"""The infill_count chat task: make_chat_task's records (a brute-force check of every line), the
chat task's infill metric against hand-made fills, and an untrained tiny chat run evaluated on
infill data through the evaluation API (the given prefix and suffix come back unchanged; the
metric is a brute-force recount of the generated middles)."""

import json
import re

import jax
import numpy as np
import pytest

from diffgemma.model.config import ModelConfig
from diffgemma.sampling import sampler
from diffgemma.training import evaluation
from diffgemma.tasks import chat, chat_data
from tests.helpers import (byte_ids, infill_chat, load_script, save_sft_run, tiny_chat_config,
                           write_jsonl)

script = load_script("make_chat_task")


def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_infill_count_records(tmp_path):
  script.write_task("infill_count", 400, 5, str(tmp_path / "a.jsonl"))
  records = read_jsonl(tmp_path / "a.jsonl")
  gaps, lengths, empty_prefix = set(), set(), 0
  for record in records:
    (user, assistant), infill = record["messages"], record["infill"]
    assert user == {"role": "user", "content": "Count up by one."}
    reply = assistant["content"]
    assert assistant["role"] == "assistant" and sorted(infill) == ["middle", "prefix", "suffix"]
    numbers = [int(n) for n in reply.split(" ")]
    a = numbers[0]
    assert 1 <= a <= 500 and numbers == list(range(a, a + len(numbers)))
    assert reply == " ".join(map(str, numbers)) and 5 <= len(numbers) <= 8
    assert len(reply.encode()) + 1 <= 32  # with its end of turn, one 32-byte canvas
    # The split, recounted: prefix + middle + suffix is the reply; the gap is 1..3 whole
    # numbers with at least one after it.
    assert infill["prefix"] + infill["middle"] + infill["suffix"] == reply
    before = infill["prefix"].split()
    gap = infill["middle"].split()
    after = infill["suffix"].split()
    assert [int(n) for n in before + gap + after] == numbers
    assert 1 <= len(gap) <= 3 and after
    assert infill["middle"] == " ".join(gap) + " "
    assert infill["prefix"] == "".join(n + " " for n in before)
    gaps.add(len(gap))
    lengths.add(len(numbers))
    empty_prefix += not before
  assert gaps == {1, 2, 3} and lengths == {5, 6, 7, 8} and 0 < empty_prefix < len(records)
  # Deterministic by seed; another seed another set. The chat reader accepts every line.
  script.write_task("infill_count", 400, 5, str(tmp_path / "again.jsonl"))
  script.write_task("infill_count", 400, 6, str(tmp_path / "other.jsonl"))
  assert read_jsonl(tmp_path / "again.jsonl") == records
  assert read_jsonl(tmp_path / "other.jsonl") != records
  conversations = chat_data.read_jsonl(str(tmp_path / "a.jsonl"))
  assert [c.infill for c in conversations] == [
      tuple(r["infill"][k] for k in ("prefix", "middle", "suffix")) for r in records]


@pytest.mark.parametrize("infill, needle", [
    ({"prefix": "1 ", "middle": "2 ", "suffix": "4"}, "is not the last assistant turn"),
    ({"prefix": "1 2 ", "middle": "3", "suffix": ""}, "non-empty middle and suffix"),
    ({"prefix": "1 ", "middle": "2 "}, "exactly ['prefix', 'middle', 'suffix']"),
    ({"prefix": 1, "middle": "2 ", "suffix": "3"}, "must be strings")])
def test_bad_infill_lines_name_file_and_line(tmp_path, infill, needle):
  good = infill_chat("Count up by one.", "1 ", "2 ", "3")
  bad = {"messages": good["messages"], "infill": infill}
  path = write_jsonl(tmp_path / "d.jsonl", [good, bad])
  with pytest.raises(chat_data.ChatDataError, match=re.escape(f"{path}:2: ")) as e:
    chat_data.read_jsonl(path)
  assert needle in str(e.value)


def infill_task(canvas_length=16, num_canvases=1):
  config = tiny_chat_config(canvas_length=canvas_length, num_canvases=num_canvases,
                            prompt_len=40)
  return chat.from_config(config, training=False)


def test_infill_metric_on_hand_made_fills(tmp_path):
  task = infill_task()
  path = write_jsonl(tmp_path / "d.jsonl", [
      infill_chat("Count up by one.", "7 8 ", "9 10 ", "11"),
      infill_chat("Count up by one.", "", "41 ", "42 43"),
      infill_chat("Count up by one.", "98 ", "99 ", "100 101")])
  prompts = task.load_eval_file(path)
  assert task.headline_metric_for(prompts) == "infill_accuracy"
  # The slots, by hand: prefix bytes from slot 0, the middle's byte count of free slots, then
  # the suffix bytes; the rest free.
  for row, (prefix, middle, suffix) in enumerate([("7 8 ", "9 10 ", "11"), ("", "41 ", "42 43"),
                                                  ("98 ", "99 ", "100 101")]):
    fixed, mask = prompts.fixed_NxL[row], prompts.fixed_mask_NxL[row]
    end = len(prefix) + len(middle) + len(suffix)
    np.testing.assert_array_equal(mask, [i < len(prefix) or len(prefix) + len(middle) <= i < end
                                         for i in range(16)])
    assert fixed[mask].tolist() == byte_ids(prefix + suffix)
  eot, eos, pad = task.tokenizer.eot_id, task.tokenizer.eos_id, task.tokenizer.pad_id
  ids = byte_ids
  fill = lambda text, middle_tail: (ids(text) + middle_tail + [eos] * 16)[:16]
  tokens = np.array([
      fill("7 8 9 10 11", [eot]),                    # the right middle, then the end of turn
      fill("42 42 43", [eot]),                       # a wrong middle ("42 " for "41 ")
      ids("98 ") + [eot, 5 + ord("9"), 5 + ord(" ")] + ids("100 101") + [eot, pad, pad],
  ], np.int32)                                       # a stop id in the middle: wrong, no cut
  metrics, records = task.score(prompts, tokens, {})
  assert metrics["infill_accuracy"] == pytest.approx(1 / 3)
  assert [r["infill_correct"] for r in records] == [True, False, False]
  assert [r["middle"] for r in records] == ["9 10 ", "42 ", "<turn|>9 "]
  # The whole reply (given parts included) is what `accuracy` judges; a stop in the middle
  # does not cut the suffix off, and the reply stops after it.
  assert [r["reply"] for r in records] == ["7 8 9 10 11", "42 42 43", "98 9 100 101"]
  assert [r["correct"] for r in records] == [True, False, False]
  assert metrics["accuracy"] == pytest.approx(1 / 3) and metrics["stopped"] == 1.0


def test_infill_data_needs_its_slots_and_diffusion(tmp_path):
  task = infill_task()
  path = write_jsonl(tmp_path / "d.jsonl", [infill_chat("Count up by one.", "1 ", "2 ", "3")])
  prompts = task.load_eval_file(path)
  model_cfg = ModelConfig(**tiny_chat_config(canvas_length=16).model.to_dict())
  ok = sampler.SamplerConfig(max_new_tokens=task.layout.response_len)
  evaluation.check_prompts(prompts, model_cfg, ok)
  with pytest.raises(ValueError, match="laid out over 16 reply slots but sampler.max_new_tok"):
    evaluation.check_prompts(prompts, model_cfg, ok.replace(max_new_tokens=32))
  with pytest.raises(ValueError, match="infill data needs sampler.mode='diffusion'"):
    evaluation.check_prompts(prompts, model_cfg, ok.replace(mode="ar"))
  mixed = write_jsonl(tmp_path / "m.jsonl", [infill_chat("a", "1 ", "2 ", "3"),
                                             {"messages": [{"role": "user", "content": "b"},
                                                           {"role": "assistant", "content": "c"}]}])
  with pytest.raises(chat_data.ChatDataError, match="all infill records or none"):
    task.load_eval_file(mixed)
  too_long = write_jsonl(tmp_path / "l.jsonl", [infill_chat("a", "1 2 3 4 ", "5 6 ", "7 8 9")])
  with pytest.raises(chat_data.ChatDataError, match=re.escape(f"{too_long}:1: prefix (8)")):
    task.load_eval_file(too_long)


def test_untrained_run_on_infill_data_keeps_the_given_tokens(tmp_path):
  from diffgemma.training import loaded

  data = str(tmp_path / "infill.jsonl")
  script.write_task("infill_count", 6, 3, data)
  workdir = str(tmp_path / "run")
  save_sft_run(tiny_chat_config(canvas_length=32, num_canvases=1, prompt_len=40), workdir)
  run = loaded.open_run(workdir)
  prompts = run.task.load_eval_file(data)
  run.load()
  generate = sampler.make_generate_fn(run.model_cfg, run.sampler_cfg)
  outs = []

  def recording(*args):  # the production generate, its outputs kept
    out = jax.tree_util.tree_map(np.asarray, generate(*args))
    outs.append((args[4], out.tokens, out.num_tokens))
    return out

  metrics, predictions = evaluation.evaluate(run.task, run.params, run.model_cfg,
                                             run.sampler_cfg, prompts, 4, seed=0,
                                             generate_fn=recording)
  assert len(outs) == 2 and all(out[0] is not None for out in outs)  # 4 rows, then 2 + pad
  tokens = np.concatenate([outs[0][1], outs[1][1][:2]])
  mask = prompts.fixed_mask_NxL
  np.testing.assert_array_equal(tokens[mask], prompts.fixed_NxL[mask])  # prefix, suffix intact
  # TPF counts the generated tokens only: the non-pad slots that were not given.
  np.testing.assert_array_equal(np.concatenate([outs[0][2], outs[1][2][:2]]),
                                ((tokens != run.task.tokenizer.pad_id) & ~mask).sum(1))
  # The metric, recounted by hand: the free slots before the last fixed one hold the
  # reference middle's bytes.
  records = read_jsonl(data)
  right = []
  for row, record in enumerate(records):
    last = np.flatnonzero(mask[row])[-1]
    middle = tokens[row, :last][~mask[row, :last]].tolist()
    assert len(middle) == len(record["infill"]["middle"])
    right.append(middle == byte_ids(record["infill"]["middle"]))
  assert metrics["infill_accuracy"] == np.mean(right)
  assert [p["infill_correct"] for p in predictions] == right
  assert metrics["num_examples"] == 6 and np.isfinite(metrics["tokens_per_forward"])
  assert run.task.headline_metric_for(prompts) == "infill_accuracy"
