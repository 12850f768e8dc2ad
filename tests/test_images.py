"""Image prompts: Gemma 4's image processor against transformers' (pixels and positions equal to
the last bit, soft-token counts and placeholders equal), image chat data through the chat task
(tokens with placeholders beside each image's pixels and positions), and the synthetic image
task's generator (scripts/make_image_task.py).

transformers' side is its PIL processor (`Gemma4ImageProcessorPil`, what it builds without
torchvision) and `Gemma4Processor.apply_chat_template(..., tokenize=True)` on a tiny tokenizer
with Gemma 4's image tokens (tests/helpers.py).
"""

import json
import os

import numpy as np
import pytest
from PIL import Image

from diffgemma.io import image_processing, tokenizer as tokenizer_lib
from diffgemma.tasks import chat_data, make_task
from tests.helpers import (add_vision_tower, load_script, run, tiny_chat_config,
                           write_image_tokenizer, write_jsonl, write_png)

# (height, width): landscape, portrait, square, thin strips that hit the resize's edge cases (a
# side rounding to 0), one already a multiple of the side, larger ones that shrink.
SIZES = [(64, 96), (96, 64), (77, 77), (300, 20), (17, 500), (48, 192), (480, 480), (700, 1000)]


def transformers_processor(tokenizer_dir, max_soft_tokens):
  """transformers' Gemma 4 processor on a tokenizer directory, without a video processor
  (which needs torchvision; image prompts never reach it)."""
  import transformers
  from transformers.models.gemma4 import image_processing_pil_gemma4, processing_gemma4

  class ImageProcessor(processing_gemma4.Gemma4Processor):
    def check_argument_for_proper_class(self, argument_name, argument):
      if argument is None:  # the video processor, left out
        return None
      return super().check_argument_for_proper_class(argument_name, argument)

  tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
  return ImageProcessor(
      feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
      image_processor=image_processing_pil_gemma4.Gemma4ImageProcessorPil(
          max_soft_tokens=max_soft_tokens),
      tokenizer=tok, video_processor=None, chat_template=tok.chat_template)


@pytest.mark.parametrize("max_soft_tokens", [70, 280])
def test_processor_equals_transformers(tmp_path, max_soft_tokens):
  """pixel_values and image_position_ids equal transformers' exactly (tolerance 0: the same
  Pillow resize, the same float64 -> float32 rescale), soft-token counts equal, for files in
  RGB, grayscale and RGBA and for an image given in memory with transparency."""
  from transformers.image_utils import load_image
  from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

  theirs = Gemma4ImageProcessorPil(max_soft_tokens=max_soft_tokens)
  settings = image_processing.ImageSettings(max_soft_tokens=max_soft_tokens)
  modes = ["RGB"] * len(SIZES) + ["L", "RGBA"]
  paths = [write_png(tmp_path / f"{i}.png", *(SIZES + SIZES[:2])[i], seed=i, mode=mode)
           for i, mode in enumerate(modes)]
  ours = image_processing.process_images(paths, settings)
  expected = theirs(images=[load_image(p) for p in paths])
  assert ours.pixel_values.dtype == np.float32 and ours.position_ids.dtype == np.int32
  np.testing.assert_array_equal(ours.pixel_values, expected["pixel_values"])
  np.testing.assert_array_equal(ours.position_ids, expected["image_position_ids"])
  assert list(ours.num_soft_tokens) == list(expected["num_soft_tokens_per_image"])
  for (height, width), count in zip(SIZES, ours.num_soft_tokens):
    assert image_processing.num_soft_tokens(height, width, settings) == count
  # In memory: transparency laid on white, as transformers' convert_to_rgb does.
  rgba = Image.open(paths[-1])
  pixels, positions, count = image_processing.process_image(rgba, settings)
  expected = theirs(images=[rgba])
  np.testing.assert_array_equal(pixels, expected["pixel_values"][0])
  np.testing.assert_array_equal(positions, expected["image_position_ids"][0])
  assert count == expected["num_soft_tokens_per_image"][0]


def image_record(user_parts, reply, history=()):
  return {"messages": [*history, {"role": "user", "content": user_parts},
                       {"role": "assistant", "content": reply}]}


def image_config(train="", tokenizer="bytes_image", max_images=2, soft_tokens=16, patch=8,
                 pooling=2, **data):
  """tiny_chat_config with a vision tower in the model section (the image processor's sizes
  from it) and image slots in the layout."""
  config = tiny_chat_config(train, tokenizer=tokenizer, max_images=max_images, **data)
  return add_vision_tower(config, soft_tokens, patch, pooling)


