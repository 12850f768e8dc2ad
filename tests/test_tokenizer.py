"""The checkpoint tokenizer against transformers' own loading of the same files, and sample.py's
text mode end to end on a tiny checkpoint.

Each test builds its tokenizer: a Gemma-like BPE `tokenizer.json` (the `tokenizers` package) or a
tiny SentencePiece model, with Gemma's special ids (<pad> 0, <eos> 1, <bos> 2) and turn markers.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer, GemmaTokenizer

from diffgemma.io import tokenizer as tokenizer_lib
from tests.helpers import ROOT, one_line_error, run_in_one_process
from tests.helpers import SPECIALS, write_tokenizer_json, write_sentencepiece  # noqa: F401 (re-exported)

TEXT = "hello world, the lazy fox"

# Gemma 4's generation prompt, written as its templates write it (the 26B-A4B's adds the empty
# thought channel when thinking is off; `thought_channel` switches that part on).
GEMMA4_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{{- '<|turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' -}}"
    "{{- m['content'] | trim -}}{{- '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}"
    "THOUGHT"
    "{%- endif -%}")
EMPTY_THOUGHT = ("{%- if not enable_thinking | default(false) -%}"
                 "{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}")
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")






def reference_chat_ids(hf_tokenizer, text):
  return list(hf_tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=False))


def test_tokenizer_json_matches_transformers(tmp_path):
  d = write_tokenizer_json(tmp_path, template=GEMMA4_TEMPLATE.replace("THOUGHT", ""))
  tok = tokenizer_lib.load_tokenizer(d)
  ref = AutoTokenizer.from_pretrained(d)
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ref.bos_token_id, ref.eos_token_id,
                                                  ref.pad_token_id)
  assert tok.vocab_size == 64
  assert (tok.start_of_turn, tok.end_of_turn) == tokenizer_lib.GEMMA4_TURN
  assert tok.eot_id == ref.convert_tokens_to_ids("<turn|>") == 5
  assert tok.stop_ids == (1, 5)
  for text in (TEXT, "how are you?\nthe dog", " leading and trailing  ", "<|turn>user"):
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False), text
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
  assert tok.decode(tok.encode(TEXT)) == TEXT
  # Specials are dropped unless asked for; ids outside the vocabulary are ignored.
  ids = [tok.bos_id] + tok.encode(TEXT) + [tok.eos_id, 1000]
  assert tok.decode(ids) == TEXT
  assert tok.decode(ids, skip_special_tokens=False) == "<bos>" + TEXT + "<eos>"


def test_chat_prompt_gemma4_exact(tmp_path):
  d = write_tokenizer_json(tmp_path, template=GEMMA4_TEMPLATE.replace("THOUGHT", ""))
  tok = tokenizer_lib.load_tokenizer(d)
  ids = tok.chat_prompt("  hello world \n")
  sot, eot = tok.token_to_id("<|turn>"), tok.token_to_id("<turn|>")
  expected = ([tok.bos_id, sot] + tok.encode("user\nhello world") + [eot] + tok.encode("\n") +
              [sot] + tok.encode("model\n"))
  assert ids == expected
  assert tok.decode(ids, skip_special_tokens=False) == (
      "<bos><|turn>user\nhello world<turn|>\n<|turn>model\n")
  assert tok.generation_suffix == ""
  assert ids == reference_chat_ids(AutoTokenizer.from_pretrained(d), "  hello world \n")


def test_chat_prompt_empty_thought_channel(tmp_path):
  """A template that opens the model turn with an empty thought channel (Gemma 4 26B-A4B,
  thinking off) gets it in the prompt too."""
  d = write_tokenizer_json(tmp_path, template=GEMMA4_TEMPLATE.replace("THOUGHT", EMPTY_THOUGHT))
  tok = tokenizer_lib.load_tokenizer(d)
  assert tok.generation_suffix == "<|channel>thought\n<channel|>"
  ids = tok.chat_prompt(TEXT)
  assert tok.decode(ids, skip_special_tokens=False).endswith(
      "<|turn>model\n<|channel>thought\n<channel|>")
  assert ids == reference_chat_ids(AutoTokenizer.from_pretrained(d), TEXT)


def test_chat_markers_from_template_and_config(tmp_path):
  specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<|turn>",
              "<turn|>"]
  # Gemma 2/3 markers, read off the template although the vocabulary has both pairs.
  d = write_tokenizer_json(tmp_path / "g3", specials=specials, template=GEMMA3_TEMPLATE)
  tok = tokenizer_lib.load_tokenizer(d)
  assert (tok.start_of_turn, tok.end_of_turn) == tokenizer_lib.GEMMA3_TURN
  assert tok.stop_ids == (1, 5)
  assert tok.chat_prompt(TEXT) == reference_chat_ids(AutoTokenizer.from_pretrained(d), TEXT)
  # Named in tokenizer_config.json (Gemma 4's sot_token / eot_token): those win.
  d = write_tokenizer_json(tmp_path / "named", specials=specials,
                           config_extra={"sot_token": "<start_of_turn>",
                                         "eot_token": {"content": "<end_of_turn>"}})
  assert tokenizer_lib.load_tokenizer(d).end_of_turn == "<end_of_turn>"
  # No template, no names: the pair the vocabulary has; Gemma 4's first.
  d = write_tokenizer_json(tmp_path / "vocab", specials=specials)
  assert tokenizer_lib.load_tokenizer(d).start_of_turn == "<|turn>"


def test_sentencepiece_matches_transformers(tmp_path):
  d = write_sentencepiece(tmp_path, template=GEMMA4_TEMPLATE.replace("THOUGHT", ""))
  tok = tokenizer_lib.load_tokenizer(d)
  # transformers converts the same tokenizer.model to its fast tokenizer.
  ref = GemmaTokenizer.from_pretrained(d)
  assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
  assert tok.eot_id == ref.convert_tokens_to_ids("<turn|>")
  assert tok.stop_ids == (1, tok.eot_id)
  for text in (TEXT, "how are you?\nthe dog", "a canvas  of tokens "):
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False), text
    assert tok.decode(ids) == text
  ids = tok.chat_prompt(" hello world ")
  assert ids == reference_chat_ids(ref, " hello world ")
  assert tok.decode(ids) == "user\nhello world\nmodel\n"  # markers dropped as special


def test_tokenizer_json_preferred_over_sentencepiece(tmp_path):
  write_sentencepiece(tmp_path)
  write_tokenizer_json(tmp_path)
  assert tokenizer_lib.load_tokenizer(tmp_path).vocab_size == 64


def test_missing_and_malformed_tokenizer(tmp_path):
  with pytest.raises(tokenizer_lib.TokenizerError, match=re.escape(str(tmp_path))) as e:
    tokenizer_lib.load_tokenizer(tmp_path)
  assert "tokenizer.json" in str(e.value) and "\n" not in str(e.value)
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(tokenizer_lib.TokenizerError, match="cannot read") as e:
    tokenizer_lib.load_tokenizer(tmp_path)
  assert "\n" not in str(e.value)
  # Files of the wrong shape were tracebacks (AttributeError, UnicodeDecodeError).
  good = write_tokenizer_json(tmp_path / "shapes")
  for name, content in (("tokenizer_config.json", b"[1]"), ("chat_template.json", b'"x"'),
                        ("chat_template.jinja", b"\xff{{ x }}")):
    (tmp_path / "shapes" / name).write_bytes(content)
    with pytest.raises(tokenizer_lib.TokenizerError, match=f"cannot read .*{name}") as e:
      tokenizer_lib.load_tokenizer(good)
    assert "\n" not in str(e.value)
    os.remove(tmp_path / "shapes" / name)
  # A vocabulary without turn markers loads, but cannot build a chat prompt.
  d = write_tokenizer_json(tmp_path / "plain", specials=SPECIALS[:4])
  tok = tokenizer_lib.load_tokenizer(d)
  assert tok.eot_id is None and tok.stop_ids == (1,)
  with pytest.raises(tokenizer_lib.TokenizerError, match="<|turn>"):
    tok.chat_prompt(TEXT)


# ----------------------------------------------------------------------------- sample.py


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  """A tiny random DiffusionGemma in transformers' format with a 64-id tokenizer beside it."""
  from tests import reference

  d = str(tmp_path_factory.mktemp("ckpt"))
  reference.tiny_reference(seed=0, canvas_length=8, num_hidden_layers=2,
                           layer_types=["sliding_attention", "full_attention"]).save_pretrained(d)
  write_tokenizer_json(d, template=GEMMA4_TEMPLATE.replace("THOUGHT", ""))
  return d


