"""Bad inputs, generated and hand-picked: every reader either works or raises one user error.

The contract (docs/operations.md): a bad input ends in ONE line naming the file, line, flag or
config key and what to do; no traceback, nothing written, no good file damaged. `cli.run`
turns exactly the exceptions of `cli.user_error_types()` into that line (exit status 2), so a
reader holds the contract when it returns, or raises one of those with a one-line message
that names the input.

Generated (hypothesis, the suite's deterministic profile in tests/conftest.py; each test's
`max_examples` is the number of generated cases it runs): the Sudoku CSV, `--puzzle`, chat
JSONL in its three formats (messages, prompt/completion, ShareGPT) through the reader and the
chat task, tokenizer directories, chat templates, `--config.KEY=VALUE` and `--sampler.KEY=VALUE`
overrides, and eval.py / sample.py command lines (run in one process, `run_tool_cases`).
Hand-picked: the known bad command lines of every tool, also in that one process; the cases
that need a trained run (a busy, damaged or diverging workdir, a full disk, resume changes)
are in tests/test_reliability.py and tests/test_nonfinite.py.
"""

import dataclasses
import json
import os
import re

import hypothesis
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from diffgemma import cli, errors
from diffgemma.io import chat_template, tokenizer as tokenizer_lib
from diffgemma.runs import checkpointing
from diffgemma.sampling import sampler
from diffgemma.tasks import chat_data, make_task, sudoku_puzzles
from diffgemma.training import loop
from tests.helpers import (ROOT, add_vision_tower, run_tool_cases, tiny_chat_config,
                           write_jsonl, write_png, write_tokenizer_json)

TINY = os.path.join(ROOT, "tests", "tiny_sudoku_config.py")
USER_ERRORS = cli.user_error_types()


def check_one_line(e: BaseException, *needles: str, any_of: tuple[str, ...] = ()) -> str:
  """`e` is an error `cli.run` prints as one line, and that line names every needle (and at
  least one of `any_of`). Returns the line."""
  assert isinstance(e, USER_ERRORS), f"{type(e).__name__} is no user error: {e!r}"
  text = str(e.args[0] if isinstance(e, KeyError) and e.args else e).strip()
  assert text and "\n" not in text, f"not one line: {text!r}"
  for needle in needles:
    assert needle in text, f"{text!r} does not name {needle!r}"
  if any_of:
    assert any(n in text for n in any_of), f"{text!r} names none of {any_of}"
  return text


def outcome(fn, *args, **kwargs):
  """(result, None) or (None, the user error): any other exception fails the test."""
  try:
    return fn(*args, **kwargs), None
  except USER_ERRORS as e:
    return None, e


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
  """A directory for the module's files (hypothesis runs many examples per test call, so a
  function-scoped tmp_path would be shared by them anyway)."""
  return tmp_path_factory.mktemp("bad_inputs")


def unique_path(scratch, name: str) -> str:
  """A fresh file path (in a directory of its own) for one generated example."""
  unique_path.count = getattr(unique_path, "count", 0) + 1
  directory = scratch / f"case{unique_path.count}"
  directory.mkdir()
  return str(directory / name)


def write_bytes(path: str, data: bytes) -> bytes:
  with open(path, "wb") as f:
    f.write(data)
  return data


def unchanged(path: str, data: bytes) -> None:
  """The reader left the input file as it was (no good file damaged)."""
  with open(path, "rb") as f:
    assert f.read() == data


# ----------------------------------------------------------------------------- shared strategies

# Text an argv or a JSON string can hold (no NUL; lone surrogates come from JSON escapes below).
TEXT = st.text(st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
               max_size=12)
JSON_LEAF = (st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats() | TEXT
             | st.sampled_from(["\ud800", "a\udfff", " ", "user", "assistant", "gpt"]))
JSON_ANY = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
# What a user types after `=`: numbers, words, Python literals, nothing.
VALUE_TEXT = st.one_of(
    st.integers(-10**4, 10**4).map(str), st.floats().map(repr),
    st.sampled_from(["", "0", "-1", "1", "2", "1.5", "1e999", "nan", "inf", "-inf", "True",
                     "false", "None", "()", "(1, 2)", "[1]", "{}", "'x'", "digits", "cosine",
                     "bfloat16", "ragged_dot", "entropy", "ar", "1,2", "1e-3"]), TEXT)


def python_valid_grid(grid) -> bool:
  """Reference: every row, column and box of an 81-cell grid holds 1..9 once."""
  g = np.asarray(grid).reshape(9, 9)
  units = [g[i] for i in range(9)] + [g[:, i] for i in range(9)] + [
      g[r:r + 3, c:c + 3].reshape(-1) for r in (0, 3, 6) for c in (0, 3, 6)]
  return all(sorted(u.tolist()) == list(range(1, 10)) for u in units)


def givens_conflict(puzzle) -> bool:
  """Reference: some row, column or box has a digit given twice."""
  g = np.asarray(puzzle).reshape(9, 9)
  units = [g[i] for i in range(9)] + [g[:, i] for i in range(9)] + [
      g[r:r + 3, c:c + 3].reshape(-1) for r in (0, 3, 6) for c in (0, 3, 6)]
  return any(len(set(d for d in u.tolist() if d)) != sum(1 for d in u.tolist() if d)
             for u in units)


# ----------------------------------------------------------------------------- Sudoku CSV

_PUZZLES, _SOLUTIONS = sudoku_puzzles.generate_puzzles(7, 3, 40, 44)
GOOD_ROWS = [("".join(map(str, p)) + "," + "".join(map(str, s))).encode()
             for p, s in zip(_PUZZLES, _SOLUTIONS)]
HEADER = b"quizzes,solutions"


