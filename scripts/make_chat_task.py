"""Write a synthetic chat task as messages JSONL (one conversation per line).

  python scripts/make_chat_task.py --task=count --num=20000 --seed=1 --out=/tmp/count.jsonl
  python scripts/make_chat_task.py --task=sort --num=500 --seed=2 --out=/tmp/sort_test.jsonl

count: user "Count from A to B.", assistant "A A+1 ... B" (single spaces); A uniform in 1..500,
       B - A uniform in 10..40 (with the byte tokenizer and 32-token canvases, mostly 2-6
       canvases of reply).
sort:  user "Sort the letters: S", S 20..60 random lowercase letters; assistant the letters of S
       in alphabetical order, no separators.
Each line is a pure function of (task, seed, line number); a fresh seed gives a fresh set.
"""

import json
import os
import string
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

from diffgemma import cli  # noqa: E402

TASKS = ("count", "sort")
COUNT_START = (1, 500)  # A, inclusive
COUNT_SPAN = (10, 40)  # B - A, inclusive
SORT_LENGTH = (20, 60)  # letters, inclusive

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


def write_task(task: str, num: int, seed: int, out: str) -> None:
  """Write `num` conversations of `task`; line i is drawn from the generator seeded (seed, i)."""
  if task not in TASKS:
    raise cli.UserError(f"unknown --task {task!r}; choose one of {TASKS}")
  if num is None or num < 1:
    raise cli.UserError(f"--num must be positive, got {num}")
  make = {"count": count_conversation, "sort": sort_conversation}[task]
  out_dir = os.path.dirname(os.path.abspath(out))
  if not os.path.isdir(out_dir):
    raise cli.UserError(f"directory {out_dir} does not exist")
  with open(out, "w", encoding="utf-8") as f:
    for i in range(num):
      f.write(json.dumps({"messages": make(np.random.default_rng([seed, i]))}) + "\n")


def main(argv):
  del argv
  if FLAGS.task is None or FLAGS.out is None or FLAGS.num is None:
    raise cli.UserError("--task, --num and --out are required")
  write_task(FLAGS.task, FLAGS.num, FLAGS.seed, FLAGS.out)
  print(f"wrote {FLAGS.num} {FLAGS.task} conversations to {FLAGS.out}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