SUMMARY = re.compile(r"^\[(\d+) prompt tokens, (\d+) generated \((.*)\); TPF ([\d.]+); "
                     r"(\d+) canvases, ([\d.]+) steps per canvas; .*\]$")


def run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, *args], check=False, cwd=ROOT, capture_output=True,
                        text=True, env=env, timeout=300)


def test_sample_text_end_to_end(checkpoint, tmp_path):
  """sample.py's reply = our sampler run here on the same chat prompt, cut at the first stop id.
  The checkpoint's generation_config.json names an extra EOS: a token the sampler emits early in
  the first canvas, so the reply ends there (denoising never reads the stop ids)."""
  import jax
  import numpy as np

  from diffgemma.io import model_dirs
  from diffgemma.sampling import sampler

  prompt, max_new, seed = "hello world, how are you?", 16, 3
  tok = tokenizer_lib.load_tokenizer(checkpoint)
  model_cfg, params = model_dirs.load_model(checkpoint)
  sampler_cfg = sampler.SamplerConfig(max_new_tokens=max_new, stop_token_ids=tok.stop_ids)
  prompt_1xP = np.asarray([tok.chat_prompt(prompt)], np.int32)
  args = (prompt_1xP, np.ones_like(prompt_1xP, bool), jax.random.PRNGKey(seed))
  generate = jax.jit(sampler.generate, static_argnums=(1, 2)).lower(
      params, model_cfg, sampler_cfg, *args).compile()
  tokens = [int(t) for t in jax.device_get(generate(params, *args)).tokens[0]]
  first_canvas = tokens[:model_cfg.canvas_length]
  # The first token from position 2 on that has not appeared before it.
  stop = next(t for j, t in enumerate(first_canvas) if j >= 2 and t not in first_canvas[:j]
              and t != model_cfg.pad_token_id)
  end = next(j for j, t in enumerate(tokens) if t in set(tok.stop_ids) | {stop})
  reply = tok.decode([t for t in tokens[:end] if t != model_cfg.pad_token_id])

  d = shutil.copytree(checkpoint, tmp_path / "ckpt")
  with open(d / "generation_config.json", "w") as f:
    json.dump({"eos_token_id": [model_cfg.eos_token_id, stop]}, f)
  r = run("sample.py", f"--init_from={d}", f"--prompt={prompt}", f"--max_new_tokens={max_new}",
          f"--seed={seed}")
  assert r.returncode == 0, r.stderr
  summary = SUMMARY.match(r.stdout.rstrip("\n").splitlines()[-1])
  assert summary, r.stdout
  assert r.stdout.endswith(reply + "\n" + summary.group(0) + "\n"), (reply, r.stdout)
  num_prompt, num_generated, ended, tpf, canvases, _ = summary.groups()
  assert int(num_prompt) == prompt_1xP.shape[1]
  assert int(num_generated) == sum(t != model_cfg.pad_token_id for t in tokens[:end + 1])
  token = tok.decode([tokens[end]], skip_special_tokens=False)
  assert ended == f"stopped at {token!r}" and int(canvases) == 1 and float(tpf) > 0