@st.composite
def csv_files(draw) -> bytes:
  """A Kaggle CSV: good rows, then a few edits (a byte replaced, deleted or inserted, a line
  dropped or duplicated, two cells swapped), a line ending, maybe a BOM; or plain bytes."""
  if draw(st.integers(0, 9)) == 0:
    return draw(st.binary(max_size=200))
  lines = [HEADER] + draw(st.lists(st.sampled_from(GOOD_ROWS), max_size=3))
  for _ in range(draw(st.integers(0, 3))):
    if not lines:
      break
    i = draw(st.integers(0, len(lines) - 1))
    line = lines[i]
    kind = draw(st.sampled_from(["replace", "delete", "insert", "drop", "duplicate", "swap"]))
    j = draw(st.integers(0, max(len(line) - 1, 0)))
    if kind == "replace" and line:
      line = line[:j] + draw(st.sampled_from(list(b"0123456789,.; \t\xff\x00a"))).to_bytes(
          1, "big") + line[j + 1:]
    elif kind == "delete":
      line = line[:j] + line[j + draw(st.integers(1, 3)):]
    elif kind == "insert":
      line = line[:j] + draw(st.binary(min_size=1, max_size=3)) + line[j:]
    elif kind == "swap" and len(line) > 82:
      k = draw(st.integers(82, len(line) - 1))
      chars = bytearray(line)
      chars[j], chars[k] = chars[k], chars[j]
      line = bytes(chars)
    if kind == "drop":
      del lines[i]
    elif kind == "duplicate":
      lines.insert(i, line)
    else:
      lines[i] = line
  newline = draw(st.sampled_from([b"\n", b"\r\n"]))
  bom = draw(st.sampled_from([b"", b"\xef\xbb\xbf"]))
  return bom + newline.join(lines) + draw(st.sampled_from([b"", newline, newline * 2]))


@settings(max_examples=100)
@given(data=csv_files())
@example(data=b"")
@example(data=HEADER + b"\n")
@example(data=HEADER + b"\n" + GOOD_ROWS[0][:-1] + b"\n")
def test_sudoku_csv_reads_or_names_the_line(scratch, data):
  path = unique_path(scratch, "p.csv")
  write_bytes(path, data)
  result, error = outcome(sudoku_puzzles.load_csv, path)
  unchanged(path, data)
  if error is not None:
    line = check_one_line(error, path)
    numbers = [int(n) for n in re.findall(r"line (\d+)", line)]
    assert numbers or "empty" in line, line
    assert all(1 <= n <= data.count(b"\n") + 1 for n in numbers), line
    return
  puzzles, solutions = result
  rows = [l for l in data.removeprefix(b"\xef\xbb\xbf").split(b"\n")[1:] if l.strip()]
  assert len(puzzles) == len(solutions) == len(rows)
  for puzzle, solution in zip(puzzles, solutions):
    assert python_valid_grid(solution)
    assert ((puzzle == 0) | (puzzle == solution)).all()


# ----------------------------------------------------------------------------- --puzzle

GOOD_PUZZLE = "".join(str(d) if d else "." for d in _PUZZLES[0])


@st.composite
def puzzle_texts(draw) -> str:
  if draw(st.booleans()):
    return draw(st.text(alphabet=".0123456789 \n\tx|-", max_size=100))
  chars = list(GOOD_PUZZLE)
  for _ in range(draw(st.integers(0, 3))):
    i = draw(st.integers(0, len(chars) - 1))
    chars[i] = draw(st.sampled_from(list("123456789.0 x\n") + ["", "55"]))
  return "".join(chars)


@settings(max_examples=150)
@given(text=puzzle_texts())
@example(text="55" + "." * 79)
@example(text="1" * 80)
def test_puzzle_flag_parses_or_says_why(text):
  result, error = outcome(sudoku_puzzles.parse_puzzle_string, text)
  if error is not None:
    check_one_line(error, "puzzle")
    return
  chars = "".join(text.split())
  assert result.shape == (81,)
  assert [0 if c == "." else int(c) for c in chars] == result.tolist()
  assert not givens_conflict(result)


# ----------------------------------------------------------------------------- chat JSONL

ROLES = st.sampled_from(["system", "user", "assistant", "bot", "", "User"]) | JSON_ANY
SHAREGPT_ROLES = st.sampled_from(["system", "human", "gpt", "user", ""]) | JSON_ANY
CONTENT = st.sampled_from(["hi", "1 2 3", " ", "Count from 1 to 3.", "\ud800"]) | TEXT | JSON_ANY
# Content parts (the messages format): img.png exists beside each generated file (a small
# image), the others do not.
IMAGE_PATH = (st.sampled_from(["img.png", "missing.png", "", "../img.png", "/no/such.png"])
              | JSON_ANY)
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "video"]) | JSON_ANY},
                             optional={"text": CONTENT, "path": IMAGE_PATH}) | JSON_ANY
PARTS = st.lists(PART, max_size=3)


def turns(role_key, text_key, roles, content=CONTENT):
  turn = st.fixed_dictionaries({role_key: roles, text_key: content}) | st.fixed_dictionaries(
      {}, optional={role_key: roles, text_key: content, "x": JSON_ANY}) | JSON_ANY
  return st.lists(turn, max_size=4) | JSON_ANY


INFILL = st.fixed_dictionaries({"prefix": CONTENT, "middle": CONTENT, "suffix": CONTENT}) | JSON_ANY
FORMATS = {
    "messages": st.fixed_dictionaries({"messages": turns("role", "content", ROLES,
                                                         CONTENT | PARTS)},
                                      optional={"infill": INFILL}),
    "prompt_completion": st.fixed_dictionaries({}, optional={
        "prompt": CONTENT, "completion": CONTENT, "infill": INFILL}),
    "sharegpt": st.fixed_dictionaries({"conversations": turns("from", "value", SHAREGPT_ROLES)},
                                      optional={"infill": INFILL}),
}
GOOD_LINE = json.dumps({"messages": [
    {"role": "user", "content": "Count from 1 to 3."}, {"role": "assistant", "content": "1 2 3"}]})


@st.composite
def jsonl_files(draw, records) -> bytes:
  """A good conversation, then generated records (some lines cut short or replaced by text),
  blank lines here and there."""
  lines = [GOOD_LINE] if draw(st.booleans()) else []
  for record in draw(st.lists(records, min_size=1, max_size=3)):
    line = json.dumps(record)
    kind = draw(st.integers(0, 9))
    if kind == 0:
      line = line[:draw(st.integers(0, len(line)))]
    elif kind == 1:
      line = draw(TEXT)
    lines.append(line)
    if draw(st.integers(0, 5)) == 0:
      lines.append("")
  data = "\n".join(lines).encode()
  if draw(st.integers(0, 20)) == 0:
    data += b"\n\xff\xfe"  # not UTF-8
  return data


def check_chat_outcome(path: str, data: bytes, error) -> None:
  """A chat reader's error names the file and, for a bad line, its number."""
  line = check_one_line(error, path)
  numbers = [int(n) for n in re.findall(re.escape(path) + r":(\d+)", line)]
  assert all(1 <= n <= data.count(b"\n") + 1 for n in numbers), line


