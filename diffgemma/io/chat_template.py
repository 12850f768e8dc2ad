"""A checkpoint's jinja chat template, rendered as transformers' `apply_chat_template` renders it.

transformers compiles the template in a sandboxed jinja2 environment (`trim_blocks`,
`lstrip_blocks`, the loop-control extension, a `{% generation %}` block tag), with these
globals and filters: `raise_exception(message)`, `strftime_now(format)`, a `tojson` filter that
does not escape HTML (`json.dumps`, `ensure_ascii=False`), and guarded `dict` / `namespace`
callables. It renders with the variables
  messages                the conversation: dicts with "role" and "content" (None-valued keys
                          dropped); a message's thought, given under any of REASONING_KEYS,
                          is copied to "reasoning_content" and "thinking" (transformers'
                          aliasing: templates read one name or the other),
  tools, documents        None here,
  add_generation_prompt   whether to open the model's turn after the last message,
  <name>_token            the tokenizer's named special tokens (bos_token, eos_token, ...), as
                          strings,
then tokenizes the text with `add_special_tokens=False` (the template writes BOS itself). This
module does the rendering; `diffgemma.io.tokenizer.Tokenizer.render` tokenizes.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import jinja2.utils

from diffgemma import errors

ROLES = ("system", "user", "assistant")
# The names a message's thought (reasoning) goes under; the first is the one templates read.
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(errors.InputError):
  """A template that does not compile or refuses a conversation; the message is one line."""


def special_token_variables(tokenizer_config: Mapping[str, Any],
                            defaults: Mapping[str, str] | None = None) -> dict[str, str]:
  """The template variables transformers derives from tokenizer_config.json: every top-level
  `*_token` entry (a string, or an AddedToken dict's "content") and the named entries of a dict
  `extra_special_tokens`; `defaults` fills the names the config leaves out."""
  out = dict(defaults or {})
  for key, value in tokenizer_config.items():
    if key.endswith("_token"):
      token = _token_content(value)
      if token is not None:
        out[key] = token
  extra = tokenizer_config.get("extra_special_tokens")
  if isinstance(extra, Mapping):
    for key, value in extra.items():
      token = _token_content(value)
      if token is not None:
        out[key] = token
  return out


def render(template: str, messages: Sequence[Mapping[str, Any]],
           special_tokens: Mapping[str, str], add_generation_prompt: bool = False,
           **kwargs: Any) -> str:
  """The template's text for one conversation (what `apply_chat_template(..., tokenize=False)`
  returns). Extra keyword arguments are template variables (e.g. enable_thinking) and override
  special tokens of the same name, as in transformers.

  Raises:
    ChatTemplateError: the template does not compile, or raises (any exception) on this
      conversation.
  """
  if not messages:
    raise ChatTemplateError("cannot render an empty conversation")
  compiled = _compile(template)
  chat = [_alias_reasoning(_plain({k: v for k, v in m.items() if v is not None}))
          for m in messages]
  variables = _plain({**special_tokens, **kwargs})
  try:
    return compiled.render(messages=chat, tools=None, documents=None,
                           add_generation_prompt=add_generation_prompt, **variables)
  except jinja2.exceptions.TemplateError as e:
    raise ChatTemplateError(f"chat template: {_first_line(e)}") from e
  except Exception as e:  # pylint: disable=broad-except
    # The template is the checkpoint's code: a Python error its expressions raise ({{ 1 / 0 }},
    # a str + int) is the template's fault, as a raise_exception is.
    raise ChatTemplateError(f"chat template: {type(e).__name__}: {_first_line(e)}") from e


# ----------------------------------------------------------------------------- environment


class _GenerationBlock(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}` (transformers marks assistant spans with it):
  renders its body unchanged."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    return caller()


class _GuardedDict:
  """`dict(...)` in a template: builds plain dicts; no attribute access to the type itself."""

  def __call__(self, *args, **kwargs):
    return dict(*args, **kwargs)

  def fromkeys(self, *args, **kwargs):
    return dict.fromkeys(*args, **kwargs)


class _GuardedNamespace(jinja2.utils.Namespace):
  """`namespace(...)` refusing underscore-prefixed attribute names."""

  def __init__(*args, **kwargs):  # pylint: disable=no-method-argument
    self, rest = args[0], args[1:]
    attrs = dict(*rest, **kwargs)
    for name in attrs:
      _GuardedNamespace._check(name)
    jinja2.utils.Namespace.__init__(self, attrs)

  def __setitem__(self, name, value):
    _GuardedNamespace._check(name)
    jinja2.utils.Namespace.__setitem__(self, name, value)

  @staticmethod
  def _check(name):
    if isinstance(name, str) and name.startswith("_"):
      raise jinja2.exceptions.SecurityError(
          f"a chat template cannot set the namespace attribute {name!r}")


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                     dict=_GuardedDict(), namespace=_GuardedNamespace)
  try:
    return env.from_string(template)
  except jinja2.exceptions.TemplateError as e:
    raise ChatTemplateError(f"chat template does not compile: {_first_line(e)}") from e
  except SyntaxError as e:  # jinja's Python for it does not compile ({% break %} outside a loop)
    raise ChatTemplateError(f"chat template does not compile: {e.msg}") from e


def _plain(value: Any) -> Any:
  """JSON-like data rebuilt from plain types (the sandbox sees nothing else)."""
  if value is None or type(value) in (str, int, float, bool):
    return value
  if isinstance(value, str):
    return str.__str__(value)
  if isinstance(value, int):
    return int.__int__(value)
  if isinstance(value, float):
    return float.__float__(value)
  if isinstance(value, Mapping):
    return {_plain(k): _plain(v) for k, v in value.items()}
  if isinstance(value, list):
    return [_plain(v) for v in value]
  if isinstance(value, tuple):
    return tuple(_plain(v) for v in value)
  if hasattr(value, "item") and callable(value.item):  # numpy scalars
    return _plain(value.item())
  return f"<{type(value).__name__}>"  # anything else: an inert placeholder


def _alias_reasoning(message: dict) -> dict:
  """The message with its thought (the first of REASONING_KEYS it has) also under
  "reasoning_content" and "thinking", as transformers' apply_chat_template passes it."""
  thought = next((message[k] for k in REASONING_KEYS if message.get(k) is not None), None)
  if thought is None:
    return message
  return {"thinking": thought, **message, "reasoning_content": thought}


def _token_content(value: Any) -> str | None:
  if isinstance(value, Mapping):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return lines[0] if lines else type(e).__name__
