"""Write a synthetic image task: coloured shapes on a canvas, questions with short exact answers.

  python scripts/make_image_task.py --num=20000 --seed=1 --out=/tmp/shapes/train.jsonl
  python scripts/make_image_task.py --num=500 --seed=2 --out=/tmp/shapes/test.jsonl

Each line is one conversation in the messages format with an image part (docs/chat.md,
"Images"): the user turn is the image, then a question; the assistant turn is the answer.
The images are PNGs of CANVAS x CANVAS pixels in a folder beside the file, named after it
(train.jsonl -> train_images/000000.png), referred to by paths relative to the file.
A picture holds 1 to 4 shapes (circle, square or triangle; red, green, blue or yellow; 12 to 20
pixels across) at uniform places, not overlapping, on white. The questions:
  count   "How many red circles?"       -> "0" .. "4" (the colour and shape of a drawn shape
                                            three times in four, else any pair, often "0");
  colour  "What colour is the square?"  -> "red" (asked of a shape drawn exactly once);
  total   "How many shapes?"            -> "1" .. "4".
A line also carries "kind" (count, colour or total) and "shapes": [{"shape", "colour", "x",
"y", "size"}] (the centre in pixels, the size across), which training ignores. Each line and its
image are a pure function of (seed, line number): a fresh seed gives a fresh set (a held-out
set: another seed, as scripts/make_chat_task.py makes them).

Chance: a model that reads the question but not the picture does best answering each kind's most
common answer. The generator draws colours and totals uniformly (1 in 4 right) but count answers
unevenly ("1" about 69% of the time: a count question asks mostly about a drawn shape), so a
set's chance is the share its majority answers get, per kind and overall; writing a set prints
it, and

  python scripts/make_image_task.py --predictions=RUN/predictions/test-stepN.jsonl

prints eval.py's accuracy per kind beside the chance of the same rows.
"""

import collections
import json
import os
import re

from absl import flags
import numpy as np
from PIL import Image, ImageDraw

from diffgemma import cli, errors

CANVAS = 64  # pixels per side: small, so a tiny vision tower learns on a CPU
SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 40), "blue": (30, 60, 220),
           "yellow": (230, 200, 20)}
NUM_SHAPES = (1, 4)  # shapes per picture, inclusive
SIZE = (12, 20)  # pixels across, inclusive
QUESTIONS = ("count", "colour", "total")
MAX_PLACEMENT_TRIES = 200

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_integer("num", None, "Number of conversations (and images).")
  flags.DEFINE_integer("seed", 0, "Generator seed.")
  flags.DEFINE_string("out", None, "Output JSONL path; the images go in a folder beside it.")
  flags.DEFINE_string("predictions", None, "Instead of writing a set: eval.py's predictions "
                      "JSONL on a set this script wrote; prints accuracy and chance per kind.")


def image_folder(out: str) -> str:
  """The images' folder, relative to the JSONL file's folder: FILE_STEM + "_images"."""
  return os.path.splitext(os.path.basename(out))[0] + "_images"


def draw_shapes(rng: np.random.Generator) -> list[dict]:
  """1..4 shapes at places where no two bounding boxes touch."""
  shapes = []
  for _ in range(int(rng.integers(NUM_SHAPES[0], NUM_SHAPES[1] + 1))):
    for _ in range(MAX_PLACEMENT_TRIES):
      size = int(rng.integers(SIZE[0], SIZE[1] + 1))
      half = size // 2
      x, y = (int(v) for v in rng.integers(half, CANVAS - half, size=2))
      if all(abs(x - s["x"]) > half + s["size"] // 2 + 1 or
             abs(y - s["y"]) > half + s["size"] // 2 + 1 for s in shapes):
        shapes.append({"shape": str(rng.choice(SHAPES)), "colour": str(rng.choice(list(COLOURS))),
                       "x": x, "y": y, "size": size})
        break
  return shapes


def render(shapes: list[dict]) -> Image.Image:
  """The picture: shapes filled without antialiasing on white (each centre pixel is exactly
  its shape's colour)."""
  image = Image.new("RGB", (CANVAS, CANVAS), (255, 255, 255))
  pen = ImageDraw.Draw(image)
  for s in shapes:
    half, x, y, fill = s["size"] // 2, s["x"], s["y"], COLOURS[s["colour"]]
    box = (x - half, y - half, x + half, y + half)
    if s["shape"] == "circle":
      pen.ellipse(box, fill=fill)
    elif s["shape"] == "square":
      pen.rectangle(box, fill=fill)
    else:
      pen.polygon([(x, y - half), (x + half, y + half), (x - half, y + half)], fill=fill)
  return image


def ask(rng: np.random.Generator, shapes: list[dict]) -> str:
  """A question about the picture (module docstring); colour falls back to count when no shape
  is drawn exactly once."""
  kind = str(rng.choice(QUESTIONS))
  single = sorted(k for k in SHAPES if sum(s["shape"] == k for s in shapes) == 1)
  if kind == "colour" and single:
    return f"What colour is the {rng.choice(single)}?"
  if kind == "total":
    return "How many shapes?"
  if rng.random() < 0.75:
    pick = shapes[int(rng.integers(len(shapes)))]
    colour, shape = pick["colour"], pick["shape"]
  else:
    colour, shape = str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))
  return f"How many {colour} {shape}s?"