def read_chat_file(scratch, data: bytes):
  path = unique_path(scratch, "chat.jsonl")
  write_png(os.path.join(os.path.dirname(path), "img.png"), 8, 8)
  write_bytes(path, data)
  result, error = outcome(chat_data.read_jsonl, path)
  unchanged(path, data)
  if error is not None:
    check_chat_outcome(path, data, error)
    return path, None
  lines = [l for l in data.decode("utf-8-sig").split("\n") if l.strip()]
  assert len(result) == len(lines)
  for conversation in result:
    assert any(m["role"] == "assistant" for m in conversation.messages)
  return path, result


@settings(max_examples=50)
@given(data=jsonl_files(FORMATS["messages"]))
@example(data=(GOOD_LINE + "\n" + json.dumps(
    {"messages": [{"role": ["user"], "content": "hi"}]})).encode())
@example(data=json.dumps({"messages": [
    {"role": "user", "content": [{"type": "image", "path": "img.png"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]}).encode())
def test_chat_jsonl_messages_reads_or_names_the_line(scratch, data):
  read_chat_file(scratch, data)


@settings(max_examples=40)
@given(data=jsonl_files(FORMATS["prompt_completion"]))
def test_chat_jsonl_prompt_completion_reads_or_names_the_line(scratch, data):
  read_chat_file(scratch, data)


@settings(max_examples=40)
@given(data=jsonl_files(FORMATS["sharegpt"]))
@example(data=json.dumps({"conversations": [{"from": {"a": 1}, "value": "x"}]}).encode())
def test_sharegpt_reads_or_names_the_line(scratch, data):
  read_chat_file(scratch, data)


@settings(max_examples=30)
@given(data=jsonl_files(st.one_of(*FORMATS.values())))
@example(data=json.dumps({"messages": [
    {"role": "user", "content": [{"type": "image", "path": "img.png"}]},
    {"role": "assistant", "content": "x"}]}).encode())
@example(data=json.dumps({"prompt": "hi\ud800", "completion": "1"}).encode())
@example(data=json.dumps({"prompt": "hi", "completion": "1 \udfff"}).encode())
def test_chat_task_trains_and_evaluates_or_names_the_line(scratch, data):
  """What train.py and eval.py build from a file: the chat task's examples (rendered and
  tokenized by the byte tokenizer, fitted to the layout) and its held-out prompts."""
  path, conversations = read_chat_file(scratch, data)
  if conversations is None:
    return
  config = tiny_chat_config(train=path, overflow="drop")
  task, error = outcome(make_task, config)
  if error is not None:
    check_chat_outcome(path, data, error)
  task, error = outcome(make_task, tiny_chat_config(), training=False)
  assert error is None
  prompts, error = outcome(task.load_eval_file, path)
  unchanged(path, data)
  if error is not None:
    check_chat_outcome(path, data, error)


# ----------------------------------------------------------------------------- image chat data


def vision_config(train="", vision=True, **data):
  """tiny_chat_config with the image tokens, a vision tower in the model section (a tiny
  processor: 8 px patches pooled 2 x 2, 16 soft tokens a picture; none if not `vision`) and
  two image slots."""
  config = tiny_chat_config(train, **{"tokenizer": "bytes_image", "max_images": 2, **data})
  return add_vision_tower(config, vision=vision)


def test_bad_image_data_is_one_line_naming_the_line(tmp_path):
  """A missing, unreadable or truncated image, more images than the layout's slots, a prompt
  that can only be cut through an image, an image in a reply, an image for a model without a
  vision tower or for a tokenizer without image tokens: each is one user error naming the file
  and line, from what train.py (and eval.py) build before writing anything; the file is left as
  it was."""
  good = write_png(tmp_path / "img" / "good.png", 24, 40)
  (tmp_path / "img" / "garbage.png").write_bytes(b"not an image at all")
  whole = open(good, "rb").read()
  (tmp_path / "img" / "cut.png").write_bytes(whole[:len(whole) // 2])
  two = json.dumps({"messages": [
      {"role": "user", "content": [{"type": "image", "path": "img/good.png"},
                                   {"type": "image", "path": "img/good.png"},
                                   {"type": "text", "text": "Same?"}]},
      {"role": "assistant", "content": "yes"}]})
  in_reply = json.dumps({"messages": [
      {"role": "user", "content": "Draw it."},
      {"role": "assistant", "content": [{"type": "image", "path": "img/good.png"}]}]})
  cases = {  # name: (second line, config changes (model.* for the model section), needles)
      "missing": (image_line("img/none.png"), {}, ["img/none.png", "not found"]),
      "garbage": (image_line("img/garbage.png"), {}, ["garbage.png", "cannot read image"]),
      "truncated": (image_line("img/cut.png"), {}, ["cut.png", "cannot read image"]),
      "too_many": (two, {"max_images": 1}, ["2 images", "data.max_images=1"]),
      "no_slots": (image_line("img/good.png"), {"max_images": 0}, ["data.max_images=0"]),
      "cut": (image_line("img/good.png", "Which one? " * 4), {"prompt_len": 40},
              ["image tokens", "cut an image", "data.prompt_len=40"]),
      "too_long": (image_line("img/good.png", "Which one? " * 4),
                   {"prompt_len": 40, "overflow": "error"}, ["image tokens", "data.prompt_len"]),
      "in_reply": (in_reply, {}, ["images go in user turns"]),
      "no_vision": (image_line("img/good.png"), {"vision": False}, ["no vision tower"]),
      "text_tokenizer": (image_line("img/good.png"), {"tokenizer": "bytes"},
                         ["no image tokens"]),
  }
  for name, (line, changes, needles) in cases.items():
    path = write_jsonl(tmp_path / f"{name}.jsonl", [chat_line("hi", "yo"), line])
    data = open(path, "rb").read()
    for training in (True, False):  # train.py reads data.train; eval.py --data the same file
      config = vision_config(path if training else "", **changes)
      task, error = outcome(make_task, config, training=training)
      if not training and error is None:
        _, error = outcome(task.load_eval_file, path)
      assert error is not None, (name, training)
      check_one_line(error, f"{path}:2", *needles)
    unchanged(path, data)
  # The same prompt under data.overflow=drop: dropped and counted, the rest kept.
  path = str(tmp_path / "cut.jsonl")
  task = make_task(vision_config(path, prompt_len=40, overflow="drop"))
  assert (task.overflow_counts[path].examples, task.overflow_counts[path].prompt_dropped) == (1, 1)
  # A typed prompt's image (sample.py): one line naming the file.
  task = make_task(vision_config(prompt_len=64), training=False)
  _, error = outcome(task.prompt_from_text, "hi", images=[str(tmp_path / "img" / "cut.png")])
  check_one_line(error, "cut.png", "cannot read image")


def test_vision_tower_check():
  """The check the model's vision tower gates (a flag, so it holds before and after the model
  config has a `vision` section)."""
  chat_data.check_images(0, False, 0, "f.jsonl:1")  # text needs no tower
  chat_data.check_images(2, True, 2, "f.jsonl:1")
  for has_tower, slots, needle in ((False, 4, "no vision tower"), (True, 1, "data.max_images=1")):
    _, error = outcome(chat_data.check_images, 2, has_tower, slots, "f.jsonl:3")
    check_one_line(error, "f.jsonl:3", needle)


# ----------------------------------------------------------------------------- tokenizer directories


class TokenizerFiles(dict):
  """{file name: bytes}, shown by name only in hypothesis' reports."""

  def __repr__(self):
    return f"TokenizerFiles({sorted(self)})"


@pytest.fixture(scope="module")
def good_tokenizer_files(tmp_path_factory):
  """The files of a small Gemma-like tokenizer directory (tokenizer.json and its config) to
  build generated directories from."""
  directory = write_tokenizer_json(str(tmp_path_factory.mktemp("good_tokenizer")))
  return TokenizerFiles({name: open(os.path.join(directory, name), "rb").read()
                         for name in ("tokenizer.json", "tokenizer_config.json")})


SPECIAL_NAMES = ["<bos>", "<eos>", "<pad>", "<unk>", "<|turn>", "<turn|>", "<nope>", ""]
TEMPLATE_PIECES = [
    "{{ bos_token }}", "{% for m in messages %}", "{% endfor %}", "{{ m['content'] }}",
    "{{ m.content | trim }}", "<|turn>", "<turn|>", "{{ m['role'] }}\n", "<start_of_turn>",
    "{% if add_generation_prompt %}<|turn>model\n", "{% endif %}", "{{ raise_exception('no') }}",
    "{{ 1 / 0 }}", "{{ messages[0]['content'] + 1 }}", "{{ nothing.attr }}", "{{ messages | tojson }}",
    "{% set ns = namespace(n=0) %}", "{{ ns.n + 1 }}", "{{ strftime_now('%Y') }}",
    "{% generation %}", "{% endgeneration %}", "{{ ''.__class__.__mro__ }}", "{{ messages[9] }}",
    "{{ m['content'][0] }}", "{{ '%d' % 'x' }}", "{{ m['role'] | upper }}", "{%", "}}", "{{",
    "{{ messages | map(attribute='role') | join(',') }}", "{{ 'a' ~ 1 }}", "{% break %}",
    "{% continue %}", "{{ m.get('x', 'y') }}", "{{ [1, 2][5] }}", "{{ 'x'.split(1) }}",
    "{% macro f(x) %}{{ x }}{% endmacro %}{{ f() }}", "{{ loop.index }}", "text ",
    "{{ messages[0]['content'] | int }}", "{{ range(3) | sum }}", "{{ m.items() | list }}",
    "{{ {'a': 1}['b'] }}", "{{ m['content'].startswith(1) }}", "{{ sot_token }}"]
TEMPLATES = st.lists(st.sampled_from(TEMPLATE_PIECES), max_size=8).map("".join) | TEXT
CONVERSATIONS = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["system", "user", "assistant", "model", "tool"]),
    "content": st.sampled_from(["hi", "", " 1 2 ", "<bos>", "{{ x }}"]) | TEXT}), max_size=3)


@st.composite
def tokenizer_dirs(draw, good):
  """{file name: bytes}: each file of a tokenizer directory absent, good, cut short or
  generated (JSON of any shape, special tokens named or missing, templates, bytes)."""
  files = {}
  json_text = lambda value: json.dumps(value).encode()
  choice = draw(st.sampled_from(["good", "good", "cut", "bytes", "absent"]))
  if choice != "absent":
    data = good["tokenizer.json"]
    files["tokenizer.json"] = {"good": data, "cut": data[:draw(st.integers(0, len(data)))],
                               "bytes": draw(st.binary(max_size=40))}[choice]
  if draw(st.integers(0, 4)) == 0:
    files["tokenizer.model"] = draw(st.binary(max_size=40))
  config = draw(st.sampled_from(["good", "specials", "json", "bytes", "absent"]))
  if config == "good":
    files["tokenizer_config.json"] = good["tokenizer_config.json"]
  elif config == "specials":
    token = st.sampled_from(SPECIAL_NAMES) | st.fixed_dictionaries(
        {"content": st.sampled_from(SPECIAL_NAMES)}) | JSON_ANY
    files["tokenizer_config.json"] = json_text(draw(st.fixed_dictionaries({}, optional={
        "bos_token": token, "eos_token": token, "pad_token": token, "sot_token": token,
        "eot_token": token, "chat_template": TEMPLATES | JSON_ANY,
        "extra_special_tokens": JSON_ANY})))
  elif config == "json":
    files["tokenizer_config.json"] = json_text(draw(JSON_ANY))
  elif config == "bytes":
    files["tokenizer_config.json"] = draw(st.binary(max_size=20))
  template = draw(st.sampled_from(["jinja", "jinja_bytes", "json", "absent", "absent"]))
  if template == "jinja":
    files["chat_template.jinja"] = draw(TEMPLATES).encode("utf-8", "surrogatepass")
  elif template == "jinja_bytes":
    files["chat_template.jinja"] = draw(st.binary(max_size=20))
  elif template == "json":
    files["chat_template.json"] = json_text(draw(st.fixed_dictionaries(
        {}, optional={"chat_template": TEMPLATES | JSON_ANY})) if draw(st.booleans())
        else draw(JSON_ANY))
  return files


@settings(max_examples=60)
@given(data=st.data())
@example(data=None)  # the explicit examples below: `files` given, no draws
def test_tokenizer_directory_loads_or_names_it(scratch, good_tokenizer_files, data):
  files = data.draw(tokenizer_dirs(good_tokenizer_files)) if data is not None else {
      **good_tokenizer_files, "tokenizer_config.json": b"[1]"}
  directory = os.path.dirname(unique_path(scratch, "x"))
  for name, content in files.items():
    write_bytes(os.path.join(directory, name), content)
  conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "1 2"}]

  def use(path):
    tok = tokenizer_lib.load_tokenizer(path)
    tok.chat_prompt("hi")
    if tok.chat_template is not None:
      tok.render(conversation)
    return tok

  _, error = outcome(use, directory)
  for name, content in files.items():
    unchanged(os.path.join(directory, name), content)
  assert sorted(os.listdir(directory)) == sorted(files)  # nothing written
  if error is not None:
    check_one_line(error, directory)


