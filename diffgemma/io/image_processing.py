"""Gemma 4's image processor in numpy and Pillow, equal to transformers' (no torch at run time).

transformers' `Gemma4ImageProcessorPil` (the processor it builds without torchvision) and
`Gemma4Processor`'s prompt placeholders, step by step:
  load      a file opened with Pillow, turned upright by its EXIF orientation, converted to RGB
            (`load_image`; an image given in memory has its transparency laid on white);
  resize    aspect preserved, to the largest size whose sides are multiples of
            pooling_kernel_size * patch_size and that holds at most max_patches patches, where
            max_patches = max_soft_tokens * pooling_kernel_size**2 (`resized_size`); Pillow's
            bicubic filter; an image already that size is left as it is;
  rescale   uint8 -> float64 * (1 / 255) -> float32, so pixels lie in [0, 1] (Gemma 4 was
            trained on those; no mean/std normalization);
  patchify  row-major patches of patch_size x patch_size pixels, each flattened (row, column,
            channel), 3 * patch_size**2 values;
  positions each patch's (x, y) = (column, row) in the patch grid;
  pad       to max_patches patches: zero pixels, position (-1, -1);
  soft tokens  patches // pooling_kernel_size**2: the vision tower pools each k x k block of
            patches into one token (`num_soft_tokens`);
  placeholders  the chat template writes the image token where an image part is; the processor
            replaces the i-th image token of the rendered text by
              boi_token + image_token * num_soft_tokens(image i) + eoi_token
            (`expand_image_tokens`), the boi/eoi tokens marking where the image begins and ends.

Released checkpoints use patch_size 16, pooling_kernel_size 3 and max_soft_tokens 280
(`ImageSettings()`); transformers accepts max_soft_tokens in `SUPPORTED_SOFT_TOKENS` only, this
module any positive budget (a tiny vision tower trained from scratch may use a small one).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence

import numpy as np
import PIL.Image
import PIL.ImageOps

from diffgemma import errors

SUPPORTED_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # transformers' processor takes only these
PROCESSOR_CONFIG = "processor_config.json"  # transformers >= 5: {"image_processor": {...}, ...}
PREPROCESSOR_CONFIG = "preprocessor_config.json"  # earlier exports: the image processor's keys
PADDING_POSITION = -1  # the (x, y) of a padding patch


class ImageError(errors.InputError):
  """An image that cannot be read or processed; the message is one line and names the file."""


@dataclasses.dataclass(frozen=True)
class ImageSettings:
  """The image processor's three sizes (transformers' names and defaults)."""

  patch_size: int = 16  # pixels per patch side
  max_soft_tokens: int = 280  # soft tokens per image at most (the patch budget / k**2)
  pooling_kernel_size: int = 3  # k: the vision tower pools k x k patches into one soft token

  def __post_init__(self):
    for name in ("patch_size", "max_soft_tokens", "pooling_kernel_size"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"image {name} must be a positive integer, got {value!r}")

  @property
  def max_patches(self) -> int:
    """Patches per image after padding: max_soft_tokens * pooling_kernel_size**2."""
    return self.max_soft_tokens * self.pooling_kernel_size**2

  @property
  def patch_dim(self) -> int:
    """Values per patch: 3 channels x patch_size**2 pixels."""
    return 3 * self.patch_size**2


@dataclasses.dataclass(frozen=True)
class ImageTokens:
  """A tokenizer's image token strings: begin of image, the soft-token placeholder, end."""

  boi: str
  image: str
  eoi: str

  def placeholder(self, num_soft_tokens: int) -> str:
    """What the processor writes for one image of `num_soft_tokens` soft tokens."""
    return f"{self.boi}{self.image * num_soft_tokens}{self.eoi}"


GEMMA4_IMAGE_TOKENS = ImageTokens("<|image>", "<|image|>", "<image|>")


@dataclasses.dataclass(frozen=True)
class ProcessedImages:
  """Images as the vision tower takes them (transformers' processor output):

    pixel_values     float32 [N, max_patches, 3 * patch_size**2], values in [0, 1], padding 0;
    position_ids     int32 [N, max_patches, 2], each patch's (x, y), padding (-1, -1);
    num_soft_tokens  N ints: each image's soft tokens (its placeholder's image tokens).
  """

  pixel_values: np.ndarray
  position_ids: np.ndarray
  num_soft_tokens: tuple[int, ...]

  def __len__(self) -> int:
    return len(self.num_soft_tokens)


