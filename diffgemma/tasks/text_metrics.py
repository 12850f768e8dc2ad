"""Text answers: how a generated reply is compared with a reference reply.

  exact   the reply equals the reference after stripping surrounding whitespace.
  choice  a strict marker, "the answer is yes|no|maybe" (case-insensitive, an optional colon),
          as Google's PubMedQA evaluation: a bare "yes" somewhere is not an answer. The
          reference's label is its own marker, else the whole reference if it is one of the
          three words (a trailing period allowed).
  gsm8k   the number after "####" (commas and a leading $ allowed), compared numerically
          ("72" = "72.0" = "72.00"). The reference's number: after its "####", else the whole
          reference if it is a number.
  regex   the first group of `answer_regex`'s first match, stripped, compared as strings. The
          reference's answer: its own match, else the whole stripped reference.

A reply without an extractable answer is wrong.

Graded rewards (SD·RL only: a score in [0, 1] instead of a verdict, so that a group of replies
that are all wrong still ranks its members):
  prefix  the characters the reply and the reference share from their start, over the longer
          of the two (both stripped): 1 exactly when the reply is the reference; a reply that
          stops early earns the share it got right, one that runs past the end is charged for
          every extra character.

Pure Python; used by the chat task's scoring, held-out evaluation and SD·RL rewards.
"""

from __future__ import annotations

import dataclasses
import decimal
import re

METRICS = ("exact", "choice", "gsm8k", "regex")
GRADED = ("prefix",)
CHOICES = ("yes", "no", "maybe")
_CHOICE_MARKER = re.compile(r"\bthe answer is\s*:?\s*(yes|no|maybe)\b", re.IGNORECASE)
_GSM8K_MARKER = re.compile(r"####\s*\$?\s*([-+]?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"\$?\s*([-+]?[\d,]*\.?\d+)")


@dataclasses.dataclass(frozen=True)
class Verdict:
  """A reply against its reference: the answers extracted from both (None: none found)."""

  correct: bool
  answer: str | None
  reference_answer: str | None


def check_metric(metric: str, answer_regex: str = "") -> re.Pattern | None:
  """Validate a metric name (and, for "regex", its pattern); returns the compiled pattern.

  Raises:
    ValueError: one line naming the problem.
  """
  if metric not in METRICS:
    raise ValueError(f"unknown metric {metric!r}; choose one of {METRICS}")
  if metric != "regex":
    return None
  if not answer_regex:
    raise ValueError("metric 'regex' needs an answer_regex with one capturing group")
  try:
    pattern = re.compile(answer_regex)
  except re.error as e:
    raise ValueError(f"answer_regex {answer_regex!r} does not compile: {e}") from None
  if pattern.groups < 1:
    raise ValueError(f"answer_regex {answer_regex!r} has no capturing group: put the answer "
                     "in parentheses")
  return pattern


def extract(metric: str, text: str, pattern: re.Pattern | None = None) -> str | None:
  """The answer in a generated reply, normalised for comparison; None if there is none."""
  if metric == "exact":
    return text.strip()
  if metric == "choice":
    match = _CHOICE_MARKER.search(text)
    return match.group(1).lower() if match else None
  if metric == "gsm8k":
    match = _GSM8K_MARKER.search(text)
    return _number(match.group(1)) if match else None
  if metric == "regex":
    match = pattern.search(text)
    return match.group(1).strip() if match and match.group(1) is not None else None
  raise ValueError(f"unknown metric {metric!r}; choose one of {METRICS}")


def reference_answer(metric: str, reference: str, pattern: re.Pattern | None = None
                     ) -> str | None:
  """The answer of a reference reply: as `extract`, with the fallbacks of the module doc."""
  found = extract(metric, reference, pattern)
  if found is not None:
    return found
  whole = reference.strip()
  if metric == "choice":
    word = whole.rstrip(".").strip().lower()
    return word if word in CHOICES else None
  if metric == "gsm8k":
    match = _NUMBER.fullmatch(whole)
    return _number(match.group(1)) if match else None
  if metric == "regex":
    return whole or None
  return None


def judge(metric: str, reply: str, reference: str, pattern: re.Pattern | None = None
          ) -> Verdict:
  answer = extract(metric, reply, pattern)
  expected = reference_answer(metric, reference, pattern)
  return Verdict(answer is not None and expected is not None and answer == expected, answer,
                 expected)


def prefix_score(reply: str, reference: str) -> float:
  """The graded reward "prefix" (module docstring): shared leading characters of the stripped
  texts over the longer one's length; 1.0 when both are empty."""
  reply, reference = reply.strip(), reference.strip()
  longer = max(len(reply), len(reference))
  if longer == 0:
    return 1.0
  shared = 0
  for a, b in zip(reply, reference):
    if a != b:
      break
    shared += 1
  return shared / longer


def graded(name: str, reply: str, reference: str) -> float:
  """A graded reward of GRADED by name."""
  if name == "prefix":
    return prefix_score(reply, reference)
  raise ValueError(f"unknown graded reward {name!r}; choose one of {GRADED}")


def _number(text: str) -> str | None:
  """A number's canonical string ("1,234.50" -> "1234.5"), so equal values compare equal."""
  try:
    value = decimal.Decimal(text.replace(",", ""))
  except decimal.InvalidOperation:
    return None
  if not value.is_finite():
    return None
  value = value.normalize()
  return format(value if value != 0 else decimal.Decimal(0), "f")