@settings(max_examples=150)
@given(template=TEMPLATES, messages=CONVERSATIONS, add_generation_prompt=st.booleans())
@example(template="{{ 1 / 0 }}", messages=[{"role": "user", "content": "hi"}],
         add_generation_prompt=False)
@example(template="{{ messages[0]['content'] + 1 }}", messages=[{"role": "user", "content": "hi"}],
         add_generation_prompt=False)
def test_chat_template_renders_or_says_why(template, messages, add_generation_prompt):
  text, error = outcome(chat_template.render, template, messages,
                        {"bos_token": "<bos>", "eos_token": "<eos>"}, add_generation_prompt)
  if error is not None:
    check_one_line(error, any_of=("chat template", "conversation"))
  else:
    assert isinstance(text, str)


# ----------------------------------------------------------------------------- config overrides


def _leaf_keys(config, prefix=""):
  out = []
  for key, value in config.items():
    if hasattr(value, "items"):
      out += _leaf_keys(value, f"{prefix}{key}.")
    else:
      out.append(prefix + key)
  return out


TINY_KEYS = _leaf_keys(cli.parse_config(TINY, []))
KEYS = st.sampled_from(TINY_KEYS) | st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,2}",
                                                  fullmatch=True)


def config_outcome(config_path: str, overrides: list[str]):
  """What train.py checks before writing anything: the overrides parsed into the config,
  then the config validated and its task built."""
  config = cli.parse_config(config_path, overrides)
  return loop.prepare_config(config, None, None)


