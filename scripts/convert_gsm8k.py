"""Convert GSM8K (JSONL lines {"question", "answer"}, the answer ending in "#### N") to chat
messages JSONL with a train/test split.

  python scripts/convert_gsm8k.py --train=gsm8k/train.jsonl --test=gsm8k/test.jsonl \
      --out_dir=data/gsm8k
  python scripts/convert_gsm8k.py --train=gsm8k/train.jsonl --test_size=500 --out_dir=DIR

Writes OUT_DIR/train.jsonl and OUT_DIR/test.jsonl, one line per problem:
  {"messages": [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": ANSWER}]}
ANSWER is GSM8K's worked solution with its "#### N" line (evaluate with --metric=gsm8k); the
calculator annotations "<<48/2=24>>" are removed unless --keep_calculator. Without --test, a
seeded --test_size problems of --train are held out; the order of the input is kept.
"""

import json
import os
import re

from absl import flags
import numpy as np

from diffgemma import cli, errors

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("train", None, "GSM8K training JSONL.")
  flags.DEFINE_string("test", None, "GSM8K test JSONL (else split --train).")
  flags.DEFINE_integer("test_size", 500, "Problems held out of --train without --test.")
  flags.DEFINE_integer("seed", 0, "Seed of the held-out choice.")
  flags.DEFINE_string("out_dir", None, "Where train.jsonl and test.jsonl go.")
  flags.DEFINE_bool("keep_calculator", False,
                    "Keep the <<expression=value>> calculator annotations.")

_CALCULATOR = re.compile(r"<<[^<>]*>>")
_FINAL = re.compile(r"####\s*\S")


def read_problems(path: str, keep_calculator: bool = False) -> list[dict]:
  """Messages of every line of a GSM8K file; a malformed line is a one-line error."""
  if not os.path.isfile(path):
    raise cli.UserError(f"{path} not found")
  out = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, start=1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except ValueError:
        raise cli.UserError(f"{path}:{number}: not JSON") from None
      if not isinstance(record, dict):
        raise cli.UserError(f"{path}:{number}: expected a JSON object")
      question, answer = record.get("question"), record.get("answer")
      if not isinstance(question, str) or not question.strip():
        raise cli.UserError(f"{path}:{number}: no \"question\" string")
      if not isinstance(answer, str) or not _FINAL.search(answer):
        raise cli.UserError(f"{path}:{number}: the \"answer\" has no final \"#### N\" line")
      if not keep_calculator:
        answer = _CALCULATOR.sub("", answer)
      out.append({"messages": [{"role": "user", "content": question.strip()},
                               {"role": "assistant", "content": answer.strip()}]})
  if not out:
    raise cli.UserError(f"{path} has no problems")
  return out


def write_jsonl(path: str, records: list[dict]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record, ensure_ascii=False) + "\n")


def convert(train_path: str, out_dir: str, test_path: str | None = None, test_size: int = 500,
            seed: int = 0, keep_calculator: bool = False) -> tuple[int, int]:
  """Write out_dir/train.jsonl and out_dir/test.jsonl; returns their sizes."""
  train = read_problems(train_path, keep_calculator)
  if test_path:
    test = read_problems(test_path, keep_calculator)
  else:
    if not 0 < test_size < len(train):
      raise cli.UserError(f"--test_size={test_size} must be between 1 and {len(train) - 1} "
                          f"({len(train)} problems in {train_path})")
    held = set(np.random.default_rng(seed).permutation(len(train))[:test_size].tolist())
    train, test = ([r for i, r in enumerate(train) if i not in held],
                   [r for i, r in enumerate(train) if i in held])
  errors.prepare_output_file(out_dir, "out_dir", directory=True)
  for name, records in (("train", train), ("test", test)):
    write_jsonl(os.path.join(out_dir, f"{name}.jsonl"), records)
  return len(train), len(test)


def main(argv):
  del argv
  if not FLAGS.train or not FLAGS.out_dir:
    raise cli.UserError("--train and --out_dir are required")
  errors.check_output_file(FLAGS.out_dir, "out_dir", directory=True)
  n_train, n_test = convert(FLAGS.train, FLAGS.out_dir, FLAGS.test, FLAGS.test_size, FLAGS.seed,
                            FLAGS.keep_calculator)
  print(f"wrote {n_train} training and {n_test} test problems to {FLAGS.out_dir}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