def kind_of(question: str) -> str:
  """The kind of a question of `ask`: count, colour or total."""
  if question == "How many shapes?":
    return "total"
  return "colour" if question.startswith("What colour") else "count"


def chance_levels(pairs) -> dict[str, dict]:
  """{kind: {"examples", "answer" (the most common), "chance" (its share)}} of (question,
  answer) pairs, and "overall": {"examples", "chance"}: the accuracy of answering each kind's
  most common answer without looking at the picture."""
  answers = collections.defaultdict(collections.Counter)
  for question, reply in pairs:
    answers[kind_of(question)][reply] += 1
  out, right = {}, 0
  for kind in QUESTIONS:
    if answers[kind]:
      reply, count = answers[kind].most_common(1)[0]
      n = sum(answers[kind].values())
      out[kind] = {"examples": n, "answer": reply, "chance": count / n}
      right += count
  total = sum(sum(c.values()) for c in answers.values())
  out["overall"] = {"examples": total, "chance": right / max(total, 1)}
  return out


def format_chance(levels: dict) -> str:
  return "; ".join(f"{kind} {v['chance']:.1%}" + (f" ({v['answer']!r})" if "answer" in v else "")
                   for kind, v in levels.items())


def score_predictions(path: str) -> str:
  """Lines of eval.py's accuracy per kind of question on a set of this task, each beside the
  chance of the same rows (`chance_levels`)."""
  if not os.path.isfile(path):
    raise cli.UserError(f"--predictions file {path!r} not found")
  records = []
  with open(path, encoding="utf-8") as f:
    for i, line in enumerate(f, 1):
      try:
        record = json.loads(line)
        records.append((record["prompt"], record["reference"], bool(record["correct"])))
      except (ValueError, KeyError, TypeError):
        raise cli.UserError(f"{path}:{i}: not a prediction of eval.py (prompt, reference, "
                            "correct)") from None
  levels = chance_levels((q, r) for q, r, _ in records)
  lines = ["kind     examples  accuracy  chance"]
  for kind in (*QUESTIONS, "overall"):
    if kind in levels:
      rows = [c for q, _, c in records if kind == "overall" or kind_of(q) == kind]
      lines.append(f"{kind:8s} {len(rows):8d}  {np.mean(rows):8.1%}  {levels[kind]['chance']:6.1%}")
  return "\n".join(lines)


def answer(question: str, shapes: list[dict]) -> str:
  """The exact answer to a question of `ask` about these shapes."""
  if question == "How many shapes?":
    return str(len(shapes))
  match = re.fullmatch(r"What colour is the (\w+)\?", question)
  if match:
    (colour,) = [s["colour"] for s in shapes if s["shape"] == match[1]]
    return colour
  match = re.fullmatch(r"How many (\w+) (\w+)s\?", question)
  if not match:
    raise ValueError(f"not a question of this task: {question!r}")
  return str(sum(s["colour"] == match[1] and s["shape"] == match[2] for s in shapes))


def write_task(num: int, seed: int, out: str) -> dict:
  """`num` pictures and conversations; line i (and image i) drawn from the generator seeded
  (seed, i). Returns the set's `chance_levels`."""
  if num is None or num < 1:
    raise cli.UserError(f"--num must be positive, got {num}")
  folder = os.path.join(os.path.dirname(os.path.abspath(out)), image_folder(out))
  errors.check_output_file(out, "out")
  errors.check_output_file(folder, "out", directory=True)
  errors.prepare_output_file(folder, "out", directory=True)
  pairs = []
  with open(out, "w", encoding="utf-8") as f:
    for i in range(num):
      rng = np.random.default_rng([seed, i])
      shapes = draw_shapes(rng)
      question = ask(rng, shapes)
      name = f"{i:06d}.png"
      render(shapes).save(os.path.join(folder, name))
      image = {"type": "image", "path": f"{image_folder(out)}/{name}"}
      pairs.append((question, answer(question, shapes)))
      record = {"messages": [
          {"role": "user", "content": [image, {"type": "text", "text": question}]},
          {"role": "assistant", "content": pairs[-1][1]}], "kind": kind_of(question),
          "shapes": shapes}
      f.write(json.dumps(record) + "\n")
  return chance_levels(pairs)


def main(argv):
  del argv
  if FLAGS.predictions is not None:
    if FLAGS.out is not None or FLAGS.num is not None:
      raise cli.UserError("--predictions reads a run's predictions; it writes no set (drop "
                          "--out and --num)")
    print(score_predictions(FLAGS.predictions))
    return
  if FLAGS.out is None or FLAGS.num is None:
    raise cli.UserError("--num and --out are required")
  levels = write_task(FLAGS.num, FLAGS.seed, FLAGS.out)
  print(f"wrote {FLAGS.num} image questions to {FLAGS.out} (images in "
        f"{os.path.join(os.path.dirname(FLAGS.out), image_folder(FLAGS.out))}); chance "
        f"(each kind's most common answer): {format_chance(levels)}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
