"""Packed SFT rows (diffgemma/tasks/packing.py): the chat pipeline's rows hold exactly the
examples of the unpacked order, each its prompt then its canvases with positions from 0; the
rows of a step are a pure function of the step; a bad configuration or an example longer than a
row is one line."""

import collections

import numpy as np
import pytest

from diffgemma.tasks import make_task, packing
from diffgemma.tasks.chat_data import ChatDataError
from tests.helpers import chat, make_config, write_jsonl

ROW, PER_ROW = 64, 3


def packed_task(tmp_path, n=40, **data):
  # Replies of 1 to 3 canvases of 4 and prompts of various lengths.
  records = [chat("q" * (1 + i % 7), "a" * (1 + (5 * i) % 11)) for i in range(n)]
  path = write_jsonl(tmp_path / "d.jsonl", records)
  config = make_config(path, prompt_len=24, num_canvases=3, num_threads=0,
                       **{"max_row_tokens": ROW, "max_row_examples": PER_ROW, **data})
  return make_task(config)


def slots_key(example_slots):
  return (tuple(example_slots["tokens"].tolist()), tuple(example_slots["loss_mask"].tolist()))


def test_packed_rows_hold_the_examples_of_the_order(tmp_path):
  task = packed_task(tmp_path)
  rows = task.packing
  assert (rows.row_tokens, rows.row_examples, rows.canvas_length) == (ROW, PER_ROW, 4)
  batches = list(task.train_batches(4, 5))
  seen = []
  for batch in batches:
    assert batch["tokens"].shape == (4, ROW) and batch["canvas_start"].shape == (4, PER_ROW)
    for b in range(4):
      seg, pos = batch["segment_ids"][b], batch["positions"][b]
      np.testing.assert_array_equal(batch["valid"][b], seg > 0)
      count = int(seg.max())
      assert 1 <= count <= PER_ROW and (batch["num_canvases"][b, count:] == 0).all()
      # Examples lie back to back from slot 0, then padding.
      assert (np.diff(seg[seg > 0]) >= 0).all() and not seg[int((seg > 0).sum()):].any()
      for j in range(count):
        slots = np.flatnonzero(seg == j + 1)
        np.testing.assert_array_equal(pos[slots], np.arange(len(slots)))
        mask = batch["loss_mask"][b, slots]
        start, n = batch["canvas_start"][b, j], batch["num_canvases"][b, j]
        assert start == slots[0] + np.argmax(mask) and n * 4 == mask.sum() and mask[-1]
        seen.append(slots_key({"tokens": batch["tokens"][b, slots], "loss_mask": mask}))
  # A flush of the packer is one step's rows: the examples of the first 5 steps are the first
  # len(seen) examples of the order, each once.
  expected = [slots_key(packing.example_slots(task.layout_example(e), 4))
              for e in task.train_examples(0, len(seen))]
  assert collections.Counter(seen) == collections.Counter(expected)
  assert len(seen) > 4 * 5 * 1.5  # rows hold more than one example on average


def test_packed_batches_resume_exactly_and_split_over_processes(tmp_path):
  task = packed_task(tmp_path)
  full = list(task.train_batches(4, 6))
  resumed = list(task.train_batches(4, 6, 2))
  halves = [list(task.train_batches(4, 6, 0, process_index=i, process_count=2)) for i in (0, 1)]
  assert len(full) == 6 and len(resumed) == 4
  for step, batch in enumerate(full):
    for key, value in batch.items():
      if step >= 2:
        np.testing.assert_array_equal(resumed[step - 2][key], value)
      np.testing.assert_array_equal(
          np.concatenate([halves[0][step][key], halves[1][step][key]]), value)


def test_an_example_longer_than_a_row_names_its_line(tmp_path):
  records = [chat("q", "short"), chat("q", "x" * 40)]
  path = write_jsonl(tmp_path / "d.jsonl", records)
  config = make_config(path, prompt_len=24, num_canvases=12, max_row_tokens=40,
                       max_row_examples=2)
  with pytest.raises(ChatDataError) as e:
    make_task(config)
  message = str(e.value)
  assert "\n" not in message and f"{path}:2" in message
  assert "data.max_row_tokens=40" in message and "at least 72" in message


def test_packing_needs_the_examples_per_row(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [chat("q", "a")])
  with pytest.raises(ValueError, match="set data.max_row_examples"):
    make_task(make_config(path, prompt_len=24, num_canvases=1, max_row_tokens=64))


def test_example_slots_drop_the_padding():
  layout = {"tokens": np.array([0, 0, 7, 8, 9, 1, 1, 1, 0, 0, 0, 0]),
            "valid": np.array([0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0], bool),
            "loss_mask": np.array([0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0], bool)}
  slots = packing.example_slots(layout, 2)
  np.testing.assert_array_equal(slots["tokens"], [7, 8, 9, 1, 1, 1])
  np.testing.assert_array_equal(slots["loss_mask"], [0, 0, 1, 1, 1, 1])
  with pytest.raises(ValueError, match="whole supervised canvases"):
    packing.example_slots(layout, 3)
