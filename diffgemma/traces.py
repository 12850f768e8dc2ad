"""Denoising traces: watch a canvas settle, step by step.

A recorded trajectory (`sampler.generate` with `record_trajectory=True`) holds, for canvas k and
denoising step n of batch row b, the argmax canvas after the step (`argmax`), which positions'
draws were accepted (`accepted`; the others were renoised), and the tempered entropy the
acceptance ranked (`entropy`): arrays [K, N, B, C]; `valid` [K, N, B] says the row ran that
step. From it:

  trace_steps                      the steps one row ran, as `TraceStep`s (the common input)
  sudoku_frame / sudoku_frames     the 9x9 grid after a step (Pillow), as uint8 [H, W, 3]
  sudoku_gif                       one GIF frame per step the row ran on the grid canvas
  sudoku_montage                   a few of those frames side by side (a TensorBoard image)
  html_trace / html_trace_text     any task: one row of tokens per step, each token shaded by its
                                   entropy, accepted tokens marked; self-contained HTML
  markdown_trace                   the same as markdown (TensorBoard's text tab)
  log_sudoku_traces / log_text_traces   write those to TensorBoard (the periodic eval)
  write_sudoku_trace / write_text_trace / check_trace_path   what `sample.py --trace` calls

Shown tokens are each step's argmax (the model's current answer); a renoised position's canvas
token is random noise and says nothing, so it is shown as its argmax, dimmed.
"""

from __future__ import annotations

import html
import os
from typing import Callable, NamedTuple, Sequence

import numpy as np

from diffgemma import data, sudoku

TRACE_SUFFIXES = (".gif", ".html")


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


# ----------------------------------------------------------------------------- Sudoku (Pillow)

CELL_PX = 40
HEADER_PX = 30
FOOTER_PX = 26
MARGIN_PX = 8
WHITE, BLACK = (255, 255, 255), (0, 0, 0)
GIVEN_BG = (222, 222, 222)
ACCEPTED_BG = (180, 228, 180)
ACCEPTED_MARK = (40, 150, 60)  # corner triangle of a given whose draw was accepted
FILLED_FG = (32, 80, 192)  # digits the model wrote
WRONG_FG = (214, 39, 40)  # contradicts a given (or the solution, when known)
DIM = 0.3  # share of the digit colour left in a renoised cell (the rest is background)


def _font(size: int):
  from PIL import ImageFont

  return ImageFont.load_default(size=size)


def _blend(fg, bg, share: float):
  return tuple(int(round(share * f + (1 - share) * b)) for f, b in zip(fg, bg))


