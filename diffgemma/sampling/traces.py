"""Denoising traces, for any task: watch a canvas settle, step by step.

A recorded trajectory (`sampler.generate` with `record_trajectory=True`) holds, for canvas k and
denoising step n of batch row b, the argmax canvas after the step (`argmax`), which positions'
draws were accepted (`accepted`; the others were renoised), and the tempered entropy the
acceptance ranked (`entropy`): arrays [K, N, B, C]; `valid` [K, N, B] says the row ran that
step. From it:

  trace_steps                      the steps one row ran, as `TraceStep`s (the common input)
  html_trace / html_trace_text     one row of tokens per step, each token shaded by its entropy,
                                   accepted tokens marked; self-contained HTML
  markdown_trace                   the same as markdown (TensorBoard's text tab)
  text_trace / log_text_traces     a row's steps as token strings; written to TensorBoard
  write_text_trace / check_trace_path   what `sample.py --trace=FILE.html` calls

A task draws its own pictures on top (the Sudoku grid as GIF frames:
diffgemma/tasks/sudoku_traces.py). Shown tokens are each step's argmax (the model's current
answer); a renoised position's canvas token is random noise and says nothing, so it is shown as
its argmax, dimmed.
"""

from __future__ import annotations

import html
import os
from typing import Callable, NamedTuple, Sequence

import numpy as np

from diffgemma import errors

HTML_SUFFIXES = (".html",)


class TraceStep(NamedTuple):
  """One denoising step of one row: where it sits and what it produced (length-C arrays)."""

  canvas: int  # 0-based canvas index k
  step: int  # 1-based step within the canvas
  steps_in_canvas: int  # how many steps the row ran on this canvas
  tokens_C: np.ndarray  # argmax after the step
  accepted_C: np.ndarray  # bool: the draw was kept (else renoised)
  entropy_C: np.ndarray  # tempered entropy (nats)

  @property
  def label(self) -> str:
    return f"canvas {self.canvas + 1} step {self.step}/{self.steps_in_canvas}"


def trace_steps(trajectory, row: int = 0, canvases: Sequence[int] | None = None
                ) -> list[TraceStep]:
  """The steps batch row `row` ran, canvas by canvas (all canvases unless `canvases`)."""
  valid_KxNxB = np.asarray(trajectory["valid"], bool)
  argmax, accepted = np.asarray(trajectory["argmax"]), np.asarray(trajectory["accepted"], bool)
  entropy = np.asarray(trajectory["entropy"], np.float32)
  if not 0 <= row < valid_KxNxB.shape[2]:
    raise ValueError(f"row {row} is outside the trajectory's batch of {valid_KxNxB.shape[2]}")
  steps = []
  for k in range(valid_KxNxB.shape[0]) if canvases is None else canvases:
    ran = np.flatnonzero(valid_KxNxB[k, :, row])
    steps += [TraceStep(k, i + 1, len(ran), argmax[k, n, row], accepted[k, n, row],
                        entropy[k, n, row]) for i, n in enumerate(ran)]
  return steps


# ----------------------------------------------------------------------------- text (any task)

