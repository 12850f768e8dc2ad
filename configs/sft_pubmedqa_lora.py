"""LoRA fine-tuning of DiffusionGemma 26B-A4B on PubMedQA, on 2 x 80 GB GPUs.

  python scripts/convert_pubmedqa.py --input=ori_pqal.json --test_ids=test_ground_truth.json \
      --out_dir=data/pubmedqa
  python train.py --config=sft_pubmedqa_lora --workdir=runs/pubmedqa --init_from=/ckpt/dg26b \
      --config.data.train=data/pubmedqa/train.jsonl --config.data.eval=data/pubmedqa/test.jsonl
  python eval.py --workdir=runs/pubmedqa --data=data/pubmedqa/test.jsonl --metric=choice
  python train.py --config=sft_pubmedqa_lora --dry_run        # memory plan on 2 simulated devices

Model, LoRA, numerics and sharding are configs/sft_sudoku_lora.py's (rank 16 on every linear,
bfloat16 frozen base over both devices). Layout: prompt 1024 and 2 canvases of 256 tokens, the
report's canvas length, which the released checkpoint fixes (Google's recipe uses 2 canvases of
128 with a model trained at that length). The checkpoint's tokenizer and chat template render
the conversations (data.tokenizer empty). The chat keys are documented at
`ChatSettings` in diffgemma/tasks/chat.py.
"""

import ml_collections

from configs import sft_sudoku_lora


def get_config():
  c = sft_sudoku_lora.get_config()
  c.task = ml_collections.ConfigDict(dict(name="chat"))
  c.num_train_steps = 1000
  c.batch_size = 8
  # Micro-batches of 2 rows (one per device): a row is 1024 + 2 * 256 = 1536 tokens, 4.5 times
  # a Sudoku row, so the per-device activations stay near the Sudoku plan's.
  c.grad_accum_steps = 4
  c.checkpoint_every = 100
  c.optimizer.lr = 2e-4
  c.optimizer.warmup_steps = 50

  c.loss = ml_collections.ConfigDict(dict(
      encoder_weight=1.0, decoder_weight=1.0, encoder_scope="target", canvas_selection="one",
      noise_schedule="linear", t_eps=1e-3, self_conditioning_prob=0.5,
      decoder_weighting="flat"))

  c.data = ml_collections.ConfigDict(dict(
      train="", weights="", eval="", eval_fraction=0.0, tokenizer="", prompt_len=1024,
      num_canvases=2, overflow="truncate_left", seed=1, num_threads=1, prefetch=4,
      thinking=False, max_row_tokens=0, max_row_examples=0))  # 0: no packing (tasks/packing.py)
  c.sampler.max_new_tokens = 2 * 256

  c.eval = ml_collections.ConfigDict(dict(
      every_steps=250, num_examples=100, batch_size=16, metric="choice", answer_regex="",
      seed=12345))
  return c