@settings(max_examples=150)
@given(pairs=st.lists(st.tuples(KEYS, VALUE_TEXT), min_size=1, max_size=2))
@example(pairs=[("model.layer_types", "3")])
@example(pairs=[("", "3")])
@example(pairs=[("batch_size.x", "3")])
@example(pairs=[("a-b", "1")])
@example(pairs=[("a._", "0")])
def test_config_overrides_apply_or_name_the_key(pairs):
  overrides = [f"--config.{key}={value}" for key, value in pairs]
  _, error = outcome(config_outcome, TINY, overrides)
  if error is not None:
    # The line names one of the keys set (its last part at least) or the argument itself.
    # (Model dataclass checks name the key without its section, "layer_types".)
    leaves = tuple(k.split(".")[-1] for k, _ in pairs)
    check_one_line(error, any_of=tuple(k for k in (*leaves, *dict(pairs)) if len(k) > 2)
                   + tuple(f"'{k}'" for k, _ in pairs) + tuple(overrides))


# ----------------------------------------------------------------------------- --sampler.KEY=VALUE

SAMPLER_KEYS = st.sampled_from(sorted(f.name for f in dataclasses.fields(
    sampler.SamplerConfig))) | st.from_regex(r"[a-z_]{1,10}", fullmatch=True)


def sampler_outcome(workdir: str, raw: dict):
  """What eval.py and sample.py do with `--sampler.KEY=VALUE`: typed by the SamplerConfig
  field, then applied to the run's sampler (checked) as the run opens."""
  from diffgemma.training import loaded

  overrides = cli.typed_overrides(raw, sampler.SamplerConfig, "sampler")
  return loaded.open_run(workdir, **overrides)


@pytest.fixture(scope="module")
def sudoku_run_dir(tmp_path_factory):
  """A workdir holding a Sudoku run's config and no checkpoint: tools check their input
  against the run, then stop at the missing weights."""
  from configs import sft_sudoku

  workdir = str(tmp_path_factory.mktemp("sudoku_run"))
  checkpointing.save_config(workdir, sft_sudoku.get_config())
  return workdir


@settings(max_examples=120)
@given(raw=st.dictionaries(SAMPLER_KEYS, VALUE_TEXT, min_size=1, max_size=2))
@example(raw={"max_new_tokens": "40"})
def test_sampler_overrides_apply_or_name_the_key(sudoku_run_dir, raw):
  _, error = outcome(sampler_outcome, sudoku_run_dir, raw)
  if error is not None:
    check_one_line(error, any_of=tuple(raw))


# ----------------------------------------------------------------------------- the tools' command lines


def generated(strategy, max_examples: int) -> list:
  """`max_examples` values of `strategy`, drawn with the suite's (deterministic) profile, to
  run together in one process (`run_tool_cases`); a failing value is reported as it is."""
  drawn = []

  @settings(max_examples=max_examples, phases=[hypothesis.Phase.generate])
  @given(strategy)
  def draw(value):
    drawn.append(value)

  draw()
  return drawn


def flag(name, values):
  return values.map(lambda value: f"--{name}={value}")


CHAT_TRAIN = ["train.py", "--config=sft_chat", "--workdir={tmp}/chat_new"]
TRAIN = ["train.py", f"--config={TINY}", "--workdir={tmp}/new"]
PUZZLE = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"


def config_case(*overrides, needle):
  return (TRAIN + list(overrides), needle)


