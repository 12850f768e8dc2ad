"""Thinking mode: prompts rendered with `enable_thinking` as transformers' apply_chat_template
renders them, thoughts in the data trained in the template's thinking channel, and the reply cut
into its thought and the answer after it, which alone is scored.

The tokenizers are the tests' 64-id BPE (with Gemma 4's <|think|> added) under a Gemma-4-like
template, and the byte tokenizer under its own template.
"""

import ml_collections
import numpy as np
import pytest
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils

from diffgemma.io import tokenizer as tokenizer_lib
from diffgemma.tasks import make_task
from diffgemma.tasks.base import Prompts
from tests.helpers import GEMMA_LIKE_TEMPLATE, SPECIALS, chat, make_config, write_jsonl
from tests.helpers import write_tokenizer_json

# Gemma 4's thinking mode, as its templates write it: enable_thinking opens a system turn with
# <|think|>; a reply after the last user turn writes its thought (either name) in the thinking
# channel; with thinking off the model turn opens with an empty channel (the 26B-A4B's).
THINKING_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- if thinking or messages[0]['role'] == 'system' -%}"
    "{{- '<|turn>system\\n' -}}{%- if thinking -%}{{- '<|think|>\\n' -}}{%- endif -%}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] | trim -}}{%- endif -%}"
    "{{- '<turn|>\\n' -}}{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}{%- if not (loop.first and m['role'] == 'system') -%}"
    "{{- '<|turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' -}}"
    "{%- set thought = m.get('reasoning') or m.get('reasoning_content') -%}"
    "{%- if thought and loop.index0 > ns.last_user -%}"
    "{{- '<|channel>thought\\n' + thought + '\\n<channel|>' -}}{%- endif -%}"
    "{{- m['content'] | trim -}}{{- '<turn|>\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}"
    "{%- if not thinking -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}{%- endif -%}")

USER, THOUGHT, ANSWER = "hello world", "the lazy dog", "the quick brown fox"
CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": USER}],
    "system turn": [{"role": "system", "content": "how are you?"},
                    {"role": "user", "content": USER}],
    "a reply that thinks": [{"role": "user", "content": USER},
                            {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}],
    "its thought named thinking": [{"role": "user", "content": USER},
                                   {"role": "assistant", "content": ANSWER, "thinking": THOUGHT}],
    "a thought in the history": [{"role": "user", "content": USER},
                                 {"role": "assistant", "content": ANSWER, "reasoning": THOUGHT},
                                 {"role": "user", "content": "a block diffusion model"}],
}


def thinking_tokenizer(directory, template=THINKING_TEMPLATE):
  return write_tokenizer_json(directory, specials=SPECIALS + ["<|think|>"], template=template)


@pytest.mark.parametrize("enable_thinking", [False, True])
@pytest.mark.parametrize("case", sorted(CONVERSATIONS))
def test_render_matches_apply_chat_template(tmp_path, case, enable_thinking):
  d = thinking_tokenizer(tmp_path)
  ours, ref = tokenizer_lib.load_tokenizer(d), AutoTokenizer.from_pretrained(d)
  assert ours.thinking_mode and ours.thinking_channel == ("<|channel>thought\n", "\n<channel|>")
  messages = CONVERSATIONS[case]
  for add_generation_prompt in (True, False):
    kwargs = dict(add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking)
    text = ref.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.render_text(messages, **kwargs) == text
    assert ours.render(messages, **kwargs) == list(ref.apply_chat_template(
        messages, tokenize=True, return_dict=False, **kwargs))
    # The byte tokenizer's template, rendered by transformers' own function.
    expected, _ = chat_template_utils.render_jinja_template(
        [messages], chat_template=tokenizer_lib.BYTES_CHAT_TEMPLATE, bos_token="<bos>", **kwargs)
    assert tokenizer_lib.load_tokenizer("bytes").render_text(messages, **kwargs) == expected[0]
  assert ("<|think|>" in text) == enable_thinking
  assert (THOUGHT in text) == (case in ("a reply that thinks", "its thought named thinking"))


def test_the_bytes_template_without_thinking_is_unchanged():
  """Thinking off and no thought: the byte template renders what it rendered before it had a
  thinking mode (runs trained on it keep their prompts)."""
  tok = tokenizer_lib.load_tokenizer("bytes")
  messages = [{"role": "system", "content": "s"}, {"role": "user", "content": " u "},
              {"role": "assistant", "content": "a"}, {"role": "user", "content": "v"}]
  assert tok.render_text(messages, True) == (
      "<bos><|turn>system\ns<turn|>\n<|turn>user\nu<turn|>\n<|turn>model\na<turn|>\n"
      "<|turn>user\nv<turn|>\n<|turn>model\n")
  assert tok.render_text(messages, True, enable_thinking=True).startswith(
      "<bos><|turn>system\n<|think|>\ns<turn|>\n<|turn>user\nu<turn|>\n")


def thinking_record(user=USER, thought=THOUGHT, answer=ANSWER, key="reasoning_content"):
  record = chat(user, answer)
  record["messages"][-1][key] = thought
  return record