def test_chat_prompt_equals_transformers_processor(tmp_path):
  """A held-out image conversation (two images in one turn, a third in a later turn) gives the
  prompt ids, pixels and positions transformers' processor gives for the same messages."""
  tok_dir = write_image_tokenizer(str(tmp_path / "tok"))
  for name, (height, width) in {"a": (64, 96), "b": (120, 50), "c": (40, 40)}.items():
    write_png(tmp_path / "img" / f"{name}.png", height, width, seed=ord(name))
  first = [{"type": "image", "path": "img/a.png"}, {"type": "text", "text": " Compare "},
           {"type": "image", "path": "img/b.png"}]
  history = [{"role": "user", "content": first}, {"role": "assistant", "content": "the first"}]
  record = image_record([{"type": "text", "text": "And this?"},
                         {"type": "image", "path": "img/c.png"}], "a square", history)
  path = write_jsonl(tmp_path / "eval.jsonl", [record])
  config = image_config(tokenizer=tok_dir, max_images=3, soft_tokens=70, patch=16, pooling=3,
                        prompt_len=320)
  prompts = make_task(config, training=False).load_eval_file(path)

  processor = transformers_processor(tok_dir, 70)
  messages = json.loads(json.dumps(record["messages"][:-1]))
  for message in messages:
    for part in message["content"] if isinstance(message["content"], list) else ():
      if part["type"] == "image":
        part["path"] = str(tmp_path / part["path"])
  expected = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=True)
  ids = prompts.prompt_NxP[0][prompts.valid_NxP[0]]
  assert ids.tolist() == list(expected["input_ids"][0])
  np.testing.assert_array_equal(prompts.pixel_values_NxIxMxD[0], expected["pixel_values"])
  np.testing.assert_array_equal(prompts.image_positions_NxIxMx2[0],
                                expected["image_position_ids"])
  assert prompts.records[0]["images"] == [str(tmp_path / "img" / f"{n}.png") for n in "abc"]