def test_sample_plain_text(checkpoint):
  """--chat=false: BOS + the text, no turn markers."""
  prompt = "hello world, how are you?"
  r = run("sample.py", f"--init_from={checkpoint}", f"--prompt={prompt}", "--max_new_tokens=8",
          "--chat=false")
  assert r.returncode == 0, r.stderr
  summary = SUMMARY.match(r.stdout.rstrip("\n").splitlines()[-1])
  assert summary, r.stdout
  tok = tokenizer_lib.load_tokenizer(checkpoint)
  assert int(summary.group(1)) == 1 + len(tok.encode(prompt))


def test_sample_text_trace(checkpoint, tmp_path):
  """--trace=FILE.html: one table row per denoising step the reply took (canvases x steps per
  canvas, as the summary line reports them), each with a canvas of tokens."""
  import html.parser

  class Rows(html.parser.HTMLParser):
    def __init__(self):
      super().__init__()
      self.rows, self.tokens = 0, 0

    def handle_starttag(self, tag, attrs):
      classes = (dict(attrs).get("class") or "").split()
      self.rows += tag == "tr" and "step" in classes
      self.tokens += tag == "span" and "tok" in classes and self.rows > 0

  trace = tmp_path / "reply.html"
  r = run("sample.py", f"--init_from={checkpoint}", "--prompt=hello world", "--max_new_tokens=16",
          f"--trace={trace}")
  assert r.returncode == 0, r.stderr
  summary = next(SUMMARY.match(l) for l in r.stdout.splitlines() if SUMMARY.match(l))
  canvases, steps_per_canvas = int(summary.group(5)), float(summary.group(6))
  steps = round(canvases * steps_per_canvas)
  rows = Rows()
  rows.feed(trace.read_text(encoding="utf-8"))
  assert rows.rows == steps and rows.tokens == 8 * steps  # canvas_length 8
  assert r.stdout.rstrip().endswith(f"trace: {trace} ({steps} denoising steps)")
  one_line_error(run("sample.py", f"--init_from={checkpoint}", "--prompt=hi",
                     f"--trace={tmp_path / 'reply.gif'}"), "--trace", ".html")


