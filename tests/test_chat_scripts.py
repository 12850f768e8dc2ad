"""The chat data scripts on small files the tests write: make_chat_task's exact formats, the
GSM8K and PubMedQA converters, and show_examples (text, --json, one-line errors). The scripts'
functions run in this process; one command line each checks the wiring."""

import json
import re

import pytest

from diffgemma import cli
from tests.helpers import one_line_error, run
from tests.helpers import load_script




def read_jsonl(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def messages_of(record):
  (user, assistant) = record["messages"]
  assert user["role"] == "user" and assistant["role"] == "assistant"
  return user["content"], assistant["content"]


def test_make_chat_task_count_and_sort(tmp_path):
  r = run("scripts/make_chat_task.py", "--task=count", "--num=200", "--seed=3",
          f"--out={tmp_path / 'count.jsonl'}")
  assert r.returncode == 0, r.stderr
  assert r.stdout == f"wrote 200 count conversations to {tmp_path / 'count.jsonl'}\n"
  script = load_script("make_chat_task")
  starts, spans = set(), set()
  for record in read_jsonl(tmp_path / "count.jsonl"):
    user, reply = messages_of(record)
    a, b = map(int, re.fullmatch(r"Count from (\d+) to (\d+)\.", user).groups())
    assert reply == " ".join(str(n) for n in range(a, b + 1))
    assert 1 <= a <= 500 and 10 <= b - a <= 40
    starts.add(a)
    spans.add(b - a)
  assert len(starts) > 100 and spans == set(range(10, 41))  # uniform draws cover the ranges

  script.write_task("sort", 200, 3, str(tmp_path / "sort.jsonl"))
  lengths = set()
  for record in read_jsonl(tmp_path / "sort.jsonl"):
    user, reply = messages_of(record)
    letters = re.fullmatch(r"Sort the letters: ([a-z]+)", user).group(1)
    assert reply == "".join(sorted(letters))
    lengths.add(len(letters))
  assert min(lengths) == 20 and max(lengths) == 60

  # The same seed writes the same file; another seed another.
  script.write_task("sort", 200, 3, str(tmp_path / "again.jsonl"))
  script.write_task("sort", 200, 4, str(tmp_path / "other.jsonl"))
  assert read_jsonl(tmp_path / "again.jsonl") == read_jsonl(tmp_path / "sort.jsonl")
  assert read_jsonl(tmp_path / "other.jsonl") != read_jsonl(tmp_path / "sort.jsonl")
  with pytest.raises(cli.UserError, match="--num"):
    script.write_task("count", 0, 0, str(tmp_path / "x.jsonl"))


GSM8K = [{"question": "Tom has 3 apples and buys 4. How many? ",
          "answer": "He has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
         {"question": "What is 10 times 12?", "answer": "10 * 12 = <<10*12=120>>120\n#### 120"},
         {"question": "Half of 1,000?", "answer": "1,000 / 2 = 500\n#### 500"}]


def write_lines(path, records):
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  return path


def test_convert_gsm8k(tmp_path):
  train = write_lines(tmp_path / "train.jsonl", GSM8K)
  test = write_lines(tmp_path / "test.jsonl", GSM8K[:1])
  script = load_script("convert_gsm8k")
  assert script.convert(str(train), str(tmp_path / "out"), str(test)) == (3, 1)
  out = read_jsonl(tmp_path / "out" / "train.jsonl")
  assert [messages_of(o) for o in out] == [
      ("Tom has 3 apples and buys 4. How many?", "He has 3 + 4 = 7 apples.\n#### 7"),
      ("What is 10 times 12?", "10 * 12 = 120\n#### 120"),
      ("Half of 1,000?", "1,000 / 2 = 500\n#### 500")]
  assert [messages_of(o) for o in read_jsonl(tmp_path / "out" / "test.jsonl")] == [
      messages_of(out[0])]
  # No --test: a seeded split of --train, the input order kept, calculator kept on request.
  assert script.convert(str(train), str(tmp_path / "split"), test_size=1,
                        keep_calculator=True) == (2, 1)
  kept, held = (read_jsonl(tmp_path / "split" / f"{n}.jsonl") for n in ("train", "test"))
  assert len(kept) == 2 and len(held) == 1
  replies = [messages_of(o)[1] for o in kept + held]
  assert sorted(replies) == sorted(g["answer"] for g in GSM8K)
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(GSM8K[0]) + "\n" + json.dumps({"question": "q", "answer": "7"}) + "\n")
  with pytest.raises(cli.UserError, match=re.escape(f"{bad}:2: the \"answer\" has no final")):
    script.convert(str(bad), str(tmp_path / "none"))
  assert not (tmp_path / "none").exists()


PUBMEDQA = {
    "101": {"QUESTION": "Does aspirin help?", "CONTEXTS": ["Aspirin was given.", "Pain fell."],
            "LONG_ANSWER": "Aspirin reduced pain.", "final_decision": "yes"},
    "102": {"QUESTION": "Is X linked to Y?", "CONTEXTS": ["No link was found."],
            "LONG_ANSWER": "No association.", "final_decision": "no"},
    "103": {"question": "Unclear?", "contexts": ["Mixed results."],
            "long_answer": "Evidence is mixed.", "final_decision": "Maybe"},
}


def test_convert_pubmedqa(tmp_path):
  data = tmp_path / "ori_pqal.json"
  data.write_text(json.dumps(PUBMEDQA))
  ids = tmp_path / "test_ground_truth.json"
  ids.write_text(json.dumps({"102": "no"}))
  r = run("scripts/convert_pubmedqa.py", f"--input={data}", f"--test_ids={ids}",
          f"--out_dir={tmp_path / 'out'}")
  assert r.returncode == 0, r.stderr
  script = load_script("convert_pubmedqa")
  train = [messages_of(o) for o in read_jsonl(tmp_path / "out" / "train.jsonl")]
  test = [messages_of(o) for o in read_jsonl(tmp_path / "out" / "test.jsonl")]
  instruction = ('Answer with a short explanation, then end with "The answer is yes.", '
                 '"The answer is no." or "The answer is maybe."')
  assert train == [
      ("Context:\nAspirin was given.\nPain fell.\n\nQuestion: Does aspirin help?\n\n" +
       instruction, "Aspirin reduced pain. The answer is yes."),
      ("Context:\nMixed results.\n\nQuestion: Unclear?\n\n" + instruction,
       "Evidence is mixed. The answer is maybe.")]
  assert test == [("Context:\nNo link was found.\n\nQuestion: Is X linked to Y?\n\n" +
                   instruction, "No association. The answer is no.")]
  assert script.convert(str(data), str(tmp_path / "split"), test_size=2) == (1, 2)
  assert len(read_jsonl(tmp_path / "split" / "test.jsonl")) == 2
  data.write_text(json.dumps({**PUBMEDQA, "104": {**PUBMEDQA["101"],
                                                  "final_decision": "perhaps"}}))
  with pytest.raises(cli.UserError, match="entry '104' has final_decision 'perhaps'"):
    script.convert(str(data), str(tmp_path / "none"), test_size=1)
  assert not (tmp_path / "none").exists()


def test_show_examples(tmp_path):
  data = write_lines(tmp_path / "d.jsonl", [
      {"messages": [{"role": "user", "content": "Count from 1 to 3."},
                    {"role": "assistant", "content": "1 2 3"}]},
      {"prompt": "hi", "completion": "x" * 40}])
  r = run("scripts/show_examples.py", "--config=sft_chat", f"--data={data}", "--json")
  assert r.returncode == 0, r.stderr
  rows = [json.loads(line) for line in r.stdout.splitlines()]
  turn = lambda s: [3] + [5 + b for b in s.encode()]  # <|turn> then bytes
  prompt = ([2] + turn("user\nCount from 1 to 3.") + [4] + [5 + ord("\n")] + turn("model\n"))
  assert rows[0] == {"prompt_ids": prompt, "target_ids": [5 + b for b in b"1 2 3"] + [4] +
                     [1] * 26, "num_canvases": 1, "images": []}
  assert rows[1]["target_ids"] == [5 + ord("x")] * 40 + [4] + [1] * 23
  assert rows[1]["num_canvases"] == 2
  r = run("scripts/show_examples.py", "--config=sft_chat", f"--data={data}", "--num=1")
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith(f"=== example 1 ({data}:1): 34 of 48 prompt slots, 1 of 6 "
                             "canvases of 32 ===\n")
  assert ("--- prompt ---\n<bos><|turn>user\nCount from 1 to 3.<turn|>\n<|turn>model\n\n"
          "--- target ---\n1 2 3<turn|>\n[then 26 x <eos> to the end of canvas 1]\n") in r.stdout
  bad = tmp_path / "bad.jsonl"
  bad.write_text(data.read_text() + '{"messages": [{"role": "user", "content": "hi"}]}\n')
  one_line_error(run("scripts/show_examples.py", "--config=sft_chat", f"--data={bad}"),
                 f"{bad}:3", "no assistant turn")