def sudoku_frame(digits_81, puzzle_81, accepted_81, header: str, solution_81=None,
                 cell_px: int = CELL_PX) -> np.ndarray:
  """The grid after one step, uint8 [H, W, 3].

  Givens: grey background, bold black digits. The model's digits: blue. Accepted cells (the
  draw was kept this step): green background (a given: a green corner). Renoised cells: digit
  faded into the background. Red: a digit that contradicts a given (or `solution_81`, when
  given). A position whose argmax is no digit shows a dot.
  """
  from PIL import Image, ImageDraw

  digits = np.asarray(digits_81).reshape(sudoku.NUM_CELLS)
  puzzle = np.asarray(puzzle_81).reshape(sudoku.NUM_CELLS)
  accepted = np.asarray(accepted_81, bool).reshape(sudoku.NUM_CELLS)
  solution = None if solution_81 is None else np.asarray(solution_81).reshape(sudoku.NUM_CELLS)
  side = sudoku.SIZE * cell_px
  scale = cell_px / CELL_PX
  header_px, footer_px, margin = (int(round(x * scale)) for x in (HEADER_PX, FOOTER_PX,
                                                                   MARGIN_PX))
  image = Image.new("RGB", (side + 2 * margin, header_px + side + footer_px + margin), WHITE)
  draw = ImageDraw.Draw(image)
  digit_font, small_font = _font(int(cell_px * 0.62)), _font(max(int(cell_px * 0.34), 8))
  draw.text((margin, header_px // 2), header, fill=BLACK, font=small_font, anchor="lm")
  top = header_px
  for cell in range(sudoku.NUM_CELLS):
    r, c = divmod(cell, sudoku.SIZE)
    x0, y0 = margin + c * cell_px, top + r * cell_px
    given = puzzle[cell] != sudoku.BLANK
    bg = GIVEN_BG if given else ACCEPTED_BG if accepted[cell] else WHITE
    draw.rectangle((x0, y0, x0 + cell_px, y0 + cell_px), fill=bg)
    if given and accepted[cell]:
      corner = cell_px * 0.3
      draw.polygon([(x0, y0), (x0 + corner, y0), (x0, y0 + corner)], fill=ACCEPTED_MARK)
    digit = int(digits[cell])
    wrong = (given and digit != puzzle[cell]) or (
        solution is not None and digit != sudoku.BLANK and digit != solution[cell])
    fg = WRONG_FG if wrong else BLACK if given else FILLED_FG
    if not accepted[cell]:
      fg = _blend(fg, bg, DIM)
    text = str(digit) if digit != sudoku.BLANK else "·"
    draw.text((x0 + cell_px / 2, y0 + cell_px / 2), text, fill=fg, font=digit_font, anchor="mm",
              stroke_width=1 if given else 0, stroke_fill=fg)
  for i in range(sudoku.SIZE + 1):  # thin cell lines, thick box lines
    width = 3 if i % sudoku.BOX == 0 else 1
    offset = i * cell_px
    draw.line((margin + offset, top, margin + offset, top + side), fill=BLACK, width=width)
    draw.line((margin, top + offset, margin + side, top + offset), fill=BLACK, width=width)
  y = top + side + footer_px // 2 + 2
  x = margin
  square = max(int(cell_px * 0.3), 6)
  for colour, label in ((ACCEPTED_BG, "accepted"), (GIVEN_BG, "given (corner: accepted)")):
    draw.rectangle((x, y - square // 2, x + square, y + square // 2), fill=colour, outline=BLACK)
    if colour == GIVEN_BG:
      draw.polygon([(x, y - square // 2), (x + square // 2, y - square // 2),
                    (x, y)], fill=ACCEPTED_MARK)
    x += square + 4
    draw.text((x, y), label, fill=BLACK, font=small_font, anchor="lm")
    x += int(draw.textlength(label, font=small_font)) + 10
  draw.text((x, y), "faded: renoised", fill=_blend(BLACK, WHITE, 0.5), font=small_font,
            anchor="lm")
  return np.asarray(image)


def _sudoku_steps(trajectory, row: int) -> list[TraceStep]:
  """The steps of the grid canvas (canvas 0; its first 81 positions are the cells)."""
  return trace_steps(trajectory, row, canvases=[0])


def _step_header(step: TraceStep, puzzle_81) -> str:
  blanks = np.asarray(puzzle_81).reshape(-1) == sudoku.BLANK
  cells = step.accepted_C[:data.CANVAS_LEN]
  return (f"step {step.step}/{step.steps_in_canvas}   accepted {int(cells.sum())} "
          f"({int((cells & blanks).sum())} of {int(blanks.sum())} blanks)")


def sudoku_frames(trajectory, puzzle_81, row: int = 0, solution_81=None,
                  cell_px: int = CELL_PX) -> list[np.ndarray]:
  """One `sudoku_frame` per denoising step row `row` ran on the grid canvas."""
  return [sudoku_frame(data.tokens_to_digits(s.tokens_C[:data.CANVAS_LEN]), puzzle_81,
                       s.accepted_C[:data.CANVAS_LEN], _step_header(s, puzzle_81), solution_81,
                       cell_px) for s in _sudoku_steps(trajectory, row)]


def sudoku_gif(trajectory, puzzle_81, path: str, row: int = 0, solution_81=None,
               frame_ms: int = 400, last_frame_ms: int = 2500, cell_px: int = CELL_PX) -> int:
  """Write the grid at every denoising step of row `row` as an animated GIF (one frame per
  step, looping; the last frame is held longer). Returns the number of frames."""
  from PIL import Image

  frames = sudoku_frames(trajectory, puzzle_81, row, solution_81, cell_px)
  if not frames:
    raise ValueError(f"row {row} ran no denoising step: nothing to draw")
  images = [Image.fromarray(f) for f in frames]
  durations = [frame_ms] * (len(images) - 1) + [last_frame_ms]
  # Every frame differs from the one before (the step number), so none is merged away.
  images[0].save(path, save_all=True, append_images=images[1:], duration=durations, loop=0,
                 optimize=False)
  return len(images)


def sudoku_montage(trajectory, puzzle_81, row: int = 0, solution_81=None, max_frames: int = 8,
                   columns: int = 4, cell_px: int = 24) -> np.ndarray:
  """Up to `max_frames` steps of row `row` (the first, the last and evenly spaced ones between)
  in a grid of `columns`: one uint8 [H, W, 3] image for TensorBoard."""
  frames = sudoku_frames(trajectory, puzzle_81, row, solution_81, cell_px)
  if not frames:
    raise ValueError(f"row {row} ran no denoising step: nothing to draw")
  picks = np.unique(np.linspace(0, len(frames) - 1, min(max_frames, len(frames))).round()
                    .astype(int))
  chosen = [frames[i] for i in picks]
  columns = min(columns, len(chosen))
  rows = -(-len(chosen) // columns)
  h, w, _ = chosen[0].shape
  out = np.full((rows * h, columns * w, 3), 255, np.uint8)
  for i, frame in enumerate(chosen):
    r, c = divmod(i, columns)
    out[r * h:(r + 1) * h, c * w:(c + 1) * w] = frame
  return out


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


def sudoku_text_trace(trajectory, row: int = 0):
  """`text_trace` of the grid canvas with digits as tokens ('·' where the argmax is no digit),
  each followed by a space, and by '‖' at the end of a grid row."""
  steps = _sudoku_steps(trajectory, row)
  cells = slice(0, data.CANVAS_LEN)
  ends = ["‖ " if (i + 1) % sudoku.SIZE == 0 and i + 1 < sudoku.NUM_CELLS else ""
          for i in range(sudoku.NUM_CELLS)]
  tokens = [[(str(d) if d else "·") + " " + end
             for d, end in zip(data.tokens_to_digits(s.tokens_C[cells]), ends)] for s in steps]
  return ([s.label for s in steps], tokens, [s.entropy_C[cells] for s in steps],
          [s.accepted_C[cells] for s in steps])


# ----------------------------------------------------------------------------- TensorBoard


def log_sudoku_traces(writer, step: int, trajectory, puzzles_Nx81, solutions_Nx81=None,
                      rows: Sequence[int] = (0,), tag: str = "trace/sudoku") -> None:
  """Write `sudoku_montage` of each of `rows` (batch rows of `trajectory`, whose puzzles are
  `puzzles_Nx81[row]`) as one TensorBoard image under `tag` (stacked vertically). `writer`: a
  tb_writer.SummaryWriter (anything with write_image(step, tag, image))."""
  images = [sudoku_montage(trajectory, puzzles_Nx81[r], r,
                           None if solutions_Nx81 is None else solutions_Nx81[r]) for r in rows]
  width = max(im.shape[1] for im in images)
  padded = [np.pad(im, ((0, 0), (0, width - im.shape[1]), (0, 0)), constant_values=255)
            for im in images]
  writer.write_image(step, tag, np.concatenate(padded, axis=0))


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

def check_trace_path(path: str, suffixes: Sequence[str] = TRACE_SUFFIXES) -> None:
  """ValueError (one line) unless `path` ends in one of `suffixes` and its directory exists."""
  suffix = os.path.splitext(path)[1].lower()
  if suffix not in suffixes:
    raise ValueError(f"--trace={path!r}: the file must end in {' or '.join(suffixes)}")
  folder = os.path.dirname(os.path.abspath(path))
  if not os.path.isdir(folder):
    raise ValueError(f"--trace={path!r}: directory {folder!r} does not exist")


def write_sudoku_trace(path: str, trajectory, puzzle_81, row: int = 0, solution_81=None) -> int:
  """A Sudoku trace by the file's suffix: .gif (`sudoku_gif`) or .html (the grid's digits per
  step). Returns the number of steps drawn."""
  check_trace_path(path)
  if path.lower().endswith(".gif"):
    return sudoku_gif(trajectory, puzzle_81, path, row, solution_81)
  labels, tokens, entropies, accepted = sudoku_text_trace(trajectory, row)
  return html_trace(tokens, entropies, accepted, path, labels, title="Sudoku denoising trace")


def write_text_trace(path: str, trajectory, decode_token: Callable[[int], str], row: int = 0,
                     title: str = "Denoising trace") -> int:
  """An HTML trace of every canvas row `row` denoised; returns the number of step rows."""
  check_trace_path(path, (".html",))
  labels, tokens, entropies, accepted = text_trace(trajectory, decode_token, row)
  return html_trace(tokens, entropies, accepted, path, labels, title)
