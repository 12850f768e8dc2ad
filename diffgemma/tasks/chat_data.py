"""Chat data for the chat task: JSONL readers, examples, the canvas layout and the grain pipeline.

Formats (one JSON object per line; blank lines are skipped):
  {"messages": [{"role": "system" | "user" | "assistant", "content": "..."}, ...]}
  {"prompt": "...", "completion": "..."}                  -> one user turn, one assistant turn
  {"conversations": [{"from": "system" | "human" | "gpt", "value": "..."}, ...]}   (ShareGPT)
Every line is checked: valid JSON, one of the formats, known roles, non-empty contents, an
assistant turn, and a user turn before the first assistant turn. A bad line is a `ChatDataError`
naming the file and line.
Thoughts: an assistant turn (of "messages" or "conversations") may carry its thought, as
transformers' chat templates take it, under "reasoning_content" (or "thinking" / "reasoning"):
  {"role": "assistant", "content": "4", "reasoning_content": "2 + 2 is 4."}
It is kept as the message's "reasoning_content" (an empty one is no thought); training writes it
in the template's thinking channel before the answer (diffgemma/tasks/chat.py).
Images ("messages" format): a turn's content may be a list of parts, as transformers' chat
templates take them,
  {"role": "user", "content": [{"type": "image", "path": "img/0001.png"},
                               {"type": "text", "text": "What colour is the triangle?"}]}
image parts in user turns only, their paths relative to the JSONL file (an absolute path is
kept); every image must exist when the file is read (the chat task decodes each one before a
run writes anything). The chat template places each image (Gemma 4's writes its image token);
the chat task expands it to the image's placeholder and hands the pixels beside the tokens
(diffgemma/tasks/chat.py). A list of text parts reads as its parts' texts, each trimmed, joined
(`message_text`: what Gemma 4's template writes).
Infill records (scripts/make_chat_task.py --task=infill_count) add, in any format,
  "infill": {"prefix": P, "middle": M, "suffix": S}     with P + M + S == the last assistant turn
(M and S non-empty, P may be empty): training reads the conversation as any other; evaluation
gives P and S and scores the generated middle against M (diffgemma/tasks/chat.py).

Examples. A conversation gives one training example per assistant turn: the prompt is the chat
template's rendering of the turns before it with the generation prompt (BOS included); the
target is the turn's content (stripped, as Gemma's templates render it) then the end-of-turn
marker. A held-out (evaluation) example is a conversation's last assistant turn; its reference
is that turn's content.

Layout (static shapes: `Layout` P, K, C; I = data.max_images image slots):
  tokens   [P + K*C]: the prompt left-padded with PAD to P, then the target, then EOS up to the
           end of its last canvas, then PAD canvases;
  valid    False on the prompt's padding and on the PAD canvases (never attended);
  loss_mask True on every slot of the target's canvases (EOS fill included: the sampler learns
           to stop), False elsewhere;
  with I > 0, the prompt's images in order (diffgemma/io/image_processing.py's arrays):
  pixel_values       float32 [I, max_patches, 3 * patch_size**2], absent images all 0;
  image_position_ids int32 [I, max_patches, 2], padding patches and absent images (-1, -1).
Overflow (`data.overflow`), counted per policy by `OverflowCounts`:
  prompt longer than P:   truncate_left keeps BOS and the last P - 1 ids (the newest turns and
                          the generation prompt), unless that cuts an image's tokens (then an
                          error: an image is whole or not there); drop skips the example; error
                          raises.
  target longer than K*C: truncate_left keeps the first K*C ids (the reply's beginning; no
                          end-of-turn then, as the reply goes on past the budget); drop; error.

Pipeline: record r of training is a pure function of r (r = step * B + row): each file's
examples in a seeded order that changes every epoch, files mixed by weight. A resumed run
therefore sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence

import grain
import numpy as np

from diffgemma import errors
from diffgemma.tasks.base import Layout

OVERFLOW_POLICIES = ("truncate_left", "drop", "error")
SHAREGPT_ROLES = {"system": "system", "human": "user", "gpt": "assistant"}
ROLES = ("system", "user", "assistant")
PART_TYPES = ("text", "image")
_SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: json.loads keeps it


class ChatDataError(errors.InputError):
  """A malformed data file or example; one line naming the file (and line)."""


@dataclasses.dataclass(frozen=True)
class Conversation:
  """The messages of one JSONL line: dicts {"role", "content"} (an assistant turn's thought
  under "reasoning_content"), roles in ROLES, a content a string or a list of parts (image paths
  resolved against the file's folder)."""

  path: str
  line: int
  messages: tuple[dict, ...]
  infill: tuple[str, str, str] | None = None  # (prefix, middle, suffix) of the last reply

  @property
  def source(self) -> str:
    return f"{self.path}:{self.line}"

  @property
  def images(self) -> tuple[str, ...]:
    """Every image path of the conversation, in the order the template places them."""
    return image_paths(self.messages)


def image_paths(messages: Sequence[dict]) -> tuple[str, ...]:
  """The image parts' paths of `messages`, turn by turn, part by part (the order transformers
  collects them in and its processor fills the placeholders in)."""
  return tuple(part["path"] for m in messages if not isinstance(m["content"], str)
               for part in m["content"] if part["type"] == "image")


def message_text(message: dict) -> str:
  """A turn's text: its content string, or its text parts each trimmed and joined (as Gemma 4's
  template writes a list), images left out."""
  content = message["content"]
  if isinstance(content, str):
    return content
  return "".join(part["text"].strip() for part in content if part["type"] == "text")


# ----------------------------------------------------------------------------- reading


def read_jsonl(path: str) -> list[Conversation]:
  """Every conversation of a JSONL file, each line checked (see the module docstring).

  Raises:
    ChatDataError: the file cannot be read, is empty, or a line is malformed.
  """
  if not os.path.isfile(path):
    raise ChatDataError(f"data file {path} not found")
  conversations = []
  try:
    with open(path, encoding="utf-8-sig") as f:  # a leading byte-order mark is not content
      for number, text in enumerate(f, start=1):
        if not text.strip():
          continue
        try:
          record = json.loads(text)
        except ValueError as e:
          raise ChatDataError(f"{path}:{number}: not JSON ({_first_line(e)})") from None
        except RecursionError:  # the json module's C parser recurses once per nesting level
          raise ChatDataError(f"{path}:{number}: JSON nested too deeply to read; a line holds "
                              "one conversation, {\"messages\": [...]}") from None
        try:
          messages = parse_record(record, os.path.dirname(os.path.abspath(path)))
          infill = parse_infill(record, messages)
        except ValueError as e:
          raise ChatDataError(f"{path}:{number}: {e}") from None
        conversations.append(Conversation(path, number, messages, infill))
  except (OSError, UnicodeDecodeError) as e:
    raise ChatDataError(f"cannot read {path}: {_first_line(e)}") from None
  if not conversations:
    raise ChatDataError(f"data file {path} has no examples")
  return conversations


def parse_record(record, folder: str | None = None) -> tuple[dict, ...]:
  """A record in one of the three formats as messages; ValueError (one line) if malformed.
  `folder`: where image paths are relative to (the JSONL file's folder); None refuses images."""
  if not isinstance(record, dict):
    raise ValueError(f"expected a JSON object, got {type(record).__name__}")
  if "messages" in record:
    raw, role_key, text_key, roles = record["messages"], "role", "content", {r: r for r in ROLES}
  elif "conversations" in record:
    raw, role_key, text_key, roles = record["conversations"], "from", "value", SHAREGPT_ROLES
  elif "prompt" in record or "completion" in record:
    raw = [{"role": "user", "content": record.get("prompt")},
           {"role": "assistant", "content": record.get("completion")}]
    role_key, text_key, roles = "role", "content", {r: r for r in ROLES}
  else:
    raise ValueError('expected "messages", "prompt"/"completion" or "conversations"; got keys '
                     f"{sorted(record)}")
  if not isinstance(raw, list) or not raw:
    raise ValueError("the conversation must be a non-empty list of turns")
  parts_allowed = "messages" in record  # content parts: the messages format's
  messages = []
  for i, turn in enumerate(raw, start=1):
    if not isinstance(turn, dict):
      raise ValueError(f"turn {i} is not an object")
    role = turn.get(role_key)
    if not isinstance(role, str) or role not in roles:  # a list or object is no role either
      raise ValueError(f"turn {i} has unknown role {role!r}; expected one of {tuple(roles)}")
    content = turn.get(text_key)
    where = f"turn {i} ({role})"
    if isinstance(content, list) and parts_allowed:
      content = _parts(content, roles[role], where, folder)
    elif not isinstance(content, str):
      raise ValueError(f"{where} has no string {text_key!r}" + (
          " or list of parts" if parts_allowed else ""))
    else:
      _check_text(content, where)
    message = {"role": roles[role], "content": content}
    thought = parse_thought(turn, i, roles[role])
    if thought:
      message[THOUGHT_KEY] = thought
    messages.append(message)
  kinds = [m["role"] for m in messages]
  if "assistant" not in kinds:
    raise ValueError("no assistant turn")
  first = kinds.index("assistant")
  if "user" not in kinds[:first]:
    raise ValueError(f"assistant turn {first + 1} comes before any user turn")
  return tuple(messages)


# Where a turn's thought may be (transformers' names; the first is the one kept).
THOUGHT_KEYS = ("reasoning_content", "thinking", "reasoning")
THOUGHT_KEY = THOUGHT_KEYS[0]


def parse_thought(turn: dict, index: int, role: str) -> str | None:
  """A turn's thought (None without one); ValueError (one line) if it is not a string, is on a
  turn other than the assistant's, or two names give different thoughts."""
  given = {k: turn[k] for k in THOUGHT_KEYS if turn.get(k) is not None}
  if not given:
    return None
  if len(set(map(repr, given.values()))) > 1:
    raise ValueError(f"turn {index} ({role}) gives different thoughts under {sorted(given)}; "
                     "keep one")
  key, thought = next(iter(given.items()))
  if role != "assistant":
    raise ValueError(f"turn {index} ({role}) has a thought ({key!r}); only assistant turns do")
  if not isinstance(thought, str):
    raise ValueError(f"turn {index} ({role}) has a {type(thought).__name__} {key!r}; a thought "
                     "is a string")
  unpaired = _SURROGATE.search(thought)
  if unpaired:
    raise ValueError(f"turn {index} ({role}) has a thought holding an unpaired surrogate "
                     f"{unpaired[0]!r}; write the whole character")
  return thought


def _check_text(text: str, where: str) -> None:
  if not text.strip():
    raise ValueError(f"{where} is empty")
  unpaired = _SURROGATE.search(text)
  if unpaired:  # a JSON escape such as \ud800 alone: no UTF-8 text to tokenize
    raise ValueError(f"{where} holds an unpaired surrogate {unpaired[0]!r} (a \\u escape of "
                     "half a character); write the whole character")


def _parts(content: list, role: str, where: str, folder: str | None) -> list[dict]:
  """A content list's parts checked: {"type": "text", "text"} or, in user turns,
  {"type": "image", "path"} (resolved against `folder`; the file must exist)."""
  if not content:
    raise ValueError(f"{where} has an empty list of parts")
  parts = []
  for n, part in enumerate(content, start=1):
    here = f"{where} part {n}"
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or kind not in PART_TYPES:
      raise ValueError(f'{here} must be {{"type": "text", "text": ...}} or {{"type": "image", '
                       f'"path": ...}}, got {_short(part)}')
    if kind == "text":
      if not isinstance(part.get("text"), str):
        raise ValueError(f'{here} has no string "text"')
      _check_text(part["text"], here)
      parts.append({"type": "text", "text": part["text"]})
      continue
    if role != "user":
      raise ValueError(f"{here} is an image; images go in user turns")
    path = part.get("path")
    if not isinstance(path, str) or not path.strip() or _SURROGATE.search(path):
      raise ValueError(f'{here} is an image without a "path" (a file path relative to the '
                       "JSONL file)")
    if folder is None:
      raise ValueError(f"{here} is an image, and this reader takes text only")
    resolved = os.path.normpath(os.path.join(folder, path))
    if not os.path.isfile(resolved):
      raise ValueError(f"{here}: image {path} not found ({resolved})")
    parts.append({"type": "image", "path": resolved})
  return parts


def _short(value) -> str:
  text = json.dumps(value, ensure_ascii=True)
  return text if len(text) <= 60 else text[:57] + "..."


INFILL_PARTS = ("prefix", "middle", "suffix")


def parse_infill(record: dict, messages: Sequence[dict]) -> tuple[str, str, str] | None:
  """A record's "infill" split of its last assistant turn (module docstring) as (prefix,
  middle, suffix); None without one; ValueError (one line) if malformed."""
  if "infill" not in record:
    return None
  infill = record["infill"]
  if not isinstance(infill, dict) or sorted(infill) != sorted(INFILL_PARTS):
    raise ValueError(f'"infill" must be an object with exactly {list(INFILL_PARTS)}')
  parts = tuple(infill[k] for k in INFILL_PARTS)
  if not all(isinstance(p, str) for p in parts):
    raise ValueError(f'"infill" {list(INFILL_PARTS)} must be strings')
  if not parts[1] or not parts[2]:
    raise ValueError('"infill" needs a non-empty middle and suffix (the prefix may be empty)')
  reply = next(message_text(m) for m in reversed(messages) if m["role"] == "assistant")
  if "".join(parts) != reply:
    raise ValueError('"infill" prefix + middle + suffix is not the last assistant turn '
                     f"({''.join(parts)!r} against {reply!r})")
  if reply != reply.strip():  # training strips the reply, which would move every slot
    raise ValueError('an "infill" reply must not start or end with whitespace')
  return parts


# ----------------------------------------------------------------------------- overflow


@dataclasses.dataclass
class OverflowCounts:
  """How many examples each overflow policy touched (prompts and targets separately)."""

  examples: int = 0  # examples kept
  prompt_truncated: int = 0
  prompt_dropped: int = 0
  target_truncated: int = 0
  target_dropped: int = 0

  def add(self, other: OverflowCounts) -> OverflowCounts:
    return OverflowCounts(*(a + b for a, b in zip(dataclasses.astuple(self),
                                                  dataclasses.astuple(other))))

  def describe(self) -> str:
    touched = [f"{n} {what}" for n, what in (
        (self.prompt_truncated, "prompts cut from the left"),
        (self.prompt_dropped, "dropped for a long prompt"),
        (self.target_truncated, "replies cut to the canvases"),
        (self.target_dropped, "dropped for a long reply")) if n]
    noun = "example" if self.examples == 1 else "examples"
    return f"{self.examples} {noun}" + (f" ({', '.join(touched)})" if touched else "")


def fit_prompt(ids: Sequence[int], prompt_len: int, bos_id: int, policy: str, where: str,
               counts: OverflowCounts, image_ids: Sequence[int] = ()) -> list[int] | None:
  """The prompt ids cut to `prompt_len` under `policy` (None: drop the example). A cut that
  would remove any of `image_ids` (the image tokens: boi, image, eoi) is an error instead."""
  ids = list(ids)
  if len(ids) <= prompt_len:
    return ids
  num_image = int(np.isin(ids, list(image_ids)).sum()) if image_ids else 0
  holds = f" with {num_image} image tokens" if num_image else ""
  if policy == "error":
    raise ChatDataError(f"{where}: the prompt is {len(ids)} tokens{holds}, longer than "
                        f"data.prompt_len={prompt_len}; raise it or set data.overflow to "
                        "truncate_left or drop")
  if policy == "drop":
    counts.prompt_dropped += 1
    return None
  head = ids[:1] if ids[0] == bos_id else []
  cut = len(ids) - (prompt_len - len(head))
  if num_image and np.isin(ids[len(head):cut], list(image_ids)).any():
    raise ChatDataError(f"{where}: the prompt is {len(ids)} tokens{holds}, longer than "
                        f"data.prompt_len={prompt_len}, and cutting it would cut an image; "
                        "raise data.prompt_len or set data.overflow=drop")
  counts.prompt_truncated += 1
  return head + ids[cut:]


def fit_target(ids: Sequence[int], response_len: int, policy: str, where: str,
               counts: OverflowCounts) -> list[int] | None:
  """The target ids cut to `response_len` = K * C under `policy` (None: drop the example)."""
  ids = list(ids)
  if len(ids) <= response_len:
    return ids
  if policy == "error":
    raise ChatDataError(f"{where}: the reply is {len(ids)} tokens with its end-of-turn, longer "
                        f"than data.num_canvases x canvas_length = {response_len}; raise "
                        "data.num_canvases or set data.overflow to truncate_left or drop")
  if policy == "drop":
    counts.target_dropped += 1
    return None
  counts.target_truncated += 1
  return ids[:response_len]


# ----------------------------------------------------------------------------- images


def check_images(num_images: int, has_vision_tower: bool, max_images: int, where: str) -> None:
  """An example's images against the model and the layout. ChatDataError (one line, naming
  `where`) when it has images and the model has no vision tower, or more images than the
  layout's `max_images` slots (data.max_images)."""
  if not num_images:
    return
  noun = "image" if num_images == 1 else "images"
  if not has_vision_tower:
    raise ChatDataError(f"{where}: holds {num_images} {noun} but the model has no vision tower; "
                        "start from a checkpoint with one (a vision_config in its config.json) "
                        "or give text only")
  if num_images > max_images:
    raise ChatDataError(f"{where}: holds {num_images} {noun}, more than data.max_images="
                        f"{max_images} image slots per example; raise data.max_images")


# ----------------------------------------------------------------------------- layout


def num_target_canvases(target_len: int, canvas_len: int) -> int:
  """Canvases a target of this many ids occupies (at least one)."""
  return max(1, -(-target_len // canvas_len))


def left_pad(ids: Sequence[int], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [length] int32, valid [length] bool) of `ids` left-padded with `pad_id`."""
  n = len(ids)
  if n > length:
    raise ValueError(f"{n} ids do not fit {length} slots")
  tokens = np.full(length, pad_id, np.int32)
  tokens[length - n:] = ids
  return tokens, np.arange(length) >= length - n


def layout_example(prompt_ids: Sequence[int], target_ids: Sequence[int], layout: Layout,
                   pad_id: int, eos_id: int) -> dict:
  """One training sequence (module docstring): tokens int32, valid and loss_mask bool, each
  [P + K*C]. The ids must already fit (`fit_prompt`, `fit_target`)."""
  p, c, r = layout.prompt_len, layout.canvas_length, layout.response_len
  prompt, prompt_valid = left_pad(prompt_ids, p, pad_id)
  n = len(target_ids)
  if n > r:
    raise ValueError(f"a target of {n} ids does not fit {r} canvas slots")
  filled = num_target_canvases(n, c) * c
  response = np.full(r, pad_id, np.int32)
  response[:filled] = eos_id
  response[:n] = target_ids
  supervised = np.arange(r) < filled
  return {"tokens": np.concatenate([prompt, response]),
          "valid": np.concatenate([prompt_valid, supervised]),
          "loss_mask": np.concatenate([np.zeros(p, bool), supervised])}


# ----------------------------------------------------------------------------- pipeline


def mixed_order(sizes: Sequence[int], weights: Sequence[float], seed: int, stream: int = 0
                ) -> grain.MapDataset:
  """An infinite index dataset of (file, example) pairs: each file's examples shuffled anew
  every epoch (seeded per file and stream), files interleaved in proportion to `weights`.
  Entry r is a pure function of (sizes, weights, seed, stream, r)."""
  parts = []
  for f, size in enumerate(sizes):
    pairs = [(f, i) for i in range(size)]
    file_seed = int(np.random.default_rng([seed, stream, f]).integers(0, 2**32))
    parts.append(grain.MapDataset.source(pairs).shuffle(file_seed).repeat())
  if len(parts) == 1:
    return parts[0]
  return grain.MapDataset.mix(parts, list(weights))


def batches(order: grain.MapDataset, example_fn, batch_size: int, num_steps: int,
            start_step: int, process_index: int, process_count: int, num_threads: int,
            prefetch: int):
  """Iterator of batches for steps start_step .. num_steps-1: record r = step * B + row of
  `order` through `example_fn`; process i gets rows [i*B/n, (i+1)*B/n) of each global batch."""
  if batch_size % process_count:
    raise ValueError(f"batch_size={batch_size} is not divisible by {process_count} processes")
  local = batch_size // process_count
  rows = np.arange(start_step * batch_size, num_steps * batch_size).reshape(-1, batch_size)
  rows = rows[:, process_index * local:(process_index + 1) * local].reshape(-1)
  dataset = (grain.MapDataset.range(len(rows)).map(lambda i: example_fn(order[int(rows[i])]))
             .batch(local, drop_remainder=True))
  read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
  return iter(dataset.to_iter_dataset(read))


def split_held_out(conversations: Sequence[Conversation], fraction: float, seed: int,
                   file_index: int) -> tuple[list[Conversation], list[Conversation]]:
  """(train, held out): round(fraction * n) whole conversations of one file held out, chosen
  by a seeded permutation (at least one when fraction > 0, at least one left to train on)."""
  n = len(conversations)
  if fraction <= 0:
    return list(conversations), []
  k = min(max(1, round(fraction * n)), n - 1)
  if k < 1:
    raise ChatDataError(f"{conversations[0].path} has one conversation: nothing to hold out "
                        "with data.eval_fraction > 0")
  held = set(np.random.default_rng([seed, file_index]).permutation(n)[:k].tolist())
  return ([c for i, c in enumerate(conversations) if i not in held],
          [c for i, c in enumerate(conversations) if i in held])


def user_texts(paths: Sequence[str]) -> set[str]:
  """Every user turn's text in these JSONL files (read as `read_jsonl` reads them)."""
  return {message_text(m) for path in paths for c in read_jsonl(path) for m in c.messages
          if m["role"] == "user"}


def seen_prompt_split(records: Sequence[dict], seen_texts: set[str]) -> dict:
  """Accuracy on held-out prompts seen and unseen in training: a record (the chat task's
  `score` record: "prompt" the last user text, "correct") is seen when exactly the same user
  text is in `seen_texts`; records gain "seen_prompt". A split with no record has None."""
  seen = []
  for record in records:
    record["seen_prompt"] = record["prompt"] in seen_texts
    seen.append(record["seen_prompt"])

  def share(keep):
    picked = [r["correct"] for r, k in zip(records, keep) if k]
    return float(np.mean(picked)) if picked else None

  return {"seen_prompt_accuracy": share(seen),
          "unseen_prompt_accuracy": share([not s for s in seen]),
          "num_seen_prompt": int(sum(seen)), "num_unseen_prompt": len(seen) - int(sum(seen))}


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return lines[0] if lines else type(e).__name__