def test_a_training_row_holds_the_thought(tmp_path):
  """The prompt (thinking mode) and the target (thought in its channel, answer, end of turn)
  are together the template's rendering of the whole conversation, as transformers tokenizes
  it; every slot of the thought is under the loss."""
  d = thinking_tokenizer(tmp_path / "tok")
  path = write_jsonl(tmp_path / "d.jsonl", [thinking_record()])
  task = make_task(make_config(path, tokenizer=str(d), prompt_len=40, num_canvases=4,
                               canvas_length=8, thinking=True))
  (shown,) = task.describe_file(path)
  whole = list(AutoTokenizer.from_pretrained(d).apply_chat_template(
      thinking_record()["messages"], enable_thinking=True, tokenize=True, return_dict=False))
  tok = task.tokenizer
  target = shown["target_ids"][:shown["target_ids"].index(tok.eot_id) + 1]
  assert shown["prompt_ids"] + target == whole[:-len(tok.encode("\n"))]  # less the turn's "\n"
  assert shown["target_text"].startswith(f"<|channel>thought\n{THOUGHT}\n<channel|>{ANSWER}")
  # The byte tokenizer: the same channel, spelled in bytes, all of it supervised.
  path = write_jsonl(tmp_path / "b.jsonl", [thinking_record()])
  task = make_task(make_config(path, prompt_len=48, num_canvases=2, canvas_length=32,
                               thinking=True))
  (example,) = task.train_examples(0, 1)
  row = task.layout_example(example)
  target = f"<|channel>thought\n{THOUGHT}\n<channel|>{ANSWER}"
  ids = task.tokenizer.encode(target) + [task.tokenizer.eot_id]
  assert list(row["tokens"][48:48 + len(ids)]) == ids and row["loss_mask"][48:48 + len(ids)].all()
  assert task.tokenizer.decode(example.prompt_ids, skip_special_tokens=False).startswith(
      "<bos><|turn>system\n<|think|>\n<turn|>\n")


@pytest.mark.parametrize("record, data, needle", [
    (thinking_record(), {}, "data.thinking is False"),
    (thinking_record(thought="a <channel|> b"), {"thinking": True}, "channel marker '<channel|>'"),
    (thinking_record(thought=7), {"thinking": True}, "int 'reasoning_content'"),
    ({"messages": [{"role": "user", "content": "q", "thinking": "t"},
                   {"role": "assistant", "content": "a"}]}, {"thinking": True},
     "only assistant turns"),
    ({"messages": [{"role": "user", "content": "q"},
                   {"role": "assistant", "content": "a", "thinking": "t", "reasoning": "u"}]},
     {"thinking": True}, "different thoughts"),
])
def test_bad_thoughts_are_one_line(tmp_path, record, data, needle):
  path = write_jsonl(tmp_path / "bad.jsonl", [chat("a", "b"), record])
  with pytest.raises(ValueError) as e:
    make_task(make_config(path, **data))
  message = str(e.value)
  assert message.startswith(f"{path}:2") and needle in message and "\n" not in message


def test_templates_without_thinking_are_one_line(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [thinking_record()])
  # No thinking mode: data.thinking cannot be honoured.
  d = write_tokenizer_json(tmp_path / "plain", template=GEMMA_LIKE_TEMPLATE)
  with pytest.raises(tokenizer_lib.TokenizerError, match="no thinking mode") as e:
    make_task(make_config(path, tokenizer=str(d), thinking=True))
  assert "data.thinking" in str(e.value) and "\n" not in str(e.value)
  # A thinking mode but no thinking channel: a thought cannot be written.
  no_channel = THINKING_TEMPLATE.replace("'<|channel>thought\\n' + thought + '\\n<channel|>'",
                                         "''").replace("'<|channel>thought\\n<channel|>'", "''")
  d = thinking_tokenizer(tmp_path / "no_channel", template=no_channel)
  with pytest.raises(ValueError, match="no thinking channel") as e:
    make_task(make_config(path, tokenizer=str(d), prompt_len=40, thinking=True))
  assert str(e.value).startswith(f"{path}:1") and "\n" not in str(e.value)
  c = make_config(path)
  with c.data.ignore_type():  # as a hand-edited config.json could hold it
    c.data.thinking = "yes"
  with pytest.raises(ValueError, match="data.thinking must be True or False"):
    make_task(c)


def test_eval_scores_the_answer_after_the_thought(tmp_path):
  """A thought that holds the right answer does not count; the answer after it does; a reply
  whose thought never closes has no answer. Both tokenizers: channel markers as tokens, and
  spelled in bytes."""
  d = thinking_tokenizer(tmp_path / "tok")
  for tokenizer in ("bytes", str(d)):
    c = make_config("", tokenizer=tokenizer, prompt_len=40, num_canvases=8, canvas_length=8,
                    thinking=True)
    c.rl = ml_collections.ConfigDict({"reward": "exact"})  # SD·RL's reward judges the same
    task = make_task(c, training=False)
    tok = task.tokenizer
    replies = {  # reply text -> (reference, correct, thought, answer)
        "<|channel>thought\nhello\n<channel|>world": ("hello", False, "hello", "world"),
        "<|channel>thought\nworld\n<channel|>hello": ("hello", True, "world", "hello"),
        "<|channel>thought\nhello": ("hello", False, "hello", ""),
        "hello": ("hello", True, None, "hello"),
    }
    rows = []
    for text in replies:
      ids = tok.encode(text) + [tok.eot_id]
      row = np.full(task.layout.response_len, tok.pad_id, np.int32)
      row[:len(ids)] = ids
      rows.append(row)
    n = len(replies)
    prompts = Prompts(np.zeros((n, 40), np.int32), np.ones((n, 40), bool),
                      [ref for ref, *_ in replies.values()], [{"prompt": "q"}] * n)
    metrics, records = task.score(prompts, np.stack(rows), {})
    for record, (ref, correct, thought, answer) in zip(records, replies.values()):
      assert (record["correct"], record.get("thought"), record["reply"]) == (
          correct, thought, answer), (tokenizer, record)
    assert metrics["accuracy"] == 0.5
    _, correct = task.reward(prompts, np.stack(rows))
    assert correct.tolist() == [r[1] for r in replies.values()]