# ----------------------------------------------------------------------------- sizes


def resized_size(height: int, width: int, settings: ImageSettings) -> tuple[int, int]:
  """(height, width) an image of this size is resized to (transformers'
  `get_aspect_ratio_preserving_size`): the largest aspect-preserving size with sides that are
  multiples of pooling_kernel_size * patch_size, within max_patches patches; a side that
  rounds to 0 becomes one multiple, the other side then the aspect ratio's whole multiples
  (capped). ValueError (one line) for an image too thin for any such size."""
  patch, k = settings.patch_size, settings.pooling_kernel_size
  target_px = settings.max_patches * patch**2
  factor = math.sqrt(target_px / (height * width))
  side = k * patch
  target_height = int(math.floor(factor * height / side)) * side
  target_width = int(math.floor(factor * width / side)) * side
  if target_height == 0 and target_width == 0:
    raise ValueError(f"a {height}x{width} image resizes to 0 x 0 pixels")
  max_side = (settings.max_patches // k**2) * side
  if target_height == 0:
    target_height = side
    target_width = min(int(math.floor(width / height)) * side, max_side)
  elif target_width == 0:
    target_width = side
    target_height = min(int(math.floor(height / width)) * side, max_side)
  if target_height * target_width > target_px:
    raise ValueError(f"a {height}x{width} image (height x width) is too elongated: resized to "
                     f"{target_height}x{target_width} it exceeds {settings.max_patches} patches")
  return target_height, target_width


def num_soft_tokens(height: int, width: int, settings: ImageSettings) -> int:
  """Soft tokens of an image of this size: its patches after the resize // k**2."""
  h, w = resized_size(height, width, settings)
  return (h // settings.patch_size) * (w // settings.patch_size) // settings.pooling_kernel_size**2


# ----------------------------------------------------------------------------- reading


def load_image(path: str) -> PIL.Image.Image:
  """An image file as transformers' `load_image` reads it: upright (EXIF orientation), RGB
  (transparency dropped), decoded in full here so a damaged file fails now.

  Raises:
    ImageError: the file is missing or is not an image Pillow can decode (one line).
  """
  if not os.path.isfile(path):
    raise ImageError(f"image {path} not found")
  try:
    with PIL.Image.open(path) as opened:
      image = PIL.ImageOps.exif_transpose(opened)
      image = image.convert("RGB")
      image.load()
  except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as e:
    raise ImageError(f"cannot read image {path}: {_first_line(e)}") from None
  return image


def image_size(path: str) -> tuple[int, int]:
  """(height, width) of an image file as `load_image` would return it, decoding it in full
  (a truncated file fails here, not in the middle of a run). ImageError (one line)."""
  image = load_image(path)
  return image.height, image.width


def rgb_array(image: PIL.Image.Image | np.ndarray) -> np.ndarray:
  """uint8 [H, W, 3] of an image given in memory, as transformers' `convert_to_rgb` makes it:
  a Pillow image with transparency is laid on white; an array must already be uint8 [H, W, 3]."""
  if isinstance(image, PIL.Image.Image):
    if "A" in image.getbands() or image.info.get("transparency") is not None:
      rgba = image.convert("RGBA")
      white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
      image = PIL.Image.alpha_composite(white, rgba)
    return np.asarray(image.convert("RGB"))
  array = np.asarray(image)
  if array.dtype != np.uint8 or array.ndim != 3 or array.shape[-1] != 3:
    raise ValueError(f"an image array must be uint8 [height, width, 3], got {array.dtype} "
                     f"{list(array.shape)}")
  return array


# ----------------------------------------------------------------------------- processing


def process_image(image: PIL.Image.Image | np.ndarray, settings: ImageSettings
                  ) -> tuple[np.ndarray, np.ndarray, int]:
  """(pixel_values [max_patches, patch_dim] float32, position_ids [max_patches, 2] int32,
  num_soft_tokens) of one image (module docstring). ValueError (one line) for an image that
  cannot be resized within the budget."""
  pixels = rgb_array(image)
  height, width = pixels.shape[:2]
  target = resized_size(height, width, settings)
  if target != (height, width):
    # transformers resizes with Pillow too: the uint8 image, bicubic, (width, height) order.
    resized = PIL.Image.fromarray(pixels).resize((target[1], target[0]),
                                                 resample=PIL.Image.BICUBIC)
    pixels = np.asarray(resized)
  # float64 first, then float32: transformers' `rescale`, to the last bit.
  scaled = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
  p = settings.patch_size
  rows, cols = target[0] // p, target[1] // p
  patches = scaled.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, -1)
  grid_y, grid_x = np.divmod(np.arange(rows * cols), cols)
  positions = np.stack([grid_x, grid_y], axis=-1).astype(np.int32)
  pixel_values = np.zeros((settings.max_patches, settings.patch_dim), np.float32)
  position_ids = np.full((settings.max_patches, 2), PADDING_POSITION, np.int32)
  pixel_values[:len(patches)] = patches
  position_ids[:len(patches)] = positions
  return pixel_values, position_ids, len(patches) // settings.pooling_kernel_size**2


def process_images(images: Sequence[PIL.Image.Image | np.ndarray | str], settings: ImageSettings,
                   num_slots: int | None = None) -> ProcessedImages:
  """Images (Pillow images, uint8 arrays or file paths, read with `load_image`) stacked as
  `ProcessedImages`; `num_slots` >= len(images) pads with absent images (every pixel 0, every
  position (-1, -1), no soft tokens listed) to a fixed count. ImageError / ValueError (one
  line, naming the file for a path)."""
  n = len(images) if num_slots is None else num_slots
  if n < len(images):
    raise ValueError(f"{len(images)} images do not fit {n} image slots")
  pixel_values = np.zeros((n, settings.max_patches, settings.patch_dim), np.float32)
  position_ids = np.full((n, settings.max_patches, 2), PADDING_POSITION, np.int32)
  counts = []
  for i, image in enumerate(images):
    where = image if isinstance(image, str) else f"image {i + 1}"
    if isinstance(image, str):
      image = load_image(image)
    try:
      pixel_values[i], position_ids[i], count = process_image(image, settings)
    except ValueError as e:
      raise ImageError(f"{where}: {e}") from None
    counts.append(count)
  return ProcessedImages(pixel_values, position_ids, tuple(counts))


# ----------------------------------------------------------------------------- placeholders


def expand_image_tokens(text: str, soft_tokens: Sequence[int], tokens: ImageTokens) -> str:
  """`text` (a rendered chat template) with its i-th image token replaced by image i's
  placeholder, as transformers' processor expands it. ValueError (one line) when the text holds
  a different number of image tokens than there are images."""
  parts = text.split(tokens.image)
  if len(parts) - 1 != len(soft_tokens):
    raise ValueError(f"the rendered prompt holds {len(parts) - 1} image tokens {tokens.image!r} "
                     f"for {len(soft_tokens)} images")
  out = [parts[0]]
  for count, part in zip(soft_tokens, parts[1:]):
    out += [tokens.placeholder(count), part]
  return "".join(out)


# ----------------------------------------------------------------------------- checkpoints


def read_image_settings(directory: str) -> ImageSettings | None:
  """The image processor settings a transformers checkpoint directory ships
  (processor_config.json's "image_processor", else preprocessor_config.json); None without
  either file. ImageError (one line) for a malformed one."""
  for name, nested in ((PROCESSOR_CONFIG, True), (PREPROCESSOR_CONFIG, False)):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      continue
    try:
      with open(path, encoding="utf-8") as f:
        config = json.load(f)
    except (OSError, ValueError) as e:
      raise ImageError(f"cannot read {path}: {_first_line(e)}") from None
    section = config.get("image_processor") if nested and isinstance(config, dict) else config
    if not isinstance(section, dict):
      continue  # a processor without images (processor_config.json of a text model)
    defaults = ImageSettings()
    try:
      return ImageSettings(**{f.name: section.get(f.name, getattr(defaults, f.name))
                              for f in dataclasses.fields(ImageSettings)})
    except ValueError as e:
      raise ImageError(f"{path}: {e}") from None
  return None


def _first_line(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return lines[0] if lines else type(e).__name__
