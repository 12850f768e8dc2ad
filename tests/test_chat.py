"""The chat task: template rendering against transformers, the byte tokenizer, JSONL readers, the
canvas layout and overflow policies, the grain pipeline, metrics, rewards and bad input. The task
is built through the registry (`make_task`), as the trainer builds it.

Tokenizers are built by the tests (a Gemma-like BPE tokenizer.json, a tiny SentencePiece model,
the byte tokenizer); data files are written by the tests.
"""

import json
import re

import numpy as np
import pytest
from transformers import AutoTokenizer, GemmaTokenizer
from transformers.utils import chat_template_utils

from diffgemma.io import chat_template
from diffgemma.io import tokenizer as tokenizer_lib
from diffgemma.tasks import make_task, text_metrics
from tests.helpers import write_sentencepiece, write_tokenizer_json
from tests.helpers import GEMMA_LIKE_TEMPLATE, write_jsonl, chat, make_config


CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": " hello world "}],
    "system turn": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "how are you?"}],
    "multi-turn": [{"role": "system", "content": "the lazy dog"},
                   {"role": "user", "content": "hello"},
                   {"role": "assistant", "content": "the quick brown fox"},
                   {"role": "user", "content": "a block diffusion model"}],
}


@pytest.mark.parametrize("tokenizer_class", ["GemmaTokenizer", "PreTrainedTokenizerFast"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_render_matches_apply_chat_template(tmp_path, case, add_generation_prompt,
                                            tokenizer_class):
  d = write_tokenizer_json(tmp_path, template=GEMMA_LIKE_TEMPLATE,
                           config_extra={"sot_token": "<|turn>",
                                         "tokenizer_class": tokenizer_class})
  ours = tokenizer_lib.load_tokenizer(d)
  ref = AutoTokenizer.from_pretrained(d)
  messages = CONVERSATIONS[case]
  expected = ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                     tokenize=True, return_dict=False)
  assert ours.render(messages, add_generation_prompt) == list(expected)
  text = ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                 tokenize=False)
  assert ours.render_text(messages, add_generation_prompt) == text
  assert text.startswith("<bos>") and ours.render(messages)[0] == ours.bos_id


def test_render_text_tojson_matches(tmp_path):
  """Text only: the tojson output's characters are outside the test tokenizer's alphabet (its
  unknown-token handling differs from transformers' rebuilt Gemma tokenizer, not the template)."""
  d = write_tokenizer_json(tmp_path, template=GEMMA_LIKE_TEMPLATE)
  messages = CONVERSATIONS["multi-turn"][:-1] + [
      {"role": "user", "content": "hi", "meta": {"é": [1, "<b>"]}, "skip": None}]
  text = AutoTokenizer.from_pretrained(d).apply_chat_template(
      messages, add_generation_prompt=True, tokenize=False)
  assert tokenizer_lib.load_tokenizer(d).render_text(messages, True) == text
  assert '{"é": [1, "<b>"]}' in text


def test_render_sentencepiece_matches(tmp_path):
  """SentencePiece does not parse control pieces such as <bos> out of text; render does, as
  transformers' converted tokenizer."""
  d = write_sentencepiece(tmp_path, template=GEMMA_LIKE_TEMPLATE)
  ours, ref = tokenizer_lib.load_tokenizer(d), GemmaTokenizer.from_pretrained(d)
  messages = CONVERSATIONS["multi-turn"]
  expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
  assert ours.render(messages, True) == list(expected)


def test_template_errors_are_one_line(tmp_path):
  d = write_tokenizer_json(tmp_path, template=GEMMA_LIKE_TEMPLATE)
  tok = tokenizer_lib.load_tokenizer(d)
  with pytest.raises(tokenizer_lib.TokenizerError, match="unknown role tool") as e:
    tok.render([{"role": "tool", "content": "x"}])
  assert "\n" not in str(e.value)
  with pytest.raises(chat_template.ChatTemplateError, match="does not compile"):
    chat_template.render("{% for %}", [{"role": "user", "content": "x"}], {})
  # Python errors of the template's expressions were tracebacks.
  for template, error in (("{{ 1 / 0 }}", "ZeroDivisionError"), ("{{ 'a' + 1 }}", "TypeError")):
    with pytest.raises(chat_template.ChatTemplateError, match=f"chat template: {error}"):
      chat_template.render(template, [{"role": "user", "content": "x"}], {})
  # A loop control outside a loop passed jinja's parser and failed Python's compile.
  with pytest.raises(chat_template.ChatTemplateError, match="does not compile: 'break' outside"):
    chat_template.render("{% break %}", [{"role": "user", "content": "x"}], {})


