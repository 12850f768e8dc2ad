"""Write a synthetic chat task as messages JSONL (one conversation per line).

  python scripts/make_chat_task.py --task=count --num=20000 --seed=1 --out=/tmp/count.jsonl
  python scripts/make_chat_task.py --task=sort --num=500 --seed=2 --out=/tmp/sort_test.jsonl
  python scripts/make_chat_task.py --task=infill_count --num=500 --seed=2 --out=/tmp/infill.jsonl

count: user "Count from A to B.", assistant "A A+1 ... B" (single spaces); A uniform in 1..500,
       B - A uniform in 10..40 (with the byte tokenizer and 32-token canvases, mostly 2-6
       canvases of reply).
sort:  user "Sort the letters: S", S 20..60 random lowercase letters; assistant the letters of S
       in alphabetical order, no separators.
infill_count: count with a gap to fill. user "Count up by one." (the numbers are not in the
       prompt: only the given parts of the reply tell them), assistant "A A+1 ... B" with
       A uniform in 1..500 and 5..8 numbers (uniform), so a reply and its end of turn fit one
       32-token canvas with the byte tokenizer: the prefix, the gap and the suffix share a
       canvas, as an infill must (docs/design.md, "Infilling"). The line also carries
         "infill": {"prefix": P, "middle": M, "suffix": S}, P + M + S == the reply exactly:
       the gap is 1..3 consecutive numbers (uniform), at a uniform place with at least one
       number after it (P may be empty, S never is); P and M each end with the space before
       the next number.
       Training reads the line as an ordinary conversation (the infill fields are ignored);
       evaluation fixes P and S in the reply's canvas and scores the generated middle against
       M (diffgemma/tasks/chat.py, docs/chat.md).
Each line is a pure function of (task, seed, line number); a fresh seed gives a fresh set.
"""

import json
import string

from absl import flags
import numpy as np

from diffgemma import cli, errors

TASKS = ("count", "sort", "infill_count")
COUNT_START = (1, 500)  # A, inclusive
COUNT_SPAN = (10, 40)  # B - A, inclusive
SORT_LENGTH = (20, 60)  # letters, inclusive
INFILL_START = (1, 500)  # A, inclusive
INFILL_NUMBERS = (5, 8)  # numbers in the reply, inclusive: <= 31 bytes, one 32-byte canvas
INFILL_GAP = (1, 3)  # numbers left out, inclusive (always fewer than the reply's)
INFILL_PROMPT = "Count up by one."

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_enum("task", None, TASKS, "Which task.")
  flags.DEFINE_integer("num", None, "Number of conversations.")
  flags.DEFINE_integer("seed", 0, "Generator seed.")
  flags.DEFINE_string("out", None, "Output JSONL path.")


def count_conversation(rng: np.random.Generator) -> list[dict]:
  a = int(rng.integers(COUNT_START[0], COUNT_START[1] + 1))
  b = a + int(rng.integers(COUNT_SPAN[0], COUNT_SPAN[1] + 1))
  return [{"role": "user", "content": f"Count from {a} to {b}."},
          {"role": "assistant", "content": " ".join(str(n) for n in range(a, b + 1))}]


def sort_conversation(rng: np.random.Generator) -> list[dict]:
  length = int(rng.integers(SORT_LENGTH[0], SORT_LENGTH[1] + 1))
  letters = "".join(rng.choice(list(string.ascii_lowercase), size=length))
  return [{"role": "user", "content": f"Sort the letters: {letters}"},
          {"role": "assistant", "content": "".join(sorted(letters))}]


def infill_count_record(rng: np.random.Generator) -> dict:
  """A count reply with a gap: the conversation and its "infill" split (module docstring)."""
  a = int(rng.integers(INFILL_START[0], INFILL_START[1] + 1))
  numbers = [str(n) for n in range(a, a + int(rng.integers(INFILL_NUMBERS[0],
                                                           INFILL_NUMBERS[1] + 1)))]
  gap = int(rng.integers(INFILL_GAP[0], INFILL_GAP[1] + 1))
  start = int(rng.integers(0, len(numbers) - gap))  # the suffix keeps >= 1 number
  prefix = "".join(n + " " for n in numbers[:start])
  middle = "".join(n + " " for n in numbers[start:start + gap])
  suffix = " ".join(numbers[start + gap:])
  return {"messages": [{"role": "user", "content": INFILL_PROMPT},
                       {"role": "assistant", "content": " ".join(numbers)}],
          "infill": {"prefix": prefix, "middle": middle, "suffix": suffix}}


def write_task(task: str, num: int, seed: int, out: str) -> None:
  """Write `num` conversations of `task`; line i is drawn from the generator seeded (seed, i)."""
  if task not in TASKS:
    raise cli.UserError(f"unknown --task {task!r}; choose one of {TASKS}")
  if num is None or num < 1:
    raise cli.UserError(f"--num must be positive, got {num}")
  make = {"count": lambda rng: {"messages": count_conversation(rng)},
          "sort": lambda rng: {"messages": sort_conversation(rng)},
          "infill_count": infill_count_record}[task]
  errors.prepare_output_file(out, "out")
  with open(out, "w", encoding="utf-8") as f:
    for i in range(num):
      f.write(json.dumps(make(np.random.default_rng([seed, i]))) + "\n")


def main(argv):
  del argv
  if FLAGS.task is None or FLAGS.out is None or FLAGS.num is None:
    raise cli.UserError("--task, --num and --out are required")
  write_task(FLAGS.task, FLAGS.num, FLAGS.seed, FLAGS.out)
  print(f"wrote {FLAGS.num} {FLAGS.task} conversations to {FLAGS.out}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
