"""benchmarks/ar_baseline.py: the examples are diffgemma's byte-identical ids, the loss mask is
exactly the reply and its end-of-turn, cached batched greedy decoding equals a plain loop, and a
tiny run learns a constant reply, with the JSON's keys, curve and seen / unseen split. One
command line each checks --help and a one-line error."""

import json

import numpy as np
import torch

from benchmarks import ar_baseline as ab
from tests.helpers import byte_ids, chat, one_line_error, run, write_jsonl

BOS, SOT, EOT, PAD = 2, 3, 4, 0


def turn(role, text):
  return [SOT] + byte_ids(f"{role}\n{text}") + [EOT] + byte_ids("\n")


def test_examples_are_the_chat_tasks_ids(tmp_path):
  path = write_jsonl(tmp_path / "train.jsonl", [
      {"messages": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "yo "},  # stripped in the target
                    {"role": "user", "content": "again"},
                    {"role": "assistant", "content": "ok"}]},
      {"prompt": "x", "completion": "y"}])
  examples, user_texts, tok = ab.training_examples(path)
  opening = [SOT] + byte_ids("model\n")
  first = [BOS] + turn("system", "Be brief.") + turn("user", "hi")
  expected = {
      (tuple(first + opening), tuple(byte_ids("yo") + [EOT])),
      (tuple(first + turn("model", "yo") + turn("user", "again") + opening),
       tuple(byte_ids("ok") + [EOT])),
      (tuple([BOS] + turn("user", "x") + opening), tuple(byte_ids("y") + [EOT])),
  }
  assert set(examples) == expected and len(examples) == 3
  assert user_texts == {"hi", "again", "x"}
  assert tok.vocab_size == 261 and tok.eot_id == EOT


def test_loss_mask_is_the_reply_and_end_of_turn():
  long = ((BOS, 10, 11, 12), (20, 21, EOT))  # prompt 4 ids, reply 2 + end-of-turn
  short = ((BOS, 13), (22, EOT))
  batch = ab.make_batch([long, short], PAD)
  assert batch["inputs"].tolist() == [[BOS, 10, 11, 12, 20, 21], [BOS, 13, 22, PAD, PAD, PAD]]
  assert batch["loss_mask"].tolist() == [[False, False, False, True, True, True],
                                         [False, True, True, False, False, False]]
  # The supervised labels are exactly each target; everything else is ignored.
  labels = batch["labels"]
  assert labels[0][batch["loss_mask"][0]].tolist() == [20, 21, EOT]
  assert labels[1][batch["loss_mask"][1]].tolist() == [22, EOT]
  assert (labels[~batch["loss_mask"]] == -100).all()


def test_learning_rate_schedule():
  assert ab.lr_at(0, 1.0, 10, 100) == 0.1 and ab.lr_at(9, 1.0, 10, 100) == 1.0
  assert ab.lr_at(10, 1.0, 10, 100) == 1.0
  assert abs(ab.lr_at(100, 1.0, 10, 100) - 0.1) < 1e-12
  assert abs(ab.lr_at(500, 1.0, 10, 100) - 0.1) < 1e-12  # held at 10% past the end
  assert ab.lr_at(50, 1.0, 10, None) == 1.0  # before the estimate


def test_batched_cached_greedy_equals_a_plain_loop():
  with torch.random.fork_rng():
    torch.manual_seed(0)
    model = ab.GPT(261, 32, 16, 2, 2)
  prompts = [[BOS, 7, 8, 9, 10], [BOS, 11], [BOS, 12, 13]]
  width = max(map(len, prompts)) + 2  # a column of padding for every row
  rows = np.zeros((len(prompts), width), np.int64)
  valid = np.zeros((len(prompts), width), bool)
  for i, p in enumerate(prompts):
    rows[i, width - len(p):], valid[i, width - len(p):] = p, True
  stops = (1, EOT)
  got = ab.greedy(model, rows, valid, 6, stops, PAD, batch_size=2)
  for i, p in enumerate(prompts):
    seq, want = list(p), []
    with torch.no_grad():
      for _ in range(6):
        nxt = int(model(torch.tensor([seq]))[0][0, -1].argmax())
        want.append(nxt)
        seq.append(nxt)
        if nxt in stops:
          break
    assert got[i].tolist() == want + [PAD] * (6 - len(want))


def constant_task(tmp_path):
  train_users = [f"word {i}" for i in range(40)]
  test_users = train_users[:3] + ["word 7 "] + [f"new {i}" for i in range(4)]  # 3 seen
  train = write_jsonl(tmp_path / "train.jsonl", [chat(u, "yes") for u in train_users])
  test = write_jsonl(tmp_path / "test.jsonl", [chat(u, " yes") for u in test_users])
  return train, test, train_users, test_users


def test_a_tiny_run_learns_a_constant_reply(tmp_path):
  train, test, train_users, test_users = constant_task(tmp_path)
  out = tmp_path / "result.json"
  result = ab.run_benchmark(ab.Options(
      train=train, test=test, minutes=1, max_steps=150, layers=1, width=32, heads=2,
      batch_size=16, warmup=20, eval_every_minutes=0.002, curve_examples=5, out=str(out)))
  for key in ("accuracy", "exact", "num_examples", "headline_metric", "stopped", "train_steps",
              "examples_seen", "train_minutes", "steps_per_second", "params",
              "seen_prompt_accuracy", "unseen_prompt_accuracy", "num_seen_prompt",
              "num_unseen_prompt", "curve", "device"):
    assert key in result, key
  assert result["headline_metric"] == "accuracy" and result["exact"] == result["accuracy"]
  assert result["exact"] == 1.0 and result["stopped"] == 1.0
  assert result["train_steps"] == 150 and result["examples_seen"] == 150 * 16
  assert result["num_examples"] == len(test_users)
  seen = sum(u in set(train_users) for u in test_users)  # exactly the same text
  assert (result["num_seen_prompt"], result["num_unseen_prompt"]) == (seen, len(test_users) - seen)
  assert seen == 3 and result["seen_prompt_accuracy"] == result["unseen_prompt_accuracy"] == 1.0
  assert result["device"]["torch_threads"] == 1
  # The curve: points in training time (evaluation not counted), the last one at the end.
  curve = result["curve"]
  assert len(curve) >= 2
  assert [p["step"] for p in curve] == sorted(p["step"] for p in curve)
  assert curve[-1]["step"] == 150 and curve[-1]["exact"] == 1.0
  assert curve[-1]["minutes"] <= result["train_minutes"] + 1e-3
  assert all(p["examples_seen"] == p["step"] * 16 for p in curve)
  saved = json.loads(out.read_text())
  assert [p["seen_prompt"] for p in saved["predictions"]] == [u in train_users
                                                              for u in test_users]
  assert all(p["reply"] == "yes" and p["correct"] for p in saved["predictions"])


def test_command_line(tmp_path):
  r = run("benchmarks/ar_baseline.py", "--help")
  assert "--eval_every_minutes" in r.stdout and "independent peer" in r.stdout, r.stderr
  train, _, _, _ = constant_task(tmp_path)
  r = run("benchmarks/ar_baseline.py", f"--train={train}", f"--test={tmp_path / 'none.jsonl'}")
  one_line_error(r, "none.jsonl", "not found")
