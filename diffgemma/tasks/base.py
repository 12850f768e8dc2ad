"""The task boundary: what a task hands to the generic trainer, evaluator, sampler and SD·RL.

`Task` is what SFT, evaluation and sampling need; `RlTask` adds SD·RL's rollout prompts and
rewards, so a task trained only with SFT implements `Task` alone.

A task owns everything that knows what the tokens mean: turning records into fixed-shape
training sequences, the prompts and references of its held-out sets, the metrics over generated
replies, SD·RL rollout prompts and rewards, and the checks of its own config section. The
generic modules (losses, sampler, evaluation, trainer, sdrl) see only `Layout`, numpy batches,
`Prompts` and the methods below; they never import a task module (`diffgemma.tasks.make_task`
builds one from `config.task.name`).

A training sequence is P prompt slots (left-padded), then K canvases of C tokens:
  tokens_BxL int32, valid_BxL bool (False = padding, never attended), loss_mask_BxL bool
  (supervised target tokens), with L = P + K * C.
A task may pack its training examples instead (`Task.packing`): rows of R slots, each holding
whole examples (their prompt unpadded, then their canvases) back to back; `PackedLayout` says
what such a batch holds.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from diffgemma.sampling import traces


@dataclasses.dataclass(frozen=True)
class Layout:
  """Static sequence shape of a task for one model: P prompt slots, then K canvases of C."""

  prompt_len: int
  num_canvases: int
  canvas_length: int

  def __post_init__(self):
    for name in ("prompt_len", "num_canvases", "canvas_length"):
      if getattr(self, name) < 1:
        raise ValueError(f"layout {name} must be >= 1, got {getattr(self, name)}")

  @property
  def response_len(self) -> int:
    """K * C: the generated slots."""
    return self.num_canvases * self.canvas_length

  @property
  def seq_len(self) -> int:
    """L = P + K * C."""
    return self.prompt_len + self.response_len


@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """Static shape of packed training rows (diffgemma/tasks/packing.py): R slots per row, up to E
  examples per row, each example its prompt (unpadded) then its canvases of C; K bounds the
  canvases of one example (the task's `Layout`).

  A packed batch [B rows]:
    tokens_BxR int32, valid_BxR bool (False on the row's padding after its last example),
    loss_mask_BxR bool (every slot of the examples' canvases, as in `Layout`);
    segment_ids_BxR int32: j + 1 on the slots of the row's j-th example, 0 on padding;
    positions_BxR int32: each slot's offset in its example (RoPE restarts at 0), 0 on padding;
    canvas_start_BxE int32: the row slot of example j's first canvas (0: no example j);
    num_canvases_BxE int32: example j's canvases (0: no example j in this row).
  """

  row_tokens: int
  row_examples: int
  canvas_length: int
  num_canvases: int

  def __post_init__(self):
    for name in ("row_tokens", "row_examples", "canvas_length", "num_canvases"):
      if getattr(self, name) < 1:
        raise ValueError(f"packed layout {name} must be >= 1, got {getattr(self, name)}")

  @property
  def seq_len(self) -> int:
    """R: the slots of one row."""
    return self.row_tokens


@dataclasses.dataclass(frozen=True)
class ImageSlots:
  """The image inputs beside each row of a task that reads images: `count` slots (I) of
  `max_patches` patches (M) of `patch_dim` values (3 * patch_size**2); training batches carry
  pixel_values [B, I, M, patch_dim] float32 and image_position_ids [B, I, M, 2] int32 (unused
  slots all padding), held-out `Prompts` the same per row."""

  count: int
  max_patches: int
  patch_dim: int


@dataclasses.dataclass(frozen=True)
class Prompts:
  """Sampler inputs and what the task needs to score the replies.

  prompt_NxP: int32, left-padded to the task's prompt length; valid_NxP: bool (False = pad).
  references: one entry per row (a list, or an array with rows first), opaque to generic code
  (the task's `score` and `reward` read it); `take` keeps it aligned with the rows.
  records: optional per-row dicts written beside the predictions (e.g. the source line).
  fixed_NxL, fixed_mask_NxL: infilling (optional, both or neither): int32 / bool over the K*C
  reply slots, the clean tokens the sampler keeps in the canvases (`sampler.generate`'s
  fixed_BxL / fixed_mask_BxL, laid out by `sampler.infill_slots`).
  pixel_values_NxIxMxD, image_positions_NxIxMx2: image prompts (optional, both or neither):
  each row's I image slots as the vision tower takes them (float32 patches [M = max patches,
  D = 3 * patch_size**2] and int32 (x, y) patch positions, (-1, -1) for padding patches and
  absent images; diffgemma/io/image_processing.py), filling the prompt's image placeholders in
  order.
  """

  prompt_NxP: np.ndarray
  valid_NxP: np.ndarray
  references: Sequence[Any]
  records: Sequence[dict] | None = None
  fixed_NxL: np.ndarray | None = None
  fixed_mask_NxL: np.ndarray | None = None
  pixel_values_NxIxMxD: np.ndarray | None = None
  image_positions_NxIxMx2: np.ndarray | None = None

  def __post_init__(self):
    if (self.fixed_NxL is None) != (self.fixed_mask_NxL is None):
      raise ValueError("Prompts: give fixed_NxL and fixed_mask_NxL together")
    if (self.pixel_values_NxIxMxD is None) != (self.image_positions_NxIxMx2 is None):
      raise ValueError("Prompts: give pixel_values_NxIxMxD and image_positions_NxIxMx2 together")

  def __len__(self) -> int:
    return len(self.prompt_NxP)

  def take(self, index) -> Prompts:
    """The rows `index` (a slice or an integer array), in that order."""
    rows = np.arange(len(self))[index]

    def pick(seq):
      if seq is None or isinstance(seq, np.ndarray):
        return None if seq is None else seq[rows]
      return [seq[int(i)] for i in rows]

    return Prompts(self.prompt_NxP[rows], self.valid_NxP[rows], pick(self.references),
                   pick(self.records), pick(self.fixed_NxL), pick(self.fixed_mask_NxL),
                   pick(self.pixel_values_NxIxMxD), pick(self.image_positions_NxIxMx2))

  def repeat(self, times: int) -> Prompts:
    """Each row `times` times in a row (SD·RL groups): row i becomes rows i*G .. i*G+G-1."""
    return self.take(np.repeat(np.arange(len(self)), times))

  def cut_to(self, width: int) -> Prompts:
    """These prompts in their last `width` slots (`needed_widths`); ValueError (one line) if
    that would cut a valid slot."""
    p = self.prompt_NxP.shape[1]
    if width >= p:
      return self
    if self.valid_NxP[:, :p - width].any():
      raise ValueError(f"cannot cut prompts to {width} slots: the longest needs "
                       f"{int(self.needed_widths().max())}")
    return dataclasses.replace(self, prompt_NxP=self.prompt_NxP[:, p - width:],
                               valid_NxP=self.valid_NxP[:, p - width:])

  def bucketed(self) -> Prompts:
    """These prompts cut to the smallest of `prompt_widths(P)` that holds their longest one
    (one of PROMPT_WIDTH_LEVELS compiled widths; only left padding is cut)."""
    p = self.prompt_NxP.shape[1]
    return self.cut_to(prompt_width(int(self.needed_widths().max(initial=0)), p))

  def needed_widths(self) -> np.ndarray:
    """[N] int: the prompt slots each row needs, from its first valid slot to the end (the
    left padding before it can be cut; 0 for a row with no valid slot)."""
    p = self.valid_NxP.shape[1]
    first_N = np.argmax(self.valid_NxP, axis=1)
    return np.where(self.valid_NxP.any(axis=1), p - first_N, 0)


# Prompt widths a batch of left-padded prompts is cut to (`prompt_widths`): P, P/2, P/4, P/8
# (rounded up to 16), so one run compiles at most this many sampler programs per batch size.
PROMPT_WIDTH_LEVELS = 4


def prompt_widths(full: int, levels: int = PROMPT_WIDTH_LEVELS) -> tuple[int, ...]:
  """The widths (ascending, the last `full`) a batch of `full`-slot prompts may be cut to:
  full / 2**k rounded up to a multiple of 16, k < levels. A batch takes the smallest that
  holds its longest prompt, so the compiled shapes stay at most `levels`, and a batch wider
  than the smallest keeps under about half its width as left padding."""
  widths = {full}
  for k in range(1, levels):
    width = -(-full // 2 ** k)  # ceil
    width = -(-width // 16) * 16
    if width < full:
      widths.add(width)
  return tuple(sorted(widths))


def prompt_width(longest: int, full: int, levels: int = PROMPT_WIDTH_LEVELS) -> int:
  """The smallest of `prompt_widths(full, levels)` that holds `longest` slots."""
  return next(w for w in prompt_widths(full, levels) if w >= min(longest, full))


class Task(abc.ABC):
  """One task for SFT, evaluation and sampling: data, held-out metrics, text in and out.

  Built by `diffgemma.tasks.make_task(config)` after the model architecture is final (a run
  started from a checkpoint adopts the checkpoint's canvas length first). A task that SD·RL can
  train on also implements `RlTask`.
  """

  name: str = ""
  # The metric of `score` that sweeps, comparisons and the periodic eval report first.
  headline_metric: str = "accuracy"

  # ---------------------------------------------------------------- shapes and sampling

  @property
  @abc.abstractmethod
  def layout(self) -> Layout:
    """P, K, C of every training sequence and of the sampler's prompts and budget."""

  @property
  def packing(self) -> PackedLayout | None:
    """The packed rows `train_batches` yields (None: one example per row, in `layout`)."""
    return None

  @property
  def stop_token_ids(self) -> tuple[int, ...]:
    """Ids that end a reply besides the model's EOS (e.g. a chat model's end-of-turn)."""
    return ()

  @property
  def min_vocab_size(self) -> int:
    """The smallest model vocabulary that holds every id the task produces."""
    return 0

  @property
  def image_slots(self) -> ImageSlots | None:
    """The image inputs beside each row (training batches and held-out prompts), or None: the
    task is text only."""
    return None

  # ---------------------------------------------------------------- training data

  @abc.abstractmethod
  def train_batches(self, batch_size: int, num_steps: int, start_step: int = 0,
                    process_index: int = 0, process_count: int = 1) -> Iterator[dict]:
    """Batches for steps start_step .. num_steps-1: dicts of numpy tokens / valid / loss_mask
    [B / process_count, L] (a packing task: B rows of `PackedLayout`'s arrays). A pure function
    of the step (a resumed run sees exactly the batches an uninterrupted one would); process i
    gets its share of each global batch."""

  def data_report(self) -> str | None:
    """A few lines on the training data for the log (e.g. examples cut or dropped), or None."""
    return None

  # ---------------------------------------------------------------- evaluation

  def headline_metric_for(self, prompts: Prompts) -> str:
    """The headline metric of `score` on these prompts (e.g. a chat task's infill metric on
    infill data); default `headline_metric`."""
    del prompts
    return self.headline_metric

  @abc.abstractmethod
  def eval_prompts(self) -> Prompts | None:
    """The held-out set of the periodic evaluation during training (None: none configured)."""

  @abc.abstractmethod
  def load_eval_file(self, path: str, limit: int | None = None) -> Prompts:
    """A held-out set from a file (eval.py --data); one-line errors for malformed input."""

  @abc.abstractmethod
  def score(self, prompts: Prompts, tokens_NxL: np.ndarray, stats: dict[str, np.ndarray]
            ) -> tuple[dict[str, float], list[dict]]:
    """Metrics over generated replies (tokens [N, K*C] as the sampler returns them; per-row
    sampler stats) and one prediction record per row (JSON-serialisable). Metrics include
    the task's headline accuracy; generic code adds the sampler statistics."""

  def plateau_warning(self, step: int, metrics: dict[str, float]) -> str | None:
    """A one-line hint when periodic-eval metrics look unhealthy at `step`, else None."""
    del step, metrics
    return None

  def profile_trajectory(self, prompts: Prompts, trajectory) -> dict | None:
    """Optional per-denoising-step sums over recorded trajectories (eval.py --trajectory_stats):
    {key: [N] float64} with a "rows" entry counting the examples that ran each step; sums, so
    batches add up. None: the task has no profile."""
    del prompts, trajectory
    return None

  def seen_split(self, records: list[dict], train_paths: Sequence[str]) -> dict | None:
    """Optional (eval.py --seen_in): the headline metric on held-out examples whose prompt is
    and is not in the training files `train_paths`, from `score`'s records. None: the task has
    no such split."""
    del records, train_paths
    return None

  def format_profile(self, profile: dict) -> str:
    """A step profile (per-example means, as `evaluation.evaluate` returns it) as a table."""
    return "\n".join(f"{key}: {values}" for key, values in profile.items())

  # ---------------------------------------------------------------- sampling from text

  @abc.abstractmethod
  def prompt_from_text(self, text: str) -> Prompts:
    """One prompt typed by a user (sample.py --prompt), validated, as a 1-row batch."""

  @abc.abstractmethod
  def prompt_text(self, prompts: Prompts, row: int = 0) -> str:
    """Row `row`'s prompt as text for people."""

  @abc.abstractmethod
  def reply_text(self, tokens, prompts: Prompts | None = None, row: int = 0,
                 first_slot: int = 0) -> str:
    """Generated tokens as text for people (a chat reply; a Sudoku grid with its givens marked
    when `prompts` is given). `first_slot`: where `tokens` start in the reply (a later canvas
    shown on its own starts at k * C)."""

  def verdict(self, prompts: Prompts, tokens, row: int = 0) -> str | None:
    """A one-line judgement of a finished reply against the prompt (None: nothing to say)."""
    del prompts, tokens, row
    return None

  @abc.abstractmethod
  def token_strings(self, tokens: Sequence[int]) -> list[str]:
    """Each token as a short string, for denoising traces."""

  # ---------------------------------------------------------------- denoising traces

  trace_suffixes: tuple[str, ...] = traces.HTML_SUFFIXES  # what write_trace can draw

  def write_trace(self, path: str, prompts: Prompts, trajectory, row: int = 0) -> int:
    """Row `row`'s denoising steps to `path` (HTML: the canvas tokens of every step, shaded by
    entropy); returns the number of steps drawn."""
    del prompts
    return traces.write_text_trace(path, trajectory, self._token_string, row)

  def log_traces(self, writer, step: int, prompts: Prompts, trajectory, rows=(0,)) -> None:
    """A few rows' denoising steps to TensorBoard beside the periodic eval's scalars."""
    del prompts
    traces.log_text_traces(writer, step, trajectory, self._token_string, rows)

  def _token_string(self, token: int) -> str:
    return self.token_strings([token])[0]



class RlTask(Task):
  """A task SD·RL can train on: rollout prompts and a verifier's reward, on top of `Task`."""

  @abc.abstractmethod
  def rollout_prompts(self, iteration: int, num_prompts: int) -> Prompts:
    """SD·RL iteration `iteration`'s prompts: a pure function of (config, iteration)."""

  @abc.abstractmethod
  def reward(self, prompts: Prompts, tokens_BxL: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(score_B float in [0, 1], correct_B bool) of generated rows against their references."""

  def token_weights(self, prompts: Prompts, tokens_BxL: np.ndarray) -> np.ndarray | None:
    """Optional per-token weights [B, L] of the SD·RL distillation target (None: all 1)."""
    del prompts, tokens_BxL
    return None

  def reference_reply(self, prompts: Prompts) -> np.ndarray | None:
    """Optional: each row's reference reply as the sampler would write it, int32 [B, L] over
    the layout's K*C reply slots (what SFT trains the canvases toward: the reply, then the
    task's end fill). SD·RL's `sdrl.target="verified"` trains wrong rows toward it; None: the
    task has no reference (a reward-only verifier)."""
    del prompts
    return None
