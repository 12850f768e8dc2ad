"""A typed config section checks its own fields: each value against its annotation.

Every section dataclass (`ModelConfig`, `LossConfig`, `SamplerConfig`, ...) calls
`check_types(self, "section.")` first in its `__post_init__`, then its own ranges and choices, so
a config value of the wrong type (a float batch size, a NaN learning rate, a string where a flag
belongs) is a one-line ValueError naming the key, whichever section it is in.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing

import numpy as np


@functools.cache
def _annotations(cls: type) -> dict[str, type]:
  """{field: the plain type it must hold} for the fields annotated int, float, bool or str
  (optionally `| None`); other annotations (tuples, dicts, Any) are not checked here."""
  out = {}
  for name, hint in typing.get_type_hints(cls).items():
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    plain = [a for a in args if a is not type(None)]
    if len(plain) == 1 and plain[0] in (int, float, bool, str):
      out[name] = plain[0]
  return out


def _problem(kind: type, value) -> str | None:
  if kind is bool:
    return None if isinstance(value, (bool, np.bool_)) else "must be True or False"
  if kind is int:
    ok = isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
    return None if ok else "must be an integer"
  if kind is float:
    ok = (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
          and math.isfinite(value))
    return None if ok else "must be a finite number"
  return None if isinstance(value, str) else "must be a string"


def check_types(section, prefix: str) -> None:
  """ValueError (one line: `{prefix}{field} must be ..., got VALUE`) at the first field of the
  dataclass instance `section` whose value does not fit its annotation (None passes where the
  annotation allows it)."""
  for field in dataclasses.fields(section):
    kind = _annotations(type(section)).get(field.name)
    value = getattr(section, field.name)
    if kind is None or value is None:
      continue
    problem = _problem(kind, value)
    if problem:
      raise ValueError(f"{prefix}{field.name} {problem}, got {value!r}")