def test_bytes_tokenizer():
  tok = tokenizer_lib.load_tokenizer("bytes")
  assert (tok.pad_id, tok.eos_id, tok.bos_id, tok.eot_id) == (0, 1, 2, 4)
  assert tok.token_to_id("<|turn>") == 3 and tok.vocab_size == 5 + 256
  assert tok.stop_ids == (1, 4)
  text = "héllo <|turn>x"
  ids = tok.encode(text)
  assert ids == [5 + b for b in "héllo ".encode()] + [3, 5 + ord("x")]
  assert tok.decode(ids, skip_special_tokens=False) == text
  assert tok.decode(ids) == "héllo x"
  # Its template, rendered by transformers' own function, gives the same text.
  messages = CONVERSATIONS["multi-turn"]
  expected, _ = chat_template_utils.render_jinja_template(
      [messages], chat_template=tokenizer_lib.BYTES_CHAT_TEMPLATE, add_generation_prompt=True,
      bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
  assert tok.render_text(messages, True) == expected[0]
  assert expected[0] == ("<bos><|turn>system\nthe lazy dog<turn|>\n<|turn>user\nhello<turn|>\n"
                         "<|turn>model\nthe quick brown fox<turn|>\n<|turn>user\na block "
                         "diffusion model<turn|>\n<|turn>model\n")
  assert tok.render(messages, True) == [2] + tok.encode(expected[0][len("<bos>"):])
  assert tok.chat_prompt("hi") == tok.render([{"role": "user", "content": "hi"}], True)


# ----------------------------------------------------------------------------- the task








# Byte-template overhead of one user turn: <bos><|turn>user\n ... <turn|>\n<|turn>model\n
OVERHEAD = 1 + 1 + 5 + 1 + 1 + 1 + 6


def test_layout_eos_fill_and_padding_canvases(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [chat("hi", "abcde"), chat("yo", "abc")])
  task = make_task(make_config(path, prompt_len=20, num_canvases=3))
  tok = task.tokenizer
  seqs = [task.layout_example(e) for e in task.train_examples(0, 2)]
  seqs = {tok.decode(s["tokens"][20:], skip_special_tokens=True): s for s in seqs}
  p = 20
  # "abcde" + <turn|> = 6 ids: canvases 1 and 2, EOS in the last 2 slots; canvas 3 is padding.
  s = seqs["abcde"]
  prompt = tok.render([{"role": "user", "content": "hi"}], True)
  assert len(prompt) == OVERHEAD + 2
  np.testing.assert_array_equal(s["tokens"][:p], [0] * (p - len(prompt)) + prompt)
  np.testing.assert_array_equal(s["valid"][:p], np.arange(p) >= p - len(prompt))
  np.testing.assert_array_equal(s["tokens"][p:], tok.encode("abcde") + [4, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(s["valid"][p:], [True] * 8 + [False] * 4)
  np.testing.assert_array_equal(s["loss_mask"], [False] * p + [True] * 8 + [False] * 4)
  # "abc" + <turn|> fills canvas 1 exactly: no EOS at all.
  s = seqs["abc"]
  np.testing.assert_array_equal(s["tokens"][p:], tok.encode("abc") + [4] + [0] * 8)
  np.testing.assert_array_equal(s["loss_mask"][p:], [True] * 4 + [False] * 8)
  assert task.layout.seq_len == p + 12


def test_overflow_policies(tmp_path):
  long_user, long_reply = "x" * 30, "y" * 20  # prompt OVERHEAD + 30; reply 21 ids
  rows = [chat("hi", "ok"), chat(long_user, "ok"), chat("hi", long_reply),
          chat(long_user, long_reply)]
  path = write_jsonl(tmp_path / "d.jsonl", rows)
  prompt_len, canvases = OVERHEAD + 10, 3  # room for 10 user bytes, 12 reply ids

  task = make_task(make_config(path, prompt_len=prompt_len, num_canvases=canvases))
  counts = task.overflow_counts[path]
  assert (counts.examples, counts.prompt_truncated, counts.target_truncated) == (4, 2, 2)
  tok = task.tokenizer
  by_source = {e.source: e for e in task.train_examples(0, 4)}
  cut = by_source[f"{path}:2"]
  full = tok.render([{"role": "user", "content": long_user}], True)
  assert list(cut.prompt_ids) == [tok.bos_id] + full[len(full) - prompt_len + 1:]
  assert tok.decode(cut.prompt_ids, skip_special_tokens=False).endswith(
      "x" * 8 + "<turn|>\n<|turn>model\n")
  assert list(by_source[f"{path}:3"].target_ids) == tok.encode("y" * 12)  # the beginning
  assert "2 prompts cut from the left, 2 replies cut" in task.data_report()

  task = make_task(make_config(path, prompt_len=prompt_len, num_canvases=canvases,
                               overflow="drop"))
  counts = task.overflow_counts[path]
  assert (counts.examples, counts.prompt_dropped, counts.target_dropped) == (1, 2, 1)

  with pytest.raises(ValueError, match=re.escape(f"{path}:2 (assistant turn 2): the prompt "
                                                    f"is {OVERHEAD + 30} tokens")) as e:
    make_task(make_config(path, prompt_len=prompt_len, num_canvases=canvases, overflow="error"))
  assert "\n" not in str(e.value)
  replies = write_jsonl(tmp_path / "r.jsonl", rows[:1] + rows[2:3])
  with pytest.raises(ValueError, match=re.escape(f"{replies}:2 (assistant turn 2): the reply "
                                                    "is 21 tokens")):
    make_task(make_config(replies, prompt_len=prompt_len, num_canvases=canvases,
                          overflow="error"))


def test_three_formats_and_assistant_turns(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [
      {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
                    {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"},
                    {"role": "assistant", "content": " a2 "}]},
      {"prompt": "p", "completion": "c"},
      {"conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "u1"},
                         {"from": "gpt", "value": "a1"}, {"from": "human", "value": "u2"},
                         {"from": "gpt", "value": "a2"}, {"from": "human", "value": "u3"}]},
  ])
  task = make_task(make_config(path, prompt_len=96, num_canvases=2))
  shown = task.describe_file(path)
  assert [e["source"] for e in shown] == [f"{path}:{n}" for n in (1, 1, 2, 3, 3)]
  first = "<bos><|turn>system\nsys<turn|>\n<|turn>user\nu1<turn|>\n<|turn>model\n"
  second = first + "a1<turn|>\n<|turn>user\nu2<turn|>\n<|turn>model\n"
  assert [e["prompt_text"] for e in shown] == [
      first, second, "<bos><|turn>user\np<turn|>\n<|turn>model\n", first, second]
  assert [e["target_text"] for e in shown] == ["a1<turn|><eos>", "a2<turn|><eos>",
                                               "c<turn|><eos><eos>", "a1<turn|><eos>",
                                               "a2<turn|><eos>"]
  tok = task.tokenizer
  assert shown[1]["prompt_ids"] == tok.render(
      [{"role": "system", "content": "sys"}, {"role": "user", "content": "u1"},
       {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}], True)
  assert shown[2]["target_ids"] == tok.encode("c") + [tok.eot_id, 1, 1]
  assert all(e["num_canvases"] == 1 for e in shown)
  # Held out: each line's last assistant turn, its history the prompt.
  held = task.load_eval_file(path)
  assert held.references == [" a2 ", "c", "a2"]
  assert [r["prompt"] for r in held.records] == ["u2", "p", "u2"]
  row = held.prompt_NxP[0][held.valid_NxP[0]]
  assert tok.decode(row, skip_special_tokens=False) == second


@pytest.mark.parametrize("line,needle", [
    ("{not json", "not JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),  # was a RecursionError traceback
    (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), "no assistant turn"),
    (json.dumps({"messages": [{"role": "robot", "content": "hi"},
                              {"role": "assistant", "content": "x"}]}), "unknown role 'robot'"),
    (json.dumps({"conversations": [{"from": "human", "value": "hi"},
                                   {"from": "bot", "value": "x"}]}), "unknown role 'bot'"),
    (json.dumps({"messages": [{"role": ["user"], "content": "hi"},  # was a TypeError
                              {"role": "assistant", "content": "x"}]}), "unknown role ['user']"),
    (json.dumps({"conversations": [{"from": {"a": 1}, "value": "hi"}]}), "unknown role {'a': 1}"),
    (json.dumps({"prompt": "hi", "completion": "  "}), "is empty"),
    (json.dumps({"prompt": "hi", "completion": 3}), "no string"),
    # An unpaired surrogate escape reached the tokenizer (a UnicodeEncodeError traceback).
    (json.dumps({"prompt": "hi\ud800", "completion": "1"}), "turn 1 (user) holds an unpaired"),
    (json.dumps({"text": "hi"}), "expected \"messages\""),
    (json.dumps([1]), "expected a JSON object"),
    (json.dumps({"messages": [{"role": "assistant", "content": "x"},
                              {"role": "user", "content": "hi"}]}), "before any user turn"),
])
def test_bad_lines_name_file_and_line(tmp_path, line, needle):
  path = write_jsonl(tmp_path / "bad.jsonl", [chat("a", "b"), "", line])
  with pytest.raises(ValueError) as e:
    make_task(make_config(path))
  message = str(e.value)
  assert message.startswith(f"{path}:3: ") and needle in message and "\n" not in message


def test_bad_config_and_tokenizer(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [chat("a", "b")])
  no_template = write_tokenizer_json(tmp_path / "tok")
  with pytest.raises(tokenizer_lib.TokenizerError, match="no chat template") as e:
    make_task(make_config(path, tokenizer=str(no_template)))
  assert str(tmp_path / "tok") in str(e.value) and "\n" not in str(e.value)
  with pytest.raises(ValueError, match="data.tokenizer"):
    make_task(make_config(path, tokenizer=""))  # and no init_from
  for data, needle in ((dict(overflow="wrap"), "data.overflow"),
                       (dict(weights="1,2"), "2 entries for 1"),
                       (dict(eval_fraction=0.1, eval=path), "not both"),
                       (dict(prompt_len=8), "cannot hold")):
    with pytest.raises(ValueError, match=needle):
      make_task(make_config(path, **data))
  c = make_config(path)
  c.eval.metric = "regex"
  with pytest.raises(ValueError, match="answer_regex"):
    make_task(c)
  c.eval.answer_regex = "x+"
  with pytest.raises(ValueError, match="no capturing group"):
    make_task(c)
  with pytest.raises(ValueError, match="not found"):
    make_task(make_config(str(tmp_path / "missing.jsonl")))
  # Training without data is a config error.
  with pytest.raises(ValueError, match="data.train"):
    make_task(make_config(""))
  # A task for evaluation only reads no training data; asking it for batches is the error.
  task = make_task(make_config(""), training=False)
  with pytest.raises(ValueError, match="data.train"):
    task.train_batches(2, 1)


def test_tokenizer_from_init_from(tmp_path):
  """data.tokenizer empty: the init_from checkpoint's tokenizer and template."""
  d = write_tokenizer_json(tmp_path / "ckpt", template=GEMMA_LIKE_TEMPLATE)
  path = write_jsonl(tmp_path / "d.jsonl", [chat("hello world", "the lazy dog")])
  c = make_config(path, tokenizer="", prompt_len=32, num_canvases=2, canvas_length=8)
  c.init_from = str(d)
  task = make_task(c)
  ref = AutoTokenizer.from_pretrained(d)
  (shown,) = task.describe_file(path)
  assert shown["prompt_ids"] == list(ref.apply_chat_template(
      [{"role": "user", "content": "hello world"}], add_generation_prompt=True, tokenize=True,
      return_dict=False))
  reply = ref.encode("the lazy dog", add_special_tokens=False) + [
      ref.convert_tokens_to_ids("<turn|>")]
  canvases = -(-len(reply) // 8)
  assert shown["target_ids"] == reply + [ref.eos_token_id] * (canvases * 8 - len(reply))
  assert shown["num_canvases"] == canvases
  assert task.stop_token_ids == (1, ref.convert_tokens_to_ids("<turn|>"))


# ----------------------------------------------------------------------------- pipeline


def batches_list(task, batch, steps, start=0, **kw):
  return [b for b in task.train_batches(batch, steps, start, **kw)]


def test_pipeline_resumes_exactly_and_reshuffles(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [chat(f"q{i}", f"a{i}") for i in range(10)])
  task = make_task(make_config(path, prompt_len=32, num_canvases=1))
  full = batches_list(task, 4, 6)
  resumed = batches_list(task, 4, 6, start=2)
  assert len(full) == 6 and len(resumed) == 4
  for a, b in zip(full[2:], resumed):
    for key in ("tokens", "valid", "loss_mask"):
      np.testing.assert_array_equal(a[key], b[key])
  # Two processes: each gets half of every global batch.
  halves = [batches_list(task, 4, 6, process_index=i, process_count=2) for i in range(2)]
  for step in range(6):
    np.testing.assert_array_equal(
        np.concatenate([halves[0][step]["tokens"], halves[1][step]["tokens"]]),
        full[step]["tokens"])
  # Each epoch of 10 records is a permutation of the file; epochs differ.
  sources = [e.source for e in task.train_examples(0, 30)]
  epochs = [sources[i:i + 10] for i in (0, 10, 20)]
  assert all(sorted(e) == sorted(f"{path}:{n}" for n in range(1, 11)) for e in epochs)
  assert epochs[0] != epochs[1] != epochs[2]
  # Rebuilding the task gives the same order.
  assert [e.source for e in make_task(make_config(path, prompt_len=32, num_canvases=1))
          .train_examples(0, 30)] == sources


def test_mixing_weights_and_held_out_split(tmp_path):
  a = write_jsonl(tmp_path / "a.jsonl", [chat(f"a{i}", "x") for i in range(20)])
  b = write_jsonl(tmp_path / "b.jsonl", [chat(f"b{i}", "y") for i in range(5)])
  task = make_task(make_config(f"{a},{b}", weights="3,1", prompt_len=32, num_canvases=1))
  files = [e.source.rsplit(":", 1)[0] for e in task.train_examples(0, 400)]
  assert files.count(a) == 300 and files.count(b) == 100
  # Default weights: in proportion to the examples (as if the files were concatenated).
  task = make_task(make_config(f"{a},{b}", prompt_len=32, num_canvases=1))
  files = [e.source.rsplit(":", 1)[0] for e in task.train_examples(0, 250)]
  assert files.count(a) == 200 and files.count(b) == 50
  # eval_fraction holds out whole conversations of each file, never trained on.
  c = make_config(f"{a},{b}", prompt_len=32, num_canvases=1, eval_fraction=0.2)
  c.eval.num_examples = 0
  task = make_task(c)
  held = {r["source"] for r in task.eval_prompts().records}
  trained = {e.source for e in task.train_examples(0, 200)}
  assert len(held) == 4 + 1 and not held & trained and len(trained) == 16 + 4
  c.eval.num_examples = 3
  assert len(make_task(c).eval_prompts()) == 3
  assert make_task(make_config(a, prompt_len=32, num_canvases=1)).eval_prompts() is None


# ----------------------------------------------------------------------------- scoring


def reply_row(task, text, stop=True, fill=0):
  """A generated row [K*C]: the reply's ids, a stop id, then padding."""
  tok = task.tokenizer
  ids = tok.encode(text) + ([tok.eot_id] if stop else []) + [tok.eos_id] * fill
  row = np.full(task.layout.response_len, tok.pad_id, np.int32)
  row[:len(ids)] = ids[:len(row)]
  return row


@pytest.mark.parametrize("metric,regex,reply,reference,correct", [
    ("exact", "", " 1 2 3\n", "1 2 3", True),
    ("exact", "", "1 2 4", "1 2 3", False),
    ("choice", "", "Because... The answer is: Yes.", "x. The answer is yes.", True),
    ("choice", "", "yes", "yes", False),  # a bare "yes" is not an answer
    ("choice", "", "the answer is maybe", "maybe.", True),
    ("choice", "", "the answer is no", "The answer is yes", False),
    ("gsm8k", "", "3 + 4 = 7\n#### 7.0", "so\n#### 7", True),
    ("gsm8k", "", "#### 1,234", "#### 1234", True),
    ("gsm8k", "", "the answer is 7", "#### 7", False),
    ("gsm8k", "", "#### 8", "7", False),
    ("regex", r"ANSWER: (\w+)", "blah ANSWER: cat.", "ANSWER: cat", True),
    ("regex", r"ANSWER: (\w+)", "blah ANSWER: dog", "cat", False),
])
def test_metrics(tmp_path, metric, regex, reply, reference, correct):
  c = make_config("", prompt_len=32, num_canvases=8)
  c.eval.metric, c.eval.answer_regex = metric, regex
  task = make_task(c, training=False)
  from diffgemma.tasks.base import Prompts

  prompts = Prompts(np.zeros((1, 32), np.int32), np.ones((1, 32), bool), [reference],
                    [{"prompt": "q"}])
  metrics, records = task.score(prompts, reply_row(task, reply)[None],
                                {"num_canvases": np.array([2])})
  assert metrics["accuracy"] == float(correct)
  assert metrics["canvases_per_reply"] == 2.0 and metrics["stopped"] == 1.0
  assert records[0]["reply"] == reply and records[0]["correct"] is correct
  assert records[0]["reference"] == reference and records[0]["prompt"] == "q"


def test_overran_replies_and_the_stop_warning(tmp_path):
  """overran: the whole reference and more (not a wrong reply, not a short one); the periodic
  eval warns from eval.stop_check_step on when that share reaches eval.stop_overrun_warning."""
  c = make_config("", prompt_len=32, num_canvases=8)
  c.eval.stop_check_step, c.eval.stop_overrun_warning = 100, 0.5
  task = make_task(c, training=False)
  from diffgemma.tasks.base import Prompts

  replies = ["1 2 3 4 5", "1 2 3", "1 2", "1 2 4 5"]  # overran, exact, short, wrong
  prompts = Prompts(np.zeros((4, 32), np.int32), np.ones((4, 32), bool), ["1 2 3"] * 4,
                    [{"prompt": "q"}] * 4)
  metrics, records = task.score(prompts, np.stack([reply_row(task, r) for r in replies]), {})
  assert [r["overran"] for r in records] == [True, False, False, False]
  assert metrics["overran"] == 0.25 and metrics["accuracy"] == 0.25
  assert task.plateau_warning(100, metrics) is None  # 25% < 50%
  assert task.plateau_warning(99, {"overran": 0.9}) is None  # before the check step
  warning = task.plateau_warning(100, {"overran": 0.5})
  assert "50% of the held-out replies" in warning and "\n" not in warning
  c.eval.stop_overrun_warning = 0.0
  with pytest.raises(ValueError, match="stop_overrun_warning"):
    make_task(c, training=False)


def test_reply_stops_at_first_stop_id_and_drops_pads(tmp_path):
  task = make_task(make_config("", prompt_len=32, num_canvases=4), training=False)
  tok = task.tokenizer
  row = np.full(16, tok.pad_id, np.int32)
  row[:10] = tok.encode("ab") + [tok.pad_id] + tok.encode("c") + [tok.eos_id] + tok.encode("dd") \
      + [tok.eot_id, 5, 6]
  assert task.reply_text(row) == "abc"
  assert task.reply_text(np.concatenate([np.zeros(32, np.int32), row])) == "abc"  # full row
  assert task.token_strings([tok.eot_id, 5 + ord("a"), 999]) == ["<turn|>", "a", "<id 999>"]
  p = task.prompt_from_text("hi")
  assert p.prompt_NxP.shape == (1, 32) and tok.decode(
      p.prompt_NxP[0][p.valid_NxP[0]], skip_special_tokens=False).endswith("hi<turn|>\n"
                                                                           "<|turn>model\n")


def test_rollouts_and_rewards(tmp_path, monkeypatch):
  path = write_jsonl(tmp_path / "d.jsonl", [chat(f"q{i}", f"a{i}") for i in range(6)])
  c = make_config(path, prompt_len=32, num_canvases=2)
  c.rl = {"reward": "exact"}
  task = make_task(c)
  first = task.rollout_prompts(0, 4)
  assert len(first) == 4
  again = make_task(c).rollout_prompts(0, 4)
  np.testing.assert_array_equal(first.prompt_NxP, again.prompt_NxP)
  assert first.references == again.references
  assert [r["prompt"] for r in first.records] == [f"q{r[1:]}" for r in first.references]
  group = first.repeat(2)
  rows = np.stack([reply_row(task, group.references[i] if i % 2 else "nope")
                   for i in range(8)])
  score, correct = task.reward(group, rows)
  np.testing.assert_array_equal(score, [0, 1] * 4)
  np.testing.assert_array_equal(correct, [False, True] * 4)

  # A user reward function: (prompt, reply, reference) -> float, clipped to [0, 1].
  (tmp_path / "my_rewards.py").write_text(
      "def length(prompt, reply, reference):\n"
      "  return (len(reply) - 2 + (prompt == 'q1')) / 2\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  c.rl = {"reward_fn": "my_rewards:length"}
  task = make_task(c)
  prompts = task.rollout_prompts(0, 3)
  rows = np.stack([reply_row(task, text) for text in ("a", "abc", "abcdef")])
  score, correct = task.reward(prompts, rows)
  expected = [min(max((n - 2 + (r["prompt"] == "q1")) / 2, 0), 1)
              for n, r in zip((1, 3, 6), prompts.records)]
  np.testing.assert_allclose(score, expected)
  np.testing.assert_array_equal(correct, np.asarray(expected) >= 1)
  for spec, needle in (("my_rewards", "package.module:function"),
                       ("nope_module:f", "cannot import nope_module"),
                       ("my_rewards:missing", "no function 'missing'")):
    c.rl = {"reward_fn": spec}
    with pytest.raises(ValueError, match=needle):
      make_task(c)
  c.rl = {"reward": "bleu"}
  with pytest.raises(ValueError, match="rl.reward"):
    make_task(c)


def test_the_graded_prefix_reward_ranks_wrong_replies(tmp_path):
  """rl.reward="prefix": shared leading characters over the longer text, counted by hand; a
  group whose replies are all wrong still gets a spread (an exact reward would give 0 to all)."""
  reference = "5 6 7 8 9 10"  # 12 characters
  cases = {
      reference: 1.0,  # exact
      " 5 6 7 8 9 10 ": 1.0,  # stripped as the exact metric strips
      "5 6 7": 5 / 12,  # stopped early, right so far
      "5 6 7 8 9 10 11 12": 12 / 18,  # ran 6 characters past the end
      "5 6 8 9 10 11": 4 / 13,  # a wrong number at character 5
      "": 0.0,
      "9": 0.0,
  }
  for reply, expected in cases.items():
    assert text_metrics.prefix_score(reply, reference) == pytest.approx(expected, abs=1e-12), reply
  assert text_metrics.prefix_score("", "") == 1.0
  with pytest.raises(ValueError, match="graded reward"):
    text_metrics.graded("bleu", "a", "a")

  path = write_jsonl(tmp_path / "d.jsonl", [chat("q", reference)])
  c = make_config(path, prompt_len=32, num_canvases=8)  # room for the longest reply
  c.rl = {"reward": {"name": "prefix"}}
  task = make_task(c)
  group = task.rollout_prompts(0, 1).repeat(len(cases))
  rows = np.stack([reply_row(task, reply) for reply in cases])
  score, correct = task.reward(group, rows)
  np.testing.assert_allclose(score, list(cases.values()), atol=1e-6)
  np.testing.assert_array_equal(correct, np.asarray(list(cases.values())) >= 1)


def test_a_memory_plan_of_a_chat_recipe_needs_no_tokenizer_or_data(tmp_path):
  """--dry_run of the PubMedQA recipe without --init_from or data: the plan needs the layout
  only, so the byte tokenizer stands in and no file is read."""
  from configs import sft_pubmedqa_lora
  from diffgemma.training import loop

  config, run, task, _, _ = loop.prepare_config(sft_pubmedqa_lora.get_config(), None, None,
                                                 planning=True)
  assert (task.layout.prompt_len, task.layout.num_canvases) == (1024, 2)
  assert task.layout.canvas_length == config.model.canvas_length == run.model.canvas_length == 256
  # A real run still needs both.
  with pytest.raises(ValueError, match="data.train"):
    loop.prepare_config(sft_pubmedqa_lora.get_config(), None, None)
  config = sft_pubmedqa_lora.get_config()
  config.data.train = write_jsonl(tmp_path / "d.jsonl", [chat("q", "a")])
  with pytest.raises(ValueError, match="no tokenizer"):
    loop.prepare_config(config, None, None)
