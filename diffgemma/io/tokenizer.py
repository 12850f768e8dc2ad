r"""The Gemma tokenizer of a checkpoint directory, a byte-level tokenizer, and chat rendering.

A transformers-format checkpoint ships `tokenizer.json` (read with the `tokenizers` package); the
`gemma` package and older exports ship a SentencePiece `tokenizer.model` (read with
`sentencepiece`); `load_tokenizer("bytes")` is a byte-level tokenizer for from-scratch research
models (PAD 0, EOS 1, BOS 2, Gemma 4's turn markers 3 and 4, then the 256 bytes) with a
Gemma-4-style chat template of its own (`BYTES_CHAT_TEMPLATE`); `load_tokenizer("bytes_image")`
is the same plus Gemma 4's three image tokens after the bytes (261-263), for from-scratch models
with a vision tower. All give the same small interface: `encode`, `decode`, the special ids,
`render` (a conversation through the chat template, tokenized as `apply_chat_template(...,
tokenize=True)` does; diffgemma/io/chat_template.py; with images, their placeholders expanded as
transformers' processor does) and `chat_prompt`, one user message with the generation prompt
(`apply_chat_template(..., add_generation_prompt=True)`):

  <bos><|turn>user\n{text}<turn|>\n<|turn>model\n            (Gemma 4; Gemma 2/3 use
                                                               <start_of_turn> / <end_of_turn>)

The turn markers come from the checkpoint (`sot_token` / `eot_token` in tokenizer_config.json, or
the pair its chat template uses, or the pair its vocabulary has), falling back to Gemma 4's.
Without a chat template, `chat_prompt` writes the Gemma layout above itself and `render` fails.

Thinking (Gemma 4). `render` and `chat_prompt` pass the template `enable_thinking` (Gemma 4's
templates then open a system turn with <|think|>). A reply's thought is written in the thinking
channel, as Gemma 4's template writes it and the model generates it:

  <|channel>thought\n{thought}\n<channel|>{answer}<turn|>

(`thought_text`; the channel markers are `soc_token` / `eoc_token`, Gemma 4's by default).
A template has a thinking mode when it reads `enable_thinking`, and a thinking channel when it
writes `<|channel>thought`.

Image tokens (`image_tokens`): the boi / image / eoi tokens tokenizer_config.json names
(boi_token, image_token, eoi_token), else Gemma 4's (<|image>, <|image|>, <image|>) where the
vocabulary has them; None for a text-only tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from diffgemma import errors
from diffgemma.io import chat_template, image_processing

TOKENIZER_JSON = "tokenizer.json"
SENTENCEPIECE_MODEL = "tokenizer.model"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")

# Gemma 4's turn markers (tokenizer_config.json names them sot_token / eot_token), then the
# Gemma 2/3 pair; the first pair the checkpoint uses wins.
GEMMA4_TURN = ("<|turn>", "<turn|>")
GEMMA3_TURN = ("<start_of_turn>", "<end_of_turn>")
# Gemma 4's channel markers (soc_token / eoc_token): with thinking off, the 26B-A4B template
# opens the model turn with an empty thought channel.
GEMMA4_CHANNEL = ("<|channel>", "<channel|>")
THOUGHT_CHANNEL = "thought"  # the channel's name after its opening marker
THINKING_VARIABLE = "enable_thinking"  # the template variable of thinking mode
USER_ROLE, MODEL_ROLE = "user", "model"
_MARKERS = frozenset(GEMMA4_TURN + GEMMA3_TURN + GEMMA4_CHANNEL)
DEFAULT_SPECIALS = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
BYTES = "bytes"  # load_tokenizer's name for the byte-level tokenizer
BYTES_IMAGE = "bytes_image"  # the byte-level tokenizer with Gemma 4's image tokens
BUILT_IN = (BYTES, BYTES_IMAGE)

# The byte-level tokenizer's chat template: Gemma 4's turn layout (a system turn of its own,
# "model" for the assistant, contents trimmed; a content list's text parts trimmed and its image
# parts as the image token, as Gemma 4's template writes them) and its thinking mode:
# `enable_thinking` opens a system turn with <|think|> (the system message, if any, follows it),
# and an assistant turn after the last user turn writes its thought in the thinking channel
# (earlier turns' thoughts are dropped, as Gemma 4 drops them from the history). Its markers are
# plain bytes here.
BYTES_CHAT_TEMPLATE = """{%- macro render_content(content) -%}
  {%- if content is string -%}
    {{- content | trim -}}
  {%- else -%}
    {%- for item in content -%}
      {%- if item['type'] == 'text' -%}
        {{- item['text'] | trim -}}
      {%- elif item['type'] == 'image' -%}
        {{- '<|image|>' -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{{- bos_token -}}
{%- set thinking = enable_thinking is defined and enable_thinking -%}
{%- if thinking -%}
  {{- '<|turn>system\\n<|think|>\\n' -}}
  {%- if messages and messages[0]['role'] == 'system' -%}
    {{- render_content(messages[0]['content']) -}}
  {%- endif -%}
  {{- '<turn|>\\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
  {%- if message['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
  {%- if message['role'] not in ['system', 'user', 'assistant'] -%}
    {{- raise_exception('unknown role ' + message['role'] + '; use system, user or assistant') -}}
  {%- endif -%}
  {%- if not (thinking and loop.first and message['role'] == 'system') -%}
    {{- '<|turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' -}}
    {%- set thought = message.get('reasoning_content') -%}
    {%- if message['role'] == 'assistant' and thought and loop.index0 > ns.last_user -%}
      {{- '<|channel>thought\\n' + thought + '\\n<channel|>' -}}
    {%- endif -%}
    {{- render_content(message['content']) -}}
    {{- '<turn|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|turn>model\\n' -}}
{%- endif -%}
"""


class TokenizerError(errors.InputError):
  """A missing or unusable tokenizer; the message is one line and names the directory."""


class Tokenizer:
  """Gemma tokenizer over a `tokenizers` or `sentencepiece` backend.

  Attributes:
    directory: where it was loaded from.
    vocab_size: number of ids the tokenizer knows (added tokens included).
    bos_id, eos_id, pad_id: the special ids.
    start_of_turn, end_of_turn: the chat turn markers (token strings).
    eot_id: id of `end_of_turn`, a stop token for chat replies; None if the vocabulary lacks it.
    generation_suffix: text the chat template adds after the model-turn opening with thinking
      off ("" usually).
    chat_template: the template's jinja text (None if the directory has none).
    thinking_mode: the template reads `enable_thinking`.
    thinking_channel: (opening, closing) text around a thought (`thought_text`) when the template
      writes the thinking channel; None otherwise.
    template_variables: the special-token variables the template sees (bos_token, ...).
    image_tokens: the boi / image / eoi token strings (`image_processing.ImageTokens`); None
      for a tokenizer without them (text only).
    image_token_ids: their ids (boi, image, eoi), or None.
  """

  def __init__(self, backend, directory: str, config: dict[str, Any], template: str | None):
    self._backend = backend
    self.directory = directory
    self.vocab_size = backend.vocab_size
    ids = {}
    for name, default in DEFAULT_SPECIALS.items():
      token = _token_string(config.get(name)) or default
      ids[name] = backend.token_to_id(token)
      if ids[name] is None:
        raise TokenizerError(f"tokenizer in {directory} has no {name} {token!r}")
    self.bos_id, self.eos_id, self.pad_id = (
        ids["bos_token"], ids["eos_token"], ids["pad_token"])
    self.start_of_turn, self.end_of_turn = _turn_markers(config, template, backend.token_to_id)
    self.eot_id = backend.token_to_id(self.end_of_turn)
    self._channel = _channel_markers(config)
    self.generation_suffix = _generation_suffix(self._channel, template)
    self.chat_template = template
    self.thinking_mode = template is not None and THINKING_VARIABLE in template
    soc, eoc = self._channel
    self.thinking_channel = ((f"{soc}{THOUGHT_CHANNEL}\n", f"\n{eoc}")
                             if template is not None and f"{soc}{THOUGHT_CHANNEL}" in template
                             else None)
    self.template_variables = chat_template.special_token_variables(config, DEFAULT_SPECIALS)
    self.image_tokens = _image_tokens(config, backend.token_to_id)
    self.image_token_ids = None if self.image_tokens is None else tuple(
        backend.token_to_id(t) for t in dataclasses.astuple(self.image_tokens))

  def encode(self, text: str) -> list[int]:
    """Token ids of `text`, no BOS. Special-token strings in it become those tokens as in
    transformers (`tokenizer.json`: all added tokens; SentencePiece: user-defined pieces)."""
    return self._backend.encode(text)

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids`; ids outside the vocabulary (a model may have more) are dropped."""
    ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
    return self._backend.decode(ids, skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self._backend.token_to_id(token)

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Ids that end a reply: EOS, and the end-of-turn marker where the vocabulary has it."""
    return tuple(dict.fromkeys(i for i in (self.eos_id, self.eot_id) if i is not None))

  def render_text(self, messages: Sequence[Mapping[str, Any]],
                  add_generation_prompt: bool = False, enable_thinking: bool = False) -> str:
    """The chat template's text for `messages` (dicts with "role" and "content", an assistant
    turn's thought under "reasoning_content"), in thinking mode or not (the template variable
    `enable_thinking`, passed either way)."""
    if self.chat_template is None:
      raise TokenizerError(
          f"tokenizer in {self.directory} has no chat template: add chat_template.jinja (or a "
          f"chat_template entry in {TOKENIZER_CONFIG}) beside it")
    try:
      return chat_template.render(self.chat_template, messages, self.template_variables,
                                  add_generation_prompt,
                                  **{THINKING_VARIABLE: bool(enable_thinking)})
    except chat_template.ChatTemplateError as e:
      raise TokenizerError(f"{e} (tokenizer in {self.directory})") from e

  def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
             enable_thinking: bool = False,
             image_soft_tokens: Sequence[int] | None = None) -> list[int]:
    """Ids of `messages` through the chat template, as transformers' `apply_chat_template(...,
    tokenize=True)`: the rendered text tokenized without added special tokens (the template
    writes BOS), special-token strings in it becoming their ids.

    `enable_thinking`: the template's thinking mode. `image_soft_tokens` (the conversation's
    images in order, each its soft-token count): the template's i-th image token becomes image
    i's placeholder, boi + image x count + eoi, as transformers' processor writes it
    (`image_processing.expand_image_tokens`). TokenizerError (one line) when the tokenizer has
    no image tokens or the counts disagree."""
    text = self.render_text(messages, add_generation_prompt, enable_thinking)
    if image_soft_tokens is not None:
      if self.image_tokens is None:
        if not image_soft_tokens:
          return self._backend.encode_with_specials(text)
        raise TokenizerError(f"tokenizer in {self.directory} has no image tokens (boi_token, "
                             f"image_token, eoi_token): it cannot hold an image")
      try:
        text = image_processing.expand_image_tokens(text, image_soft_tokens, self.image_tokens)
      except ValueError as e:
        raise TokenizerError(f"{e} (tokenizer in {self.directory})") from None
    return self._backend.encode_with_specials(text)

  def check_thinking_mode(self, asked_by: str) -> None:
    """TokenizerError (one line) unless the chat template has a thinking mode; `asked_by` names
    the setting that asks for it (data.thinking, --thinking)."""
    if self.chat_template is None:
      raise TokenizerError(f"{asked_by} needs a chat template; tokenizer in {self.directory} has "
                           "none")
    if not self.thinking_mode:
      raise TokenizerError(f"{asked_by}: the chat template of tokenizer in {self.directory} has "
                           f"no thinking mode (it never reads {THINKING_VARIABLE}); use a "
                           "Gemma 4 template or turn thinking off")

  def thought_text(self, thought: str) -> str:
    """A reply's thought in the template's thinking channel (the text before the answer).
    TokenizerError (one line) if the template has no thinking channel or the thought holds a
    channel marker (it would end the channel early)."""
    if self.thinking_channel is None:
      raise TokenizerError(
          f"the chat template of tokenizer in {self.directory} has no thinking channel (it never "
          f"writes {self._channel[0]}{THOUGHT_CHANNEL}); use a Gemma 4 template or drop the "
          "thought")
    for marker in self._channel:
      if marker in thought:
        raise TokenizerError(f"the thought holds the channel marker {marker!r}; a thought is "
                             "plain text inside the thinking channel")
    opening, closing = self.thinking_channel
    return f"{opening}{thought}{closing}"

  def channel_marker_ids(self) -> tuple[list[int], list[int]]:
    """The ids of the thinking channel's opening and closing markers (one id each where the
    vocabulary has them as tokens; the byte tokenizer spells them in bytes)."""
    return tuple(self.encode(marker) for marker in self._channel)

  def chat_prompt(self, user_text: str, enable_thinking: bool = False) -> list[int]:
    """Ids of one user turn followed by the opening of the model turn (the generation prompt):
    the chat template's rendering where there is one (in thinking mode or not); else Gemma's
    layout written here, the message trimmed of surrounding whitespace as Gemma's templates do,
    and thinking mode is an error."""
    if self.chat_template is not None:
      return self.render([{"role": "user", "content": user_text}], add_generation_prompt=True,
                         enable_thinking=enable_thinking)
    if enable_thinking:
      self.check_thinking_mode("thinking mode")
    sot, eot = self.start_of_turn, self.end_of_turn
    markers = (sot, eot) + (self._channel if self.generation_suffix else ())
    for marker in markers:
      if self._backend.token_to_id(marker) is None:
        raise TokenizerError(f"tokenizer in {self.directory} has no chat marker {marker!r}")
    text = user_text.strip()
    if self._backend.parses_special_tokens:
      # One string, as the template renders it: the backend splits the markers out itself.
      rendered = (f"{sot}{USER_ROLE}\n{text}{eot}\n{sot}{MODEL_ROLE}\n"
                  f"{self.generation_suffix}")
      return [self.bos_id] + self.encode(rendered)
    # SentencePiece parses user-defined pieces out of text but not control pieces, which
    # markers may be: place their ids between encoded pieces.
    sot_id, eot_id = self.token_to_id(sot), self.token_to_id(eot)
    ids = [self.bos_id, sot_id] + self.encode(f"{USER_ROLE}\n{text}") + [eot_id]
    ids += self.encode("\n") + [sot_id] + self.encode(f"{MODEL_ROLE}\n")
    if self.generation_suffix:
      soc, eoc = self._channel
      ids += [self.token_to_id(soc)] + self.encode("thought\n") + [self.token_to_id(eoc)]
    return ids


def load_tokenizer(directory: str) -> Tokenizer:
  """The tokenizer of a checkpoint directory: `tokenizer.json`, else `tokenizer.model`; the
  byte-level tokenizer for "bytes", with image tokens for "bytes_image" (a directory of either
  name needs a path: ./bytes).

  Raises:
    TokenizerError: neither file exists, or the file cannot be read (one line, naming it).
  """
  directory = os.fspath(directory)
  if directory in BUILT_IN:
    with_images = directory == BYTES_IMAGE
    return Tokenizer(_BytesBackend(with_images), directory, {}, BYTES_CHAT_TEMPLATE)
  config = _read_json(os.path.join(directory, TOKENIZER_CONFIG)) or {}
  template = _chat_template(directory, config)
  json_path = os.path.join(directory, TOKENIZER_JSON)
  spm_path = os.path.join(directory, SENTENCEPIECE_MODEL)
  if os.path.isfile(json_path):
    backend = _TokenizersBackend(json_path)
  elif os.path.isfile(spm_path):
    backend = _SentencePieceBackend(spm_path)
  else:
    raise TokenizerError(
        f"no tokenizer in {directory}: expected {TOKENIZER_JSON} or {SENTENCEPIECE_MODEL}")
  return Tokenizer(backend, directory, config, template)


# ----------------------------------------------------------------------------- backends


class _TokenizersBackend:
  """`tokenizer.json` through the `tokenizers` package (what transformers' fast tokenizer runs)."""

  parses_special_tokens = True

  def __init__(self, path: str):
    import tokenizers  # local: only needed for this format

    try:
      self._tok = tokenizers.Tokenizer.from_file(path)
    except Exception as e:  # the package raises plain Exceptions on a malformed file
      raise TokenizerError(f"cannot read {path}: {_first_line(e)}") from e
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  encode_with_specials = encode  # added tokens are split out of the text already

  def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)


class _SentencePieceBackend:
  """`tokenizer.model` through `sentencepiece` (the `gemma` package's format)."""

  parses_special_tokens = False

  def __init__(self, path: str):
    try:
      import sentencepiece  # local: only needed for this format
    except ImportError as e:
      raise TokenizerError(f"reading {path} needs the sentencepiece package "
                           "(pip install sentencepiece)") from e
    self._sp = sentencepiece.SentencePieceProcessor()
    try:
      self._sp.Load(path)
    except Exception as e:  # OSError or RuntimeError, depending on the version
      raise TokenizerError(f"cannot read {path}: {_first_line(e)}") from e
    self.vocab_size = self._sp.GetPieceSize()
    # Pieces transformers' converted tokenizer treats as added tokens (split out of any text)
    # that SentencePiece does not parse itself: control pieces (<bos>, <eos>, <pad>, ...) and
    # the unknown piece (user-defined pieces it parses).
    specials = [self._sp.IdToPiece(i) for i in range(self.vocab_size)
                if self._sp.IsControl(i) or self._sp.IsUnknown(i)]
    self._specials = {p: self._sp.PieceToId(p) for p in specials if p}
    self._split = _special_splitter(self._specials)

  def encode(self, text: str) -> list[int]:
    return list(self._sp.EncodeAsIds(text))

  def encode_with_specials(self, text: str) -> list[int]:
    """`encode`, except that special-piece strings in the text become their ids (SentencePiece
    parses user-defined pieces but not control pieces such as <bos>)."""
    ids = []
    for i, part in enumerate(self._split.split(text)):
      if i % 2:
        ids.append(self._specials[part])
      elif part:
        ids += self.encode(part)
    return ids

  def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
    if skip_special_tokens:
      # Control pieces (pad/eos/bos) decode to "" anyway; user-defined markers would not.
      ids = [i for i in ids if not (self._sp.IsControl(i) or self._sp.IdToPiece(i) in _MARKERS)]
    return self._sp.DecodeIds(ids)

  def token_to_id(self, token: str) -> int | None:
    i = self._sp.PieceToId(token)
    # Unknown pieces map to the unk id; only the unk piece itself may have it.
    return None if i == self._sp.unk_id() and token != self._sp.IdToPiece(i) else i


class _BytesBackend:
  """Byte-level ids: PAD 0, EOS 1, BOS 2, <|turn> 3, <turn|> 4, then byte b -> 5 + b (UTF-8);
  `with_images`: Gemma 4's <|image> 261, <|image|> 262, <image|> 263 after the bytes (the text
  ids stay those of the plain byte tokenizer).

  Special-token strings in a text become their ids (as added tokens in transformers)."""

  parses_special_tokens = True
  SPECIALS = ("<pad>", "<eos>", "<bos>") + GEMMA4_TURN
  BYTE_OFFSET = len(SPECIALS)
  IMAGE_SPECIALS = dataclasses.astuple(image_processing.GEMMA4_IMAGE_TOKENS)

  def __init__(self, with_images: bool = False):
    tail = self.IMAGE_SPECIALS if with_images else ()
    self.vocab_size = self.BYTE_OFFSET + 256 + len(tail)
    self._specials = {token: i for i, token in enumerate(self.SPECIALS)}
    self._specials.update({token: self.BYTE_OFFSET + 256 + i for i, token in enumerate(tail)})
    self._names = {i: token for token, i in self._specials.items()}
    self._split = _special_splitter(self._specials)

  def encode(self, text: str) -> list[int]:
    ids = []
    for i, part in enumerate(self._split.split(text)):
      if i % 2:
        ids.append(self._specials[part])
      else:
        ids += [self.BYTE_OFFSET + b for b in part.encode("utf-8")]
    return ids

  encode_with_specials = encode

  def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
    out, run = [], bytearray()
    for i in ids:
      if i not in self._names:
        run.append(i - self.BYTE_OFFSET)
        continue
      out.append(run.decode("utf-8", errors="replace"))
      run = bytearray()
      if not skip_special_tokens:
        out.append(self._names[i])
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)

  def token_to_id(self, token: str) -> int | None:
    if token in self._specials:
      return self._specials[token]
    raw = token.encode("utf-8")
    return self.BYTE_OFFSET + raw[0] if len(raw) == 1 else None


def _special_splitter(specials) -> re.Pattern:
  """A pattern whose `split` alternates text and special-token strings (longest first)."""
  alternatives = sorted((t for t in specials if t), key=len, reverse=True)
  return re.compile("(" + "|".join(map(re.escape, alternatives)) + ")") if alternatives else (
      re.compile("(?!)"))


# ----------------------------------------------------------------------------- config reading


def _read_json(path: str) -> dict[str, Any] | None:
  """The JSON object of `path` (None if there is no such file)."""
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (OSError, ValueError) as e:
    raise TokenizerError(f"cannot read {path}: {_first_line(e)}") from e
  if not isinstance(value, dict):  # every reader below looks keys up
    raise TokenizerError(f"cannot read {path}: expected a JSON object, got "
                         f"{type(value).__name__}")
  return value


def _chat_template(directory: str, config: dict[str, Any]) -> str | None:
  """The default chat template's text: chat_template.jinja, chat_template.json, or the
  tokenizer config's `chat_template` (a string, or a list of named templates)."""
  jinja_path = os.path.join(directory, CHAT_TEMPLATE_FILES[0])
  if os.path.isfile(jinja_path):
    try:
      with open(jinja_path, encoding="utf-8") as f:
        return f.read()
    except (OSError, ValueError) as e:  # not UTF-8 text
      raise TokenizerError(f"cannot read {jinja_path}: {_first_line(e)}") from e
  template = (_read_json(os.path.join(directory, CHAT_TEMPLATE_FILES[1])) or {}).get(
      "chat_template") or config.get("chat_template")
  if isinstance(template, list):
    named = {t.get("name"): t.get("template") for t in template
             if isinstance(t, dict) and isinstance(t.get("name"), str)}
    template = named.get("default") or next(iter(named.values()), None)
  return template if isinstance(template, str) else None


def _token_string(value: Any) -> str | None:
  """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


def _named_token(config: dict[str, Any], name: str) -> str | None:
  """A named model-specific special token, at the top level or under extra_special_tokens."""
  extra = config.get("extra_special_tokens")
  return _token_string(config.get(name)) or (
      _token_string(extra.get(name)) if isinstance(extra, dict) else None)


def _turn_markers(config: dict[str, Any], template: str | None, token_to_id) -> tuple[str, str]:
  named = (_named_token(config, "sot_token"), _named_token(config, "eot_token"))
  if all(named):
    return named
  for pair in (GEMMA4_TURN, GEMMA3_TURN):
    if template is not None:
      if all(marker in template for marker in pair):
        return pair
    elif all(token_to_id(marker) is not None for marker in pair):
      return pair
  return GEMMA4_TURN


def _image_tokens(config: dict[str, Any], token_to_id) -> image_processing.ImageTokens | None:
  """The tokenizer's image tokens: the three tokenizer_config.json names, else Gemma 4's, where
  the vocabulary has all three; None otherwise."""
  named = tuple(_named_token(config, name) for name in ("boi_token", "image_token", "eoi_token"))
  for tokens in ((image_processing.ImageTokens(*named),) if all(named) else ()) + (
      image_processing.GEMMA4_IMAGE_TOKENS,):
    if all(token_to_id(t) is not None for t in dataclasses.astuple(tokens)):
      return tokens
  return None


def _channel_markers(config: dict[str, Any]) -> tuple[str, str]:
  return (_named_token(config, "soc_token") or GEMMA4_CHANNEL[0],
          _named_token(config, "eoc_token") or GEMMA4_CHANNEL[1])


def _generation_suffix(channel: tuple[str, str], template: str | None) -> str:
  """The empty thought channel, when the template writes one as a literal (Gemma 4's 26B-A4B
  does so after the model-turn opening unless thinking is enabled; only a template-less
  `chat_prompt`, never in thinking mode, writes it here)."""
  soc, eoc = channel
  empty_thought = f"{soc}thought\n{eoc}"
  if template and (empty_thought in template or
                   empty_thought.replace("\n", "\\n") in template):
    return empty_thought
  return ""


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return lines[0] if lines else type(e).__name__