# (argv with {tmp} / {run} / {csv} for the fixture's paths, what the one line must contain):
# the hand-picked cases of the retired scripts/check_bad_inputs.py that need no trained run.
HAND_PICKED = [
    config_case("--config.batch_size=0", needle="batch_size"),
    config_case("--config.batch_size=abc", needle="batch_size"),
    config_case("--config.batch_size=2.5", needle="batch_size"),
    config_case("--config.optimizer.lr=-0.001", needle="optimizer.lr"),
    config_case("--config.optimizer.lr=0", needle="optimizer.lr"),
    config_case("--config.optimizer.lr=fast", needle="optimizer.lr"),
    config_case("--config.optimizer.lr=nan", needle="optimizer.lr"),
    config_case("--config.num_train_steps=10", "--config.optimizer.warmup_steps=50",
                needle="warmup_steps"),
    config_case("--config.num_train_steps=0", needle="num_train_steps"),
    config_case("--config.keep_checkpoints=0", needle="keep_checkpoints"),
    config_case("--config.checkpoint_every=0", needle="checkpoint_every"),
    config_case("--config.log_every=-1", needle="log_every"),
    config_case("--config.max_train_minutes=-5", needle="max_train_minutes"),
    config_case("--config.grad_accum_steps=3", needle="grad_accum_steps"),
    config_case("--config.optimizer.schedule=linear", needle="schedule"),
    config_case("--config.optimizer.b2=1.5", needle="optimizer.b2"),
    config_case("--config.optimizer.grad_clip=0", needle="grad_clip"),
    config_case("--config.loss.noise_schedule=cubic", needle="noise_schedule"),
    config_case("--config.loss.decoder_weighting=sqrt", needle="decoder_weighting"),
    config_case("--config.loss.self_conditioning_prob=2", needle="self_conditioning_prob"),
    config_case("--config.loss.decoder_weight=0", needle="both 0"),
    config_case("--config.data.prompt_format=words", needle="prompt_format"),
    config_case("--config.data.min_givens=10", needle="min_givens"),
    config_case("--config.data.seed=-1", needle="data.seed"),
    config_case("--config.model.num_kv_heads=0", needle="num_kv_heads"),
    config_case("--config.model.head_dim=7", needle="head_dim"),
    config_case("--config.model.moe_impl=magic", needle="moe_impl"),
    config_case("--config.model.param_dtype=float8", needle="param_dtype"),
    config_case("--config.model.vocab_size=8", needle="vocab_size"),
    config_case("--config.model.top_k_experts=9", needle="top_k_experts"),
    config_case("--config.sampler.max_new_tokens=40", needle="max_new_tokens"),
    config_case("--config.sampler.t_min=0.9", needle="t_min"),
    config_case("--config.eval.batch_size=0", needle="eval.batch_size"),
    config_case("--config.lora.enabled=True", "--config.lora.rank=0", needle="lora.rank"),
    config_case("--config.optimizer.lrr=1", needle="optimizer.lrr"),
    config_case("--config.model.layer_types=3", needle="layer_types"),
    (["train.py", "--config=nope", "--workdir={tmp}/new"], "nope"),
    (["train.py", "--config=/no/such/config.py", "--workdir={tmp}/new"], "not found"),
    (["train.py", f"--config={TINY}"], "--workdir"),
    (["train.py", f"--config={TINY}", "--workdir={csv}"], "workdir"),
    (TRAIN + ["--init_from={tmp}/nowhere"], "not found"),
    (TRAIN + ["--dry_run_images=1"], "--dry_run_images"),
    (["train.py", f"--config={TINY}", "--dry_run", "--dry_run_images=-1"], "--dry_run_images"),
    (["train.py", f"--config={TINY}", "--dry_run", "--dry_run_images=1"], "vision tower"),
    (CHAT_TRAIN, "data.train"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/notjson.jsonl"], "notjson.jsonl:2"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/noreply.jsonl"], "noreply.jsonl:2"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/role.jsonl"], "role.jsonl:2"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/surrogate.jsonl"], "surrogate.jsonl:2"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/role_list.jsonl"], "role_list.jsonl:2"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/ok.jsonl",
                   "--config.data.tokenizer={tmp}/tok_no_template"], "no chat template"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/long.jsonl", "--config.data.overflow=error"],
     "long.jsonl:2"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/longreply.jsonl", "--config.data.overflow=error"],
     "longreply.jsonl:2"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/ok.jsonl", "--config.data.eval_fraction=0.1",
                   "--config.data.eval={tmp}/ok.jsonl"], "not both"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/ok.jsonl", "--config.eval.metric=regex"],
     "answer_regex"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/ok.jsonl", "--config.data.weights=1,2"],
     "data.weights"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/image_missing.jsonl"], "image_missing.jsonl:2"),
    (CHAT_TRAIN + ["--config.data.train={tmp}/image_ok.jsonl"], "image_ok.jsonl:2"),
    (["eval.py", "--workdir={run}"], "--data"),
    (["eval.py", "--workdir={run}", "--data={tmp}/no.csv"], "not found"),
    (["eval.py", "--workdir={run}", "--data={tmp}"], "is a directory"),
    (["eval.py", "--workdir={run}", "--data={csv}", "--limit=0"], "--limit"),
    (["eval.py", "--workdir={run}", "--data={csv}", "--batch_size=0"], "--batch_size"),
    (["eval.py", "--workdir={run}", "--data={csv}", "--batch_size=-4"], "--batch_size"),
    (["eval.py", "--workdir={run}", "--init_from={run}", "--data={csv}"], "not both"),
    (["eval.py", "--workdir={tmp}/nothing", "--data={csv}"], "no training run"),
    (["eval.py", "--init_from={tmp}/nowhere", "--data={csv}"], "not found"),
    (["eval.py", "--workdir={run}", "--data={tmp}/header.csv"], "expected header"),
    (["eval.py", "--workdir={run}", "--data={tmp}/bad_solution.csv"], "line 2"),
    (["eval.py", "--workdir={run}", "--data={tmp}/empty.csv"], "empty"),
    (["eval.py", "--workdir={run}", "--data={tmp}/none.csv"], "no examples"),
    (["eval.py", "--workdir={run}", "--data={csv}", "--sampler.t_maxx=1"], "t_maxx"),
    (["eval.py", "--workdir={run}", "--data={csv}", "--scan=sampler.t_max=a"], "t_max"),
    (["eval.py", "--workdir={run}", "--data={csv}", "--scan=sampler.t_max=0.5,0.6",
      "--out={csv}"], "is a file"),
    (["eval.py", "--workdir={run}", "--data={csv}", "--predictions={tmp}"], "is a directory"),
    (["sample.py", "--workdir={run}", "--puzzle=55" + "." * 79], "given twice"),
    (["sample.py", "--workdir={run}", "--puzzle=12345678." + "." * 8 + "9" + "." * 63],
     "no solution"),
    (["sample.py", "--workdir={run}", "--puzzle=" + "1" * 80], "80"),
    (["sample.py", "--workdir={run}", "--puzzle=x" + PUZZLE[1:]], "'x'"),
    (["sample.py"], "--workdir"),
    (["sample.py", "--workdir={run}", "--prompt=hi"], "expected 81"),
    (["sample.py", "--workdir={tmp}/nothing", "--puzzle=" + PUZZLE], "no training run"),
    (["sample.py", "--init_from={tmp}/nowhere", "--prompt=hi"], "not found"),
    (["sample.py", "--init_from={run}", "--prompt=hi", "--max_new_tokens=0"], "max_new_tokens"),
    (["sample.py", "--init_from={run}", "--prompt= "], "empty"),
    (["sample.py", "--init_from={run}", "--prompt=hi", "--dtype=int8"], "dtype"),
    (["scripts/convert_checkpoint.py", "--from={tmp}/nowhere", "--to={tmp}/out"], "not found"),
    (["scripts/convert_checkpoint.py", "--from={run}"], "--to"),
    (["scripts/convert_checkpoint.py", "--from={run}", "--to={tmp}"], "already exists"),
    (["scripts/convert_checkpoint.py", "--from={run}", "--to={tmp}/out", "--format=gguf"],
     "format"),
    (["scripts/convert_checkpoint.py", "--from={run}", "--to={tmp}/out", "--max_shard_gb=0"],
     "max_shard_gb"),
    (["scripts/convert_checkpoint.py", "--from={run}", "--to={tmp}/out", "--canvas_length=0"],
     "canvas_length"),
    (["scripts/convert_checkpoint.py", "--from={tmp}/empty_dir", "--to={tmp}/out"],
     "config.json"),
    (["scripts/make_sudoku_csv.py", "--out={tmp}/x.csv", "--num=0"], "--num"),
    (["scripts/make_sudoku_csv.py", "--out={tmp}/x.csv", "--min_givens=10"], "min_givens"),
    (["scripts/make_sudoku_csv.py", "--out={tmp}/x.csv", "--min_givens=50", "--max_givens=40"],
     "min_givens"),
    (["scripts/make_sudoku_csv.py", "--out={tmp}", "--num=1"], "is a directory"),
    (["scripts/make_sudoku_csv.py", "--out={csv}/x.csv", "--num=1"], "is a file"),
    (["scripts/make_chat_task.py", "--task=sort", "--num=2", "--out={tmp}"], "is a directory"),
    (["scripts/make_sudoku_csv.py"], "--out"),
    (["scripts/print_scalars.py", "--workdir={tmp}/nothing"], "no scalars"),
    (["scripts/make_chat_task.py", "--task=add", "--num=2", "--out={tmp}/t.jsonl"], "--task"),
    (["scripts/convert_gsm8k.py", "--train={tmp}/gsm.jsonl", "--out_dir={tmp}/gsm_out"],
     "gsm.jsonl:1"),
    (["scripts/convert_gsm8k.py", "--train={tmp}/gsm.jsonl", "--out_dir={csv}/gsm_out"],
     "is a file"),
]
SECTIONS = {"eval.py": ["sampler"], "sample.py": ["sampler"]}


