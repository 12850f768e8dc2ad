"""TensorBoard summaries (scalars, images, text) written with the tensorboard package alone (no
TensorFlow): its event-file writer, summary protos and plugin metadata; images are PNG-encoded
with Pillow."""

from __future__ import annotations

import io
import time

import numpy as np
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.plugins.image import metadata as image_metadata
from tensorboard.plugins.text import summary_v2 as text_summary
from tensorboard.summary.writer.event_file_writer import EventFileWriter
from tensorboard.util import tensor_util


def png_bytes(image_HxWxC) -> bytes:
  """PNG encoding of a uint8 image [H, W] (grey), [H, W, 3] (RGB) or [H, W, 4] (RGBA)."""
  from PIL import Image

  image = np.asarray(image_HxWxC)
  if image.dtype != np.uint8 or image.ndim not in (2, 3) or (
      image.ndim == 3 and image.shape[-1] not in (1, 3, 4)):
    raise ValueError(f"expected a uint8 image [H, W] or [H, W, 1|3|4], got {image.dtype} "
                     f"{image.shape}")
  buffer = io.BytesIO()
  Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image).save(
      buffer, format="PNG")
  return buffer.getvalue()


def image_summary(tag: str, images_NxHxWxC, description: str | None = None):
  """A Summary with uint8 images [N, H, W, C] (or one image, [H, W, C] or [H, W]) in the image
  plugin's format: a string tensor [width, height, png, png, ...]."""
  images = np.asarray(images_NxHxWxC)
  if images.ndim < 4:  # one image, [H, W] or [H, W, C]
    images = images[None]
  height, width = images.shape[1:3]
  content = [str(width).encode(), str(height).encode()] + [png_bytes(im) for im in images]
  tensor = tensor_util.make_tensor_proto(np.array(content, dtype=np.object_))
  meta = image_metadata.create_summary_metadata(display_name=tag, description=description)
  return summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, metadata=meta,
                                                              tensor=tensor)])


class SummaryWriter:
  """Appends summary events to `logdir`; a resumed run appends a new event file beside the old.

  write(step, {tag: float})         scalars
  write_image(step, tag, image)     uint8 [H, W, C] (or [N, H, W, C]: N images under one tag)
  write_text(step, tag, markdown)   text (TensorBoard renders it as markdown)
  """

  def __init__(self, logdir: str, enabled: bool = True):
    """`enabled=False` writes nothing (e.g. every process but the first of a multi-process
    run)."""
    self._writer = EventFileWriter(logdir) if enabled else None

  def _add(self, step: int, summary) -> None:
    if self._writer is None:
      return
    self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=int(step),
                                           summary=summary))

  def write(self, step: int, scalars: dict[str, float]) -> None:
    values = [summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
    self._add(step, summary_pb2.Summary(value=values))

  def write_image(self, step: int, tag: str, image, description: str | None = None) -> None:
    self._add(step, image_summary(tag, image, description))

  def write_text(self, step: int, tag: str, text: str) -> None:
    self._add(step, text_summary.text_pb(tag, text))

  def flush(self) -> None:
    if self._writer is not None:
      self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()