def test_image_chat_batches(tmp_path):
  """Training batches of image chat data beside the three text formats: each row's image
  tokens are its images' placeholders in order, its pixels and positions those of its files,
  absent image slots all padding; text rows are unchanged by the images beside them."""
  write_png(tmp_path / "img" / "wide.png", 20, 60, seed=1)
  write_png(tmp_path / "img" / "tall.png", 64, 24, seed=2)
  records = [
      image_record([{"type": "image", "path": "img/wide.png"},
                    {"type": "text", "text": "What colour?"}], "red"),
      image_record([{"type": "image", "path": "img/wide.png"},
                    {"type": "image", "path": str(tmp_path / "img" / "tall.png")},
                    {"type": "text", "text": "Which?"}], "the second"),
      {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
      {"prompt": "hi", "completion": "yo"},
      {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}]
  path = write_jsonl(tmp_path / "mixed.jsonl", records)
  task = make_task(image_config(path, prompt_len=64))
  examples = task.describe_file(path)
  assert [len(e["images"]) for e in examples] == [1, 2, 0, 0, 0]
  text_ids = [e["prompt_ids"] for e in examples[2:]]
  assert text_ids[0] == text_ids[1] == text_ids[2] == tokenizer_lib.load_tokenizer(
      "bytes").chat_prompt("hi")
  boi, image_id, eoi = task.tokenizer.image_token_ids
  settings = task.image_settings
  for example in examples[:2]:
    processed = image_processing.process_images(example["images"], settings, num_slots=2)
    ids = example["prompt_ids"]
    expected_run = [t for n in processed.num_soft_tokens for t in [boi] + [image_id] * n + [eoi]]
    assert [t for t in ids if t in (boi, image_id, eoi)] == expected_run
  wide = image_processing.process_images([str(tmp_path / "img" / "wide.png")], settings)
  batch = next(task.train_batches(len(records), 1))
  assert batch["pixel_values"].shape == (5, 2, settings.max_patches, settings.patch_dim)
  assert batch["image_position_ids"].shape == (5, 2, settings.max_patches, 2)
  assert batch["pixel_values"].dtype == np.float32
  assert batch["image_position_ids"].dtype == np.int32
  for row in range(len(records)):
    tokens = batch["tokens"][row]
    count = int((tokens == image_id).sum())
    valid_patches = (batch["image_position_ids"][row, :, :, 0] >= 0).sum(axis=-1)
    assert count == valid_patches.sum() // settings.pooling_kernel_size**2
    if count == wide.num_soft_tokens[0]:  # the one-image row: its file, then an empty slot
      np.testing.assert_array_equal(batch["pixel_values"][row, 0], wide.pixel_values[0])
      assert (batch["image_position_ids"][row, 1] == -1).all()
      assert not batch["pixel_values"][row, 1].any()


def test_sample_prompt_with_images(tmp_path):
  """A typed prompt with image files (what sample.py --image will call): the images before the
  text in one user turn, their arrays beside the ids."""
  image = write_png(tmp_path / "x.png", 32, 32)
  task = make_task(image_config(prompt_len=64), training=False)
  prompts = task.prompt_from_text("What is it?", images=[image])
  settings = task.image_settings
  expected = image_processing.process_images([image], settings, num_slots=2)
  np.testing.assert_array_equal(prompts.pixel_values_NxIxMxD[0], expected.pixel_values)
  ids = prompts.prompt_NxP[0][prompts.valid_NxP[0]].tolist()
  messages = [{"role": "user", "content": [{"type": "image", "path": image},
                                           {"type": "text", "text": "What is it?"}]}]
  assert ids == task.tokenizer.render(messages, True,
                                     image_soft_tokens=expected.num_soft_tokens)
  assert prompts.take([0, 0]).pixel_values_NxIxMxD.shape[0] == 2


def test_checkpoint_image_settings(tmp_path):
  """A transformers checkpoint's processor_config.json (or the older preprocessor_config.json)
  gives the image processor's sizes; a text-only processor gives none."""
  new, old, text = (tmp_path / n for n in ("new", "old", "text"))
  for directory in (new, old, text):
    directory.mkdir()
  (new / "processor_config.json").write_text(json.dumps({"image_processor": {
      "image_processor_type": "Gemma4ImageProcessor", "patch_size": 16, "max_soft_tokens": 70,
      "pooling_kernel_size": 3}, "image_seq_length": 280}))
  (old / "preprocessor_config.json").write_text(json.dumps({"max_soft_tokens": 560}))
  (text / "processor_config.json").write_text(json.dumps({"processor_class": "X"}))
  assert image_processing.read_image_settings(str(new)) == image_processing.ImageSettings(
      max_soft_tokens=70)
  assert image_processing.read_image_settings(str(old)).max_soft_tokens == 560
  assert image_processing.read_image_settings(str(text)) is None


def test_make_image_task(tmp_path):
  """scripts/make_image_task.py: deterministic per seed, a fresh seed a fresh set; every line a
  user turn of one image and a question, the reply the drawing's exact answer; the chat task
  reads it as training data."""
  script = load_script("make_image_task")
  out = str(tmp_path / "train.jsonl")
  script.write_task(num=12, seed=3, out=out)
  again = str(tmp_path / "again" / "train.jsonl")
  script.write_task(num=12, seed=3, out=again)
  other = str(tmp_path / "other.jsonl")
  script.write_task(num=12, seed=4, out=other)
  lines = open(out, encoding="utf-8").read().splitlines()
  assert lines == open(again, encoding="utf-8").read().splitlines()
  assert lines != open(other, encoding="utf-8").read().splitlines()
  images = sorted(os.listdir(tmp_path / script.image_folder(out)))
  assert len(images) == 12
  for name in images:
    assert (open(tmp_path / script.image_folder(out) / name, "rb").read()
            == open(tmp_path / "again" / script.image_folder(again) / name, "rb").read())
  for line in lines:
    record = json.loads(line)
    user, reply = record["messages"]
    kinds = [p["type"] for p in user["content"]]
    assert kinds == ["image", "text"]
    question, answer = user["content"][1]["text"], reply["content"]
    shapes = record["shapes"]
    assert answer == script.answer(question, shapes)
    image = Image.open(tmp_path / user["content"][0]["path"])
    assert image.size == (script.CANVAS, script.CANVAS)
    for shape in shapes:  # each shape's colour is at its centre
      assert image.getpixel((shape["x"], shape["y"])) == script.COLOURS[shape["colour"]]
  conversations = chat_data.read_jsonl(out)
  assert all(len(c.images) == 1 for c in conversations)
  task = make_task(image_config(out, max_images=1, prompt_len=80))
  assert task.overflow_counts[out].examples == 12


def test_image_task_chance_levels(tmp_path):
  """Each line names its kind of question; a set's chance is each kind's most common answer's
  share (as written, and of eval.py's predictions on it, beside their accuracy per kind)."""
  script = load_script("make_image_task")
  out = str(tmp_path / "set.jsonl")
  levels = script.write_task(num=60, seed=5, out=out)
  records = [json.loads(line) for line in open(out, encoding="utf-8")]
  pairs = [(r["messages"][0]["content"][1]["text"], r["messages"][1]["content"]) for r in records]
  assert [r["kind"] for r in records] == [script.kind_of(q) for q, _ in pairs]
  for kind in script.QUESTIONS:
    answers = [a for q, a in pairs if script.kind_of(q) == kind]
    top = max(set(answers), key=answers.count)
    assert levels[kind] == {"examples": len(answers), "answer": levels[kind]["answer"],
                            "chance": answers.count(top) / len(answers)}
    assert answers.count(levels[kind]["answer"]) == answers.count(top)
  assert levels["overall"]["chance"] == pytest.approx(
      sum(levels[k]["chance"] * levels[k]["examples"] for k in script.QUESTIONS) / 60)
  predictions = tmp_path / "predictions.jsonl"  # right on the colour questions only
  predictions.write_text("".join(json.dumps({"prompt": q, "reference": a,
                                             "correct": script.kind_of(q) == "colour"}) + "\n"
                                 for q, a in pairs))
  table = script.score_predictions(str(predictions)).splitlines()
  row = {line.split()[0]: line.split()[1:] for line in table[1:]}
  assert row["colour"][1] == "100.0%" and row["count"][1] == "0.0%"
  assert row["overall"][2] == f"{levels['overall']['chance']:.1%}"


def test_show_examples_images(tmp_path):
  """scripts/show_examples.py on image data: each placeholder shown once with its soft-token
  count and file; --json lists the files."""
  data = str(tmp_path / "shapes.jsonl")
  load_script("make_image_task").write_task(num=2, seed=1, out=data)
  r = run("scripts/show_examples.py", "--config=sft_image", f"--data={data}", "--num=1")
  assert r.returncode == 0, r.stderr
  image = str(tmp_path / "shapes_images" / "000000.png")
  question = json.loads(open(data, encoding="utf-8").readline())["messages"][0]["content"][1]
  assert (f"--- prompt ---\n<bos><|turn>user\n<|image>[<|image|> x 16: {image}]<image|>"
          f"{question['text']}<turn|>\n<|turn>model\n") in r.stdout


def test_image_prompt_with_a_thought_in_the_reply(tmp_path):
  """Images and thinking together: a user turn with an image and an assistant turn with a
  thought render in thinking mode with the image's placeholder (the prompt and the target are
  the whole conversation's rendering), and the training row supervises the thought and the
  answer beside the image's pixels."""
  image = write_png(tmp_path / "img" / "a.png", 32, 48, seed=3)
  record = image_record([{"type": "image", "path": "img/a.png"},
                         {"type": "text", "text": "How many?"}], "3")
  record["messages"][-1]["reasoning_content"] = "I count three."
  path = write_jsonl(tmp_path / "d.jsonl", [record])
  task = make_task(image_config(path, max_images=1, prompt_len=96, num_canvases=4,
                                canvas_length=16, thinking=True))
  (example,) = task.train_examples(0, 1)
  tok = task.tokenizer
  soft_tokens = image_processing.process_images([image], task.image_settings).num_soft_tokens
  messages = json.loads(json.dumps(record["messages"]))
  messages[0]["content"][0]["path"] = image
  assert list(example.prompt_ids) == tok.render(messages[:1], True, enable_thinking=True,
                                                image_soft_tokens=soft_tokens)
  whole = tok.render(messages, enable_thinking=True, image_soft_tokens=soft_tokens)
  assert list(example.prompt_ids + example.target_ids) == whole[:-len(tok.encode("\n"))]
  target = tok.encode("<|channel>thought\nI count three.\n<channel|>3") + [tok.eot_id]
  assert list(example.target_ids) == target
  batch = next(task.train_batches(1, 1))
  reply = slice(96, 96 + len(target))
  assert batch["tokens"][0, reply].tolist() == target and batch["loss_mask"][0, reply].all()
  assert int((batch["tokens"][0] == tok.image_token_ids[1]).sum()) == soft_tokens[0]
  processed = image_processing.process_images([image], task.image_settings, num_slots=1)
  np.testing.assert_array_equal(batch["pixel_values"][0], processed.pixel_values)
  # A system turn of text parts goes after <|think|> as its string would.
  system = {"role": "system", "content": [{"type": "text", "text": " Be brief. "}]}
  assert tok.render_text([system, *messages], enable_thinking=True).startswith(
      "<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\n<|image|>How many?")
