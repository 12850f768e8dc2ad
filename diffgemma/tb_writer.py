"""TensorBoard scalar summaries written with the tensorboard package alone (no TensorFlow)."""

from __future__ import annotations

import time

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter


class ScalarWriter:
  """Appends scalar events to `logdir`; a resumed run appends a new event file beside the old."""

  def __init__(self, logdir: str):
    self._writer = EventFileWriter(logdir)

  def write(self, step: int, scalars: dict[str, float]) -> None:
    values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
    self._writer.add_event(event_pb2.Event(
        wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=values)))

  def flush(self) -> None:
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()
