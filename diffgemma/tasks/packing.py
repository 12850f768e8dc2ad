"""Packed training rows: several whole examples back to back in one row (`base.PackedLayout`).

A task's example in its fixed `Layout` (P left-padded prompt slots, K canvases of C) holds
padding: the prompt's left padding and the canvases after the reply. Packing drops it: an
example becomes its valid slots, the prompt then its canvases (`example_slots`), and rows of R
slots take examples first-fit, up to E per row, by grain's packer
(`grain.experimental.FirstFitPackIterDataset`: it writes the segment ids and the positions that
restart at 0 in each example, and bounds the examples per bin). `packed_batches` adds what the
objective needs per example (`row_metadata`): where its canvases start and how many there are.

The model keeps examples apart by segment ids (`attention_mask.attention_mask`), so every
example of a row is computed as it is alone; the SFT objective draws each example's canvas,
noise level and corruption and normalises over the batch's examples as it does unpacked
(diffgemma/training/losses.py).

Order and resumption: the examples come in the task's seeded order (record r of `order`), and
the packer's decisions depend on nothing else, so the rows of step s are a pure function of s.
The packer is a stream (a row's content depends on the examples before it), so a run resumed
at step s replays the packing of the steps before s: grain lays out and packs about 20k
examples a second, a few seconds for a CPU run's steps. Every process packs the global batch
and keeps its share of the rows (the packing is the same on every process).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import grain
import numpy as np

from diffgemma.tasks.base import PackedLayout

PACKED_FEATURES = ("tokens", "loss_mask")


def example_slots(example: dict, canvas_length: int) -> dict:
  """One `Layout` example (tokens / valid / loss_mask [P + K*C]) without its padding:
  {"tokens", "loss_mask"} [p + n*C], its p valid prompt slots then its n supervised canvases.
  ValueError if the valid slots are not a prompt followed by whole supervised canvases."""
  valid = np.asarray(example["valid"], bool)
  loss_mask = np.asarray(example["loss_mask"], bool)[valid]
  prompt_len = int(np.argmax(loss_mask)) if loss_mask.any() else len(loss_mask)
  supervised = len(loss_mask) - prompt_len
  if not loss_mask[prompt_len:].all() or loss_mask[:prompt_len].any() or supervised % canvas_length:
    raise ValueError("a packed example must be its prompt then whole supervised canvases of "
                     f"{canvas_length}; got loss_mask {loss_mask.astype(int).tolist()}")
  return {"tokens": np.asarray(example["tokens"], np.int32)[valid], "loss_mask": loss_mask}


def row_metadata(segment_ids_R: np.ndarray, loss_mask_R: np.ndarray, row_examples: int,
                 canvas_length: int) -> tuple[np.ndarray, np.ndarray]:
  """(canvas_start_E, num_canvases_E) int32 of one packed row (`base.PackedLayout`)."""
  canvas_start = np.zeros(row_examples, np.int32)
  num_canvases = np.zeros(row_examples, np.int32)
  for j in range(row_examples):
    canvases = np.flatnonzero((segment_ids_R == j + 1) & loss_mask_R)
    if len(canvases):
      canvas_start[j] = canvases[0]
      num_canvases[j] = len(canvases) // canvas_length
  return canvas_start, num_canvases


def pack_rows(examples: Iterator[dict], packing: PackedLayout, bins: int, seed: int,
              pad_id: int = 0) -> Iterator[dict]:
  """Packed rows (`base.PackedLayout`'s arrays, one row each) of a stream of `example_slots`
  dicts, first-fit into `bins` open rows of `packing.row_tokens` slots, at most
  `packing.row_examples` examples each (grain's packer; its rows are shuffled by `seed`)."""
  r = packing.row_tokens
  rows = grain.experimental.FirstFitPackIterDataset(
      examples, length_struct={k: r for k in PACKED_FEATURES}, num_packing_bins=bins,
      max_sequences_per_bin=packing.row_examples, shuffle_bins=True, seed=seed,
      padding_struct={"tokens": pad_id, "loss_mask": False})

  def finish(row):
    segment_ids = row["tokens_segment_ids"]
    canvas_start, num_canvases = row_metadata(segment_ids, row["loss_mask"],
                                              packing.row_examples, packing.canvas_length)
    return {"tokens": row["tokens"], "valid": segment_ids > 0, "loss_mask": row["loss_mask"],
            "segment_ids": segment_ids, "positions": row["tokens_positions"],
            "canvas_start": canvas_start, "num_canvases": num_canvases}

  return rows.map(finish)


def packed_batches(order: grain.MapDataset, example_fn: Callable[[object], dict],
                   packing: PackedLayout, batch_size: int, num_steps: int, start_step: int,
                   process_index: int, process_count: int, num_threads: int, prefetch: int,
                   seed: int, pad_id: int = 0) -> Iterator[dict]:
  """Iterator of packed batches for steps start_step .. num_steps-1: the examples
  `example_fn(order[r])` (in the task's `Layout`) for r = 0, 1, ... packed into rows
  (`pack_rows`, `batch_size` open rows), `batch_size` rows a step; process i gets rows
  [i*B/n, (i+1)*B/n) of each global batch. Steps before start_step are packed and skipped."""
  if batch_size % process_count:
    raise ValueError(f"batch_size={batch_size} is not divisible by {process_count} processes")
  local = batch_size // process_count
  examples = order.map(lambda pair: example_slots(example_fn(pair), packing.canvas_length))
  read = grain.ReadOptions(num_threads=num_threads, prefetch_buffer_size=prefetch)
  rows = pack_rows(examples.to_iter_dataset(read), packing, batch_size, seed, pad_id)
  batches = rows.batch(batch_size, drop_remainder=True)
  mine = slice(process_index * local, (process_index + 1) * local)
  steps = itertools.islice(iter(batches), start_step, num_steps)
  return ({k: v[mine] for k, v in batch.items()} for batch in steps)



def fill(lengths, packing: PackedLayout, bins: int, seed: int = 0) -> tuple[float, float]:
  """(mean examples per row, share of the row slots they fill) when examples of these packed
  lengths are packed as `packed_batches` packs them (full rows only; 0s without one)."""
  def dummy(n):
    return {"tokens": np.zeros(n, np.int32), "loss_mask": np.zeros(n, bool)}

  examples = grain.MapDataset.source([int(n) for n in lengths]).map(dummy).to_iter_dataset()
  rows = list(pack_rows(examples, packing, bins, seed))
  # Every flush of the packer but the last emits `bins` rows; the last holds the stream's tail
  # (rows a longer stream would have filled further): leave it out.
  rows = rows[:len(rows) - ((len(rows) - 1) % bins + 1)] if rows else rows
  if not rows:
    return 0.0, 0.0
  per_row = [int(r["segment_ids"].max()) for r in rows]
  slots = [int(r["valid"].sum()) for r in rows]
  return float(np.mean(per_row)), float(np.sum(slots)) / (len(rows) * packing.row_tokens)