def chat_line(user, assistant):
  messages = [{"role": "user", "content": user}]
  if assistant is not None:
    messages.append({"role": "assistant", "content": assistant})
  return json.dumps({"messages": messages})


def image_line(path, question="What colour?", answer="red"):
  return json.dumps({"messages": [
      {"role": "user", "content": [{"type": "image", "path": path},
                                   {"type": "text", "text": question}]},
      {"role": "assistant", "content": answer}]})


def make_input_files(tmp: str) -> dict:
  """The files the command lines read: a run (config, no checkpoint), CSVs, JSONL files,
  a tokenizer without a chat template; returns the paths for the argv templates."""
  run_dir = os.path.join(tmp, "run")
  from configs import sft_sudoku

  checkpointing.save_config(run_dir, sft_sudoku.get_config())
  paths = {"tmp": tmp, "run": run_dir, "csv": os.path.join(tmp, "p.csv")}
  sudoku_puzzles.write_csv(paths["csv"], _PUZZLES[:2], _SOLUTIONS[:2])
  bad_solution = GOOD_ROWS[0][:-1] + (b"1" if GOOD_ROWS[0][-1:] != b"1" else b"2")
  good = chat_line("Count from 1 to 3.", "1 2 3")
  files = {
      "header.csv": b"a,b\n1,2\n", "empty.csv": b"", "none.csv": HEADER + b"\n",
      "bad_solution.csv": HEADER + b"\n" + bad_solution + b"\n",
      "ok.jsonl": good + "\n", "notjson.jsonl": good + "\n{not json\n",
      "noreply.jsonl": good + "\n" + chat_line("hi", None) + "\n",
      "role.jsonl": good + "\n" + json.dumps({"messages": [
          {"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}) + "\n",
      "surrogate.jsonl": good + "\n" + chat_line("hi\ud800", "1") + "\n",
      "role_list.jsonl": good + "\n" + json.dumps({"messages": [
          {"role": ["user"], "content": "hi"}, {"role": "assistant", "content": "1"}]}) + "\n",
      "long.jsonl": good + "\n" + chat_line("Count " * 40, "1") + "\n",
      "longreply.jsonl": good + "\n" + chat_line("hi", "1 " * 200) + "\n",
      "gsm.jsonl": json.dumps({"question": "1+1?", "answer": "2"}) + "\n",
      # An image the file names is missing; a good image for a model without a vision tower.
      "image_missing.jsonl": good + "\n" + image_line("images/none.png") + "\n",
      "image_ok.jsonl": good + "\n" + image_line("images/ok.png") + "\n"}
  for name, content in files.items():
    write_bytes(os.path.join(tmp, name), content if isinstance(content, bytes)
                else content.encode())
  os.makedirs(os.path.join(tmp, "empty_dir"))
  write_png(os.path.join(tmp, "images", "ok.png"), 16, 24)
  write_tokenizer_json(os.path.join(tmp, "tok_no_template"))
  return paths


def eval_argvs(p: dict):
  paths = st.sampled_from([p["run"], p["csv"], f"{p['tmp']}/missing", f"{p['tmp']}/empty_dir"])
  data = st.sampled_from([p["csv"], f"{p['tmp']}/header.csv", f"{p['tmp']}/bad_solution.csv",
                          f"{p['tmp']}/ok.jsonl", p["tmp"], f"{p['tmp']}/missing.csv"])
  sampler_flag = st.tuples(SAMPLER_KEYS, VALUE_TEXT).map(lambda kv: f"--sampler.{kv[0]}={kv[1]}")
  one = st.one_of(
      flag("workdir", paths), flag("init_from", paths), flag("data", data),
      flag("limit", VALUE_TEXT), flag("batch_size", VALUE_TEXT), flag("seed", VALUE_TEXT),
      flag("metric", st.sampled_from(["exact", "regex", "gsm8k", "nope"]) | TEXT),
      flag("answer_regex", st.sampled_from(["(", r"(\d+)"]) | TEXT),
      flag("quantize", st.sampled_from(["int8", "int3", ""])),
      flag("sweep", st.sampled_from(["sampler.t_max=0.5,0.6", "sampler.nope=1", "t_max=1",
                                     "sampler.t_max=", "sampler.entropy_bound=x"])),
      flag("out", st.just(f"{p['tmp']}/sweep_out")), flag("seen_in", data), sampler_flag,
      st.sampled_from(["--trajectory_stats", "--nosuch=1", "--sampler.", "--config=sft_chat",
                       "--config=nope", "--sampler.t_max"]))
  # Mostly a run and a data file, so that most cases get past the first checks.
  base = st.sampled_from([[], [f"--workdir={p['run']}", f"--data={p['csv']}"],
                          [f"--workdir={p['run']}"], [f"--init_from={p['run']}"]])
  return st.tuples(base, st.lists(one, max_size=3)).map(lambda t: ["eval.py", *t[0], *t[1]])


def sample_argvs(p: dict):
  paths = st.sampled_from([p["run"], f"{p['tmp']}/missing", f"{p['tmp']}/empty_dir", p["csv"]])
  one = st.one_of(
      flag("workdir", paths), flag("init_from", paths), flag("puzzle", puzzle_texts()),
      flag("prompt", TEXT | st.sampled_from(["hi", " ", "\udcff"])),
      flag("max_new_tokens", VALUE_TEXT), flag("dtype", st.sampled_from(["float32", "int8"])),
      flag("trace", st.sampled_from([f"{p['tmp']}/t.html", f"{p['tmp']}/t.txt",
                                     f"{p['tmp']}/no/dir/t.html"])),
      flag("infill_prefix", TEXT), flag("infill_suffix", TEXT),
      flag("infill_length", VALUE_TEXT), flag("warm_runs", VALUE_TEXT),
      flag("quantize", st.sampled_from(["int4", "int2"])), flag("seed", VALUE_TEXT),
      st.tuples(SAMPLER_KEYS, VALUE_TEXT).map(lambda kv: f"--sampler.{kv[0]}={kv[1]}"),
      st.sampled_from(["--chat", "--nochat", "--nosuch"]))
  base = st.sampled_from([[], [f"--workdir={p['run']}", f"--puzzle={PUZZLE}"],
                          [f"--init_from={p['run']}", "--prompt=hi"], [f"--workdir={p['run']}"]])
  return st.tuples(base, st.lists(one, max_size=3)).map(lambda t: ["sample.py", *t[0], *t[1]])


@pytest.fixture(scope="module")
def tool_outcomes(tmp_path_factory):
  """Every command line of this section, run in one process: [(kind, argv, needle or None,
  outcome)], plus the input paths and a listing of the input directory before the runs."""
  tmp = str(tmp_path_factory.mktemp("tools"))
  p = make_input_files(tmp)
  cases = [("hand-picked", [a.format(**p) for a in argv], needle) for argv, needle in HAND_PICKED]
  cases += [("eval.py generated", argv, None) for argv in generated(eval_argvs(p), 60)]
  cases += [("sample.py generated", argv, None) for argv in generated(sample_argvs(p), 60)]
  before = {name: open(os.path.join(tmp, name), "rb").read() for name in os.listdir(tmp)
            if os.path.isfile(os.path.join(tmp, name))}
  listing = sorted(os.listdir(tmp))
  groups = [(argv[0], SECTIONS.get(argv[0], []), [argv[1:]]) for _, argv, _ in cases]
  results = [group[0] for group in run_tool_cases(groups)]
  return p, before, listing, [(kind, argv, needle, r)
                              for (kind, argv, needle), r in zip(cases, results)]


def error_lines(outcome_: dict) -> list[str]:
  return [l for l in outcome_["stderr"].splitlines() if l.strip()]


@pytest.mark.parametrize("kind", ["hand-picked", "eval.py generated", "sample.py generated"])
def test_every_command_line_ends_in_one_line_and_writes_nothing(tool_outcomes, kind):
  p, before, listing, outcomes = tool_outcomes
  problems = []
  mine = [o for o in outcomes if o[0] == kind]
  for _, argv, needle, r in mine:
    lines = error_lines(r)
    line = lines[0] if lines else ""
    wrong = []
    if r["traceback"] or "Traceback" in r["stderr"]:
      wrong.append("traceback " + r["traceback"][-600:])
    if r["code"] != 2:
      wrong.append(f"exit {r['code']}")
    if len(lines) != 1 or not line.startswith("error: "):
      wrong.append(f"{len(lines)} stderr lines: {lines[:3]}")
    # The line names a flag given (or one to add), a config / sampler key, or a path given.
    flags_given = [a.split("=", 1)[0] for a in argv[1:]]
    named = [needle] if needle else [*flags_given, *(f.rpartition(".")[2] for f in flags_given),
                                     *(f"'{f.lstrip('-')}'" for f in flags_given),
                                     *(a.split("=", 1)[1] for a in argv[1:] if "=" in a),
                                     p["run"], "--"]
    if not any(n and n in line for n in named):
      wrong.append(f"names none of {named[:6]}")
    if wrong:
      problems.append(f"{argv}: {'; '.join(wrong)}: {line}")
  seconds = sum(r["seconds"] for *_, r in mine)
  slowest = max(mine, key=lambda o: o[3]["seconds"])
  print(f"{kind}: {len(mine)} command lines in {seconds:.1f} s (slowest {slowest[1][:4]}: "
        f"{slowest[3]['seconds']:.1f} s), {len(mine) - len(problems)} hold the contract")
  assert not problems, "\n".join(problems)
  assert sorted(os.listdir(p["tmp"])) == listing  # nothing written (no workdir, no CSV, ...)
  for name, content in before.items():
    unchanged(os.path.join(p["tmp"], name), content)
  assert os.listdir(p["run"]) == ["config.json"]