def test_sample_text_errors(checkpoint, tmp_path):
  one_line_error(run("sample.py", f"--init_from={checkpoint}", "--prompt=  "), "empty")
  # The tiny model's context is 512 positions; checked before the weights load.
  one_line_error(run("sample.py", f"--init_from={checkpoint}", "--prompt=" + "hello " * 600),
                 "longer than the model's context of 512")
  one_line_error(run("sample.py", f"--init_from={tmp_path}", "--prompt=hi"), str(tmp_path),
                 "tokenizer")
  one_line_error(run("sample.py", f"--init_from={checkpoint}", "--prompt=hi",
                     "--puzzle=" + "." * 81), "not both")
  one_line_error(run("sample.py", f"--init_from={checkpoint}"), "--prompt")


def test_sample_thinking(checkpoint, tmp_path):
  """--thinking: the prompt in the template's thinking mode (this template then leaves out the
  empty thought channel); one-line errors where there is no thinking mode to ask for."""
  d = shutil.copytree(checkpoint, tmp_path / "thinking")
  (d / "chat_template.jinja").write_text(GEMMA4_TEMPLATE.replace("THOUGHT", EMPTY_THOUGHT))
  prompt = "hello world"
  argvs = [["sample.py", f"--init_from={d}", f"--prompt={prompt}", "--thinking",
            "--max_new_tokens=8", "--warm_runs=0"],
           ["sample.py", f"--init_from={checkpoint}", f"--prompt={prompt}", "--thinking"],
           ["sample.py", f"--init_from={d}", f"--prompt={prompt}", "--thinking", "--chat=false"],
           ["sample.py", f"--workdir={tmp_path}", f"--prompt={prompt}", "--thinking"],
           ["sample.py", "--thinking", "--help"]]
  (code, out, err), *errors, (help_code, help_text, _) = run_in_one_process(argvs)
  assert code == 0, err
  assert help_code == 0 and "--[no]thinking: Text mode: render the prompt" in help_text
  tok = tokenizer_lib.load_tokenizer(d)
  thinking = tok.chat_prompt(prompt, enable_thinking=True)
  assert len(thinking) < len(tok.chat_prompt(prompt))  # the empty channel is gone
  assert int(SUMMARY.match(out.rstrip("\n").splitlines()[-1]).group(1)) == len(thinking)
  for (code, _, err), needles in zip(errors, [("--thinking", "no thinking mode"),
                                              ("thinking mode", "--chat"),
                                              ("--thinking", "--init_from")]):
    one_line_error(subprocess.CompletedProcess([], code, "", err), *needles)
