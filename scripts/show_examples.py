"""Print what the model sees of a chat data file: each training example's prompt and target.

  python scripts/show_examples.py --config=sft_chat --data=/tmp/count.jsonl --num=3
  python scripts/show_examples.py --config=sft_pubmedqa_lora --data=train.jsonl \
      --init_from=/ckpt/dg26b --json

The examples are laid out as training lays them out (the config's task, tokenizer, prompt length,
canvases and overflow policy; --init_from: that checkpoint's canvas length, special ids, vision
tower and, if data.tokenizer is empty, its tokenizer). Text: the rendered prompt and target with
special tokens shown (the EOS fill summarised; each image's placeholder as
<|image>[<|image|> x N: FILE]<image|>, N its soft tokens). --json: one object per example and
line, with prompt_ids (the encoder's ids, BOS included, no padding, placeholders expanded),
target_ids (the supervised ids of all valid canvases in order, EOS fill included), num_canvases
and images (the prompt's image files in placeholder order); the overflow summary goes to
stderr.
"""

import dataclasses
import json
import os
import re
import sys

from absl import flags
from ml_collections import config_flags

from diffgemma import cli

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/NAME.py, or just NAME.")
_DATA = flags.DEFINE_string("data", None, "JSONL data file to show.")
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "Checkpoint directory the run would start from (its canvas length, "
    "special ids and default tokenizer).")
_NUM = flags.DEFINE_integer("num", None, "Show only the first N examples.")
_JSON = flags.DEFINE_bool("json", False, "One JSON object per example (ids), one per line.")


def shown_placeholders(text: str, images, tokens) -> str:
  """`text` with each image's run of image tokens written once, with its count and file."""
  if tokens is None or not images:
    return text
  files = iter(images)
  run = re.compile(f"(?:{re.escape(tokens.image)})+")
  return run.sub(lambda m: f"[{tokens.image} x {len(m[0]) // len(tokens.image)}: "
                           f"{next(files, '?')}]", text)


def main(argv):
  del argv
  config = _CONFIG.value
  if config is None or not _DATA.value:
    raise cli.UserError("--config and --data are required")
  if _NUM.value is not None and _NUM.value < 1:
    raise cli.UserError(f"--num must be positive, got {_NUM.value}")
  from diffgemma import tasks

  with config.unlocked():
    # Only --data is read: no training or held-out files.
    config.data.train, config.data.eval, config.data.eval_fraction = "", "", 0.0
    if _INIT_FROM.value:
      if not os.path.isdir(_INIT_FROM.value):
        raise cli.UserError(f"checkpoint directory {_INIT_FROM.value!r} not found")
      from diffgemma.io import model_dirs

      arch = model_dirs.read_model_config(_INIT_FROM.value)
      for field in ("canvas_length", "vocab_size", "pad_token_id", "eos_token_id",
                    "bos_token_id"):
        config.model[field] = getattr(arch, field)
      vision = getattr(arch, "vision", None)  # a checkpoint with a vision tower takes images
      if vision is not None:
        config.model["vision"] = (dataclasses.asdict(vision) if dataclasses.is_dataclass(vision)
                                  else vision)
      config.init_from = os.path.abspath(_INIT_FROM.value)
  try:
    task = tasks.make_task(config, training=False)  # --data is read below, as training reads it
  except ValueError as e:
    raise cli.UserError(str(e)) from None
  if not hasattr(task, "describe_file"):
    raise cli.UserError(f"show_examples shows chat data; this config's task is {task.name!r}")
  try:
    examples = task.describe_file(_DATA.value, _NUM.value)
  except ValueError as e:
    raise cli.UserError(str(e)) from None
  counts = task.overflow_counts[_DATA.value]
  if _JSON.value:
    for e in examples:
      print(json.dumps({"prompt_ids": e["prompt_ids"], "target_ids": e["target_ids"],
                        "num_canvases": e["num_canvases"], "images": e["images"]}))
    print(f"{_DATA.value}: {counts.describe()}", file=sys.stderr)
    return
  tok, layout = task.tokenizer, task.layout
  for n, e in enumerate(examples, start=1):
    target = e["target_ids"]
    fill = 0
    while fill < len(target) and target[len(target) - 1 - fill] == tok.eos_id:
      fill += 1
    print(f"=== example {n} ({e['source']}): {len(e['prompt_ids'])} of {layout.prompt_len} "
          f"prompt slots, {e['num_canvases']} of {layout.num_canvases} canvases of "
          f"{layout.canvas_length} ===")
    print("--- prompt ---")
    print(shown_placeholders(e["prompt_text"], e["images"], tok.image_tokens))
    print("--- target ---")
    print(tok.decode(target[:len(target) - fill], skip_special_tokens=False))
    if fill:
      print(f"[then {fill} x {tok.decode([tok.eos_id], skip_special_tokens=False)} to the end "
            f"of canvas {e['num_canvases']}]")
  print(f"{_DATA.value}: {counts.describe()}" +
        (f"; showing the first {len(examples)}" if _NUM.value else ""))


if __name__ == "__main__":
  cli.run(main)