_VISIBLE = {"\n": "\u21b5", "\t": "\u21e5", "\r": "\u240d"}

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.2em; }
.legend { margin-bottom: 1em; font-size: 0.9em; }
table.trace { border-collapse: collapse; }
table.trace td { padding: 2px 6px; vertical-align: top; border-bottom: 1px solid #eee; }
td.label { white-space: nowrap; color: #666; font-size: 0.85em; }
td.tokens { font-family: ui-monospace, monospace; font-size: 0.9em; line-height: 1.9; }
span.tok { white-space: pre; padding: 1px 0; border-radius: 2px; }
span.acc { font-weight: bold; box-shadow: inset 0 -2px 0 #1a8f3c; }
span.ren { color: #999; }
span.swatch { display: inline-block; width: 3em; height: 0.9em; vertical-align: middle;
  background: linear-gradient(to right, rgba(230, 120, 0, 0), rgba(230, 120, 0, 0.85)); }
"""


def _visible(token: str) -> str:
  return "".join(_VISIBLE.get(ch, ch) for ch in token)


def html_trace_text(steps: Sequence[Sequence[str]], entropies, accepted,
                    labels: Sequence[str] | None = None, title: str = "Denoising trace",
                    max_entropy: float | None = None) -> str:
  """A self-contained HTML page (inline CSS, no scripts or external resources): one table row
  per step, its tokens in order, each shaded by its entropy (transparent at 0, orange at
  `max_entropy`, default the largest shown), accepted tokens bold and underlined in green,
  renoised ones grey; hovering a token shows its entropy.

  steps: per step, the canvas tokens as strings; entropies / accepted: per step, one number /
  bool per token; labels: per step (default "step n").
  """
  if not (len(steps) == len(entropies) == len(accepted)):
    raise ValueError(f"steps, entropies and accepted differ in length: {len(steps)}, "
                     f"{len(entropies)}, {len(accepted)}")
  labels = list(labels) if labels is not None else [f"step {i + 1}" for i in range(len(steps))]
  if max_entropy is None:
    max_entropy = max((float(np.max(e)) for e in entropies if len(e)), default=0.0)
  scale = 1.0 / max_entropy if max_entropy > 0 else 0.0
  rows = []
  for label, tokens, ent, acc in zip(labels, steps, entropies, accepted):
    if not len(tokens) == len(ent) == len(acc):
      raise ValueError(f"{label}: {len(tokens)} tokens, {len(ent)} entropies, {len(acc)} flags")
    spans = []
    for token, h, a in zip(tokens, ent, acc):
      alpha = min(float(h) * scale, 1.0) * 0.85
      spans.append(f'<span class="tok {"acc" if a else "ren"}" '
                   f'style="background: rgba(230, 120, 0, {alpha:.3f})" '
                   f'title="entropy {float(h):.4f}">{html.escape(_visible(token))}</span>')
    rows.append(f'<tr class="step"><td class="label">{html.escape(label)}</td>'
                f'<td class="tokens">{"".join(spans)}</td></tr>')
  legend = (f'<div class="legend">Each row: the canvas after one denoising step (argmax '
            f'tokens). Shading: entropy, 0 <span class="swatch"></span> {max_entropy:.3g} '
            f'nats; <span class="tok acc">bold, underlined</span>: accepted this step; '
            f'<span class="tok ren">grey</span>: renoised.</div>')
  return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
          f"<title>{html.escape(title)}</title>\n<style>{_CSS}</style>\n</head>\n<body>\n"
          f"<h1>{html.escape(title)}</h1>\n{legend}\n<table class=\"trace\">\n<tbody>\n"
          + "\n".join(rows) + "\n</tbody>\n</table>\n</body>\n</html>\n")


def html_trace(steps: Sequence[Sequence[str]], entropies, accepted, path: str,
               labels: Sequence[str] | None = None, title: str = "Denoising trace") -> int:
  """Write `html_trace_text(...)` to `path` (UTF-8); returns the number of step rows."""
  page = html_trace_text(steps, entropies, accepted, labels, title)
  with open(path, "w", encoding="utf-8") as f:
    f.write(page)
  return len(steps)


def _markdown_escape(text: str) -> str:
  return "".join("\\" + ch if ch in "\\`*_{}[]()#+-.!|<>~" else ch for ch in _visible(text))


def markdown_trace(steps: Sequence[Sequence[str]], accepted, labels: Sequence[str] | None = None,
                   max_rows: int | None = None) -> str:
  """The trace as a markdown table for TensorBoard's text tab: one row per step (at most
  `max_rows`: the first ones and the last), accepted tokens in bold."""
  labels = list(labels) if labels is not None else [f"step {i + 1}" for i in range(len(steps))]
  index = list(range(len(steps)))
  if max_rows is not None and len(index) > max_rows:
    index = index[:max_rows - 1] + index[-1:]
  lines = ["| step | tokens (bold: accepted) |", "|---|---|"]
  for i in index:
    runs = []  # consecutive tokens with the same flag form one run
    for token, a in zip(steps[i], accepted[i]):
      if runs and runs[-1][1] == bool(a):
        runs[-1][0] += token
      else:
        runs.append([token, bool(a)])
    parts = []
    for text, a in runs:
      text = _visible(text).replace("\n", " ")
      body = _markdown_escape(text.strip())
      pad_left, pad_right = text[:len(text) - len(text.lstrip())], text[len(text.rstrip()):]
      parts.append(pad_left + (f"**{body}**" if a and body else body) + pad_right)
    lines.append(f"| {_markdown_escape(labels[i])} | {''.join(parts)} |")
  return "\n".join(lines)


def text_trace(trajectory, decode_token: Callable[[int], str], row: int = 0):
  """(labels, token strings, entropies, accepted) per step of row `row`, over all canvases;
  `decode_token(id) -> str` renders one token."""
  steps = trace_steps(trajectory, row)
  return ([s.label for s in steps], [[decode_token(int(t)) for t in s.tokens_C] for s in steps],
          [s.entropy_C for s in steps], [s.accepted_C for s in steps])


# ----------------------------------------------------------------------------- TensorBoard


def log_text_traces(writer, step: int, trajectory, decode_token: Callable[[int], str],
                    rows: Sequence[int] = (0,), tag: str = "trace/text",
                    max_steps: int = 24) -> None:
  """Write `markdown_trace` of each of `rows` (at most `max_steps` steps each) as one
  TensorBoard text summary under `tag`. `writer`: anything with write_text(step, tag, text)."""
  parts = []
  for r in rows:
    labels, tokens, _, accepted = text_trace(trajectory, decode_token, r)
    parts.append(f"**row {r}**\n\n" + markdown_trace(tokens, accepted, labels, max_steps))
  writer.write_text(step, tag, "\n\n".join(parts))


# ----------------------------------------------------------------------------- sample.py

def check_trace_path(path: str, suffixes: Sequence[str] = HTML_SUFFIXES,
                     make_folders: bool = False) -> None:
  """ValueError (one line) unless `path` ends in one of `suffixes` and is a file that can be
  written (errors.check_output_file). `make_folders`: also make its missing folders (the
  writers; a check before the sampling writes nothing)."""
  suffix = os.path.splitext(path)[1].lower()
  if suffix not in suffixes:
    raise ValueError(f"--trace={path!r}: the file must end in {' or '.join(suffixes)}")
  (errors.prepare_output_file if make_folders else errors.check_output_file)(path, "trace")


def write_text_trace(path: str, trajectory, decode_token: Callable[[int], str], row: int = 0,
                     title: str = "Denoising trace") -> int:
  """An HTML trace of every canvas row `row` denoised; returns the number of step rows."""
  check_trace_path(path, HTML_SUFFIXES, make_folders=True)
  labels, tokens, entropies, accepted = text_trace(trajectory, decode_token, row)
  return html_trace(tokens, entropies, accepted, path, labels, title)
