"""The Sudoku task's denoising traces: the 9x9 grid after every step (Pillow).

  sudoku_frame / sudoku_frames     the grid after a step, as uint8 [H, W, 3]
  sudoku_gif                       one GIF frame per step the row ran on the grid canvas
  sudoku_montage                   a few of those frames side by side (a TensorBoard image)
  sudoku_text_trace                the grid's digits per step, for the HTML trace
  log_sudoku_traces / write_sudoku_trace   TensorBoard images; what `sample.py --trace` calls
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from diffgemma.sampling.traces import TraceStep, check_trace_path, html_trace, trace_steps
from diffgemma.tasks import sudoku_tokens as data
from diffgemma.tasks import sudoku_puzzles

TRACE_SUFFIXES = (".gif", ".html")


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

  digits = np.asarray(digits_81).reshape(sudoku_puzzles.NUM_CELLS)
  puzzle = np.asarray(puzzle_81).reshape(sudoku_puzzles.NUM_CELLS)
  accepted = np.asarray(accepted_81, bool).reshape(sudoku_puzzles.NUM_CELLS)
  solution = (None if solution_81 is None
              else np.asarray(solution_81).reshape(sudoku_puzzles.NUM_CELLS))
  side = sudoku_puzzles.SIZE * cell_px
  scale = cell_px / CELL_PX
  header_px, footer_px, margin = (int(round(x * scale)) for x in (HEADER_PX, FOOTER_PX,
                                                                   MARGIN_PX))
  image = Image.new("RGB", (side + 2 * margin, header_px + side + footer_px + margin), WHITE)
  draw = ImageDraw.Draw(image)
  digit_font, small_font = _font(int(cell_px * 0.62)), _font(max(int(cell_px * 0.34), 8))
  draw.text((margin, header_px // 2), header, fill=BLACK, font=small_font, anchor="lm")
  top = header_px
  for cell in range(sudoku_puzzles.NUM_CELLS):
    r, c = divmod(cell, sudoku_puzzles.SIZE)
    x0, y0 = margin + c * cell_px, top + r * cell_px
    given = puzzle[cell] != sudoku_puzzles.BLANK
    bg = GIVEN_BG if given else ACCEPTED_BG if accepted[cell] else WHITE
    draw.rectangle((x0, y0, x0 + cell_px, y0 + cell_px), fill=bg)
    if given and accepted[cell]:
      corner = cell_px * 0.3
      draw.polygon([(x0, y0), (x0 + corner, y0), (x0, y0 + corner)], fill=ACCEPTED_MARK)
    digit = int(digits[cell])
    wrong = (given and digit != puzzle[cell]) or (
        solution is not None and digit != sudoku_puzzles.BLANK and digit != solution[cell])
    fg = WRONG_FG if wrong else BLACK if given else FILLED_FG
    if not accepted[cell]:
      fg = _blend(fg, bg, DIM)
    text = str(digit) if digit != sudoku_puzzles.BLANK else "·"
    draw.text((x0 + cell_px / 2, y0 + cell_px / 2), text, fill=fg, font=digit_font, anchor="mm",
              stroke_width=1 if given else 0, stroke_fill=fg)
  for i in range(sudoku_puzzles.SIZE + 1):  # thin cell lines, thick box lines
    width = 3 if i % sudoku_puzzles.BOX == 0 else 1
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
  blanks = np.asarray(puzzle_81).reshape(-1) == sudoku_puzzles.BLANK
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



def sudoku_text_trace(trajectory, row: int = 0):
  """`text_trace` of the grid canvas with digits as tokens ('·' where the argmax is no digit),
  each followed by a space, and by '‖' at the end of a grid row."""
  steps = _sudoku_steps(trajectory, row)
  cells = slice(0, data.CANVAS_LEN)
  ends = ["‖ " if (i + 1) % sudoku_puzzles.SIZE == 0 and i + 1 < sudoku_puzzles.NUM_CELLS else ""
          for i in range(sudoku_puzzles.NUM_CELLS)]
  tokens = [[(str(d) if d else "·") + " " + end
             for d, end in zip(data.tokens_to_digits(s.tokens_C[cells]), ends)] for s in steps]
  return ([s.label for s in steps], tokens, [s.entropy_C[cells] for s in steps],
          [s.accepted_C[cells] for s in steps])




# ----------------------------------------------------------------------------- TensorBoard, sample.py


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


def write_sudoku_trace(path: str, trajectory, puzzle_81, row: int = 0, solution_81=None) -> int:
  """A Sudoku trace by the file's suffix: .gif (`sudoku_gif`) or .html (the grid's digits per
  step). Returns the number of steps drawn."""
  check_trace_path(path, TRACE_SUFFIXES, make_folders=True)
  if path.lower().endswith(".gif"):
    return sudoku_gif(trajectory, puzzle_81, path, row, solution_81)
  labels, tokens, entropies, accepted = sudoku_text_trace(trajectory, row)
  return html_trace(tokens, entropies, accepted, path, labels, title="Sudoku denoising trace")
