"""Convert PubMedQA's labelled set (ori_pqal.json: id -> QUESTION, CONTEXTS, LONG_ANSWER,
final_decision) to chat messages JSONL with a train/test split.

  python scripts/convert_pubmedqa.py --input=pubmedqa/ori_pqal.json \
      --test_ids=pubmedqa/test_ground_truth.json --out_dir=data/pubmedqa
  python scripts/convert_pubmedqa.py --input=ori_pqal.json --test_size=500 --out_dir=DIR

Writes OUT_DIR/train.jsonl and OUT_DIR/test.jsonl, one line per question:
  user:      "Context:\n<the contexts, one per line>\n\nQuestion: <question>\n\n" + INSTRUCTION
  assistant: "<long answer> The answer is <yes|no|maybe>."
so that --metric=choice reads the label from the strict marker. The test split is the ids of
--test_ids (a JSON object keyed by id, like PubMedQA's test_ground_truth.json), else a seeded
--test_size ids; the input's order is kept. Field names are matched case-insensitively.
"""

import json
import os

from absl import flags
import numpy as np

from diffgemma import cli, errors

INSTRUCTION = ("Answer with a short explanation, then end with \"The answer is yes.\", "
               "\"The answer is no.\" or \"The answer is maybe.\"")
DECISIONS = ("yes", "no", "maybe")

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("input", None, "PubMedQA labelled JSON (ori_pqal.json).")
  flags.DEFINE_string("test_ids", None, "JSON object whose keys are the test ids.")
  flags.DEFINE_integer("test_size", 500, "Questions held out without --test_ids.")
  flags.DEFINE_integer("seed", 0, "Seed of the held-out choice.")
  flags.DEFINE_string("out_dir", None, "Where train.jsonl and test.jsonl go.")


def _read_json(path: str):
  if not os.path.isfile(path):
    raise cli.UserError(f"{path} not found")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except ValueError as e:
    raise cli.UserError(f"{path} is not JSON: {str(e).splitlines()[0]}") from None


def conversation(path: str, key: str, entry) -> dict:
  """The messages of one labelled question; a malformed entry is a one-line error."""
  if not isinstance(entry, dict):
    raise cli.UserError(f"{path}: entry {key!r} is not an object")
  fields = {k.lower(): v for k, v in entry.items()}
  question, contexts = fields.get("question"), fields.get("contexts")
  long_answer, decision = fields.get("long_answer"), fields.get("final_decision")
  if not isinstance(question, str) or not question.strip():
    raise cli.UserError(f"{path}: entry {key!r} has no QUESTION")
  if (not isinstance(contexts, list) or not contexts or
      not all(isinstance(c, str) for c in contexts)):
    raise cli.UserError(f"{path}: entry {key!r} has no CONTEXTS list of strings")
  if not isinstance(long_answer, str) or not long_answer.strip():
    raise cli.UserError(f"{path}: entry {key!r} has no LONG_ANSWER")
  if not isinstance(decision, str) or decision.strip().lower() not in DECISIONS:
    raise cli.UserError(f"{path}: entry {key!r} has final_decision {decision!r}, not one of "
                        f"{DECISIONS}")
  context = "\n".join(c.strip() for c in contexts)
  user = f"Context:\n{context}\n\nQuestion: {question.strip()}\n\n{INSTRUCTION}"
  reply = f"{long_answer.strip()} The answer is {decision.strip().lower()}."
  return {"messages": [{"role": "user", "content": user},
                       {"role": "assistant", "content": reply}]}


def convert(input_path: str, out_dir: str, test_ids_path: str | None = None,
            test_size: int = 500, seed: int = 0) -> tuple[int, int]:
  """Write out_dir/train.jsonl and out_dir/test.jsonl; returns their sizes. Every entry is
  checked before anything is written."""
  data = _read_json(input_path)
  if not isinstance(data, dict) or not data:
    raise cli.UserError(f"{input_path}: expected a non-empty JSON object id -> entry")
  ids = list(data)
  if test_ids_path:
    wanted = _read_json(test_ids_path)
    if not isinstance(wanted, dict):
      raise cli.UserError(f"{test_ids_path}: expected a JSON object keyed by id")
    missing = [k for k in wanted if k not in data]
    if missing:
      raise cli.UserError(f"{test_ids_path}: {len(missing)} test ids are not in {input_path} "
                          f"(first: {missing[0]!r})")
    test_ids = set(wanted)
  else:
    if not 0 < test_size < len(ids):
      raise cli.UserError(f"--test_size={test_size} must be between 1 and {len(ids) - 1} "
                          f"({len(ids)} questions in {input_path})")
    test_ids = {ids[i] for i in np.random.default_rng(seed).permutation(len(ids))[:test_size]}
  splits = {"train": [], "test": []}
  for key in ids:
    splits["test" if key in test_ids else "train"].append(
        conversation(input_path, key, data[key]))
  if not splits["train"]:
    raise cli.UserError("every question is in the test split; nothing left to train on")
  errors.prepare_output_file(out_dir, "out_dir", directory=True)
  for name, records in splits.items():
    with open(os.path.join(out_dir, f"{name}.jsonl"), "w", encoding="utf-8") as f:
      for record in records:
        f.write(json.dumps(record, ensure_ascii=False) + "\n")
  return len(splits["train"]), len(splits["test"])


def main(argv):
  del argv
  if not FLAGS.input or not FLAGS.out_dir:
    raise cli.UserError("--input and --out_dir are required")
  errors.check_output_file(FLAGS.out_dir, "out_dir", directory=True)
  n_train, n_test = convert(FLAGS.input, FLAGS.out_dir, FLAGS.test_ids, FLAGS.test_size,
                            FLAGS.seed)
  print(f"wrote {n_train} training and {n_test} test questions to {FLAGS.out_dir}")


if __name__ == "__main__":
  define_flags()
  cli.run(main)
