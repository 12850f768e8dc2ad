"""SFT of a small DiffusionGemma on your chat data, from scratch, with the byte-level tokenizer.

  python scripts/make_chat_task.py --task=count --num=20000 --seed=1 --out=/tmp/count.jsonl
  python train.py --config=sft_chat --workdir=/tmp/chat --config.data.train=/tmp/count.jsonl
  python eval.py --workdir=/tmp/chat --data=HELDOUT.jsonl

`--config=sft_chat:sort` sizes the layout for scripts/make_chat_task.py's sort task (its prompts
are up to ~95 bytes; replies fit 2 canvases), `--config=sft_chat:infill_count` for its
infill_count task (replies fit one canvas). To fine-tune a checkpoint on chat data instead,
pass --init_from=DIR: its tokenizer and chat template are used when data.tokenizer is empty
(see configs/sft_pubmedqa_lora.py).

The count variant packs whole examples into rows of data.max_row_tokens slots (`PACKING`;
batch_size counts rows); --config.data.max_row_tokens=0 lays out one example per row instead,
as sort and infill_count do by default.

The chat task's keys (data.*, eval.*, rl.reward / rl.reward_fn) are documented at
`ChatSettings` in diffgemma/tasks/chat.py, which reads them.
"""

import ml_collections

from configs import base

BYTE_VOCAB = 261  # the byte tokenizer: PAD, EOS, BOS, <|turn>, <turn|>, 256 bytes
CANVAS = 32
# Warn when >= 10% of replies overrun the reference at step 700 (RESULTS.md, "Recipe notes").
STOP_CHECK_STEP, STOP_OVERRUN_WARNING = 700, 0.10
# Sort decodes left to right: 92.8% exact against 55.6% for parallel denoising (medians of three
# seeds, same weights; RESULTS.md, "Chat: three seeds of sort").
VARIANT_SAMPLERS = {"sort": dict(mode="ar")}
# Noise levels t = sqrt(u) (more training near pure noise) lift sort's diffusion decoding at
# equal minutes and leave its AR decoding as it was (RESULTS.md, "Chat sort decoded by diffusion").
VARIANT_LOSSES = {"sort": dict(t_distribution="sqrt")}
# Fitted schedules below this are warned about (RESULTS.md, "Recipe notes").
VARIANT_MIN_STEPS = {"sort": 1000}
# Each synthetic task's longest prompt and reply (scripts/make_chat_task.py) fit its layout.
LAYOUTS = {"count": dict(prompt_len=48, num_canvases=6),
           "sort": dict(prompt_len=96, num_canvases=2),
           "infill_count": dict(prompt_len=40, num_canvases=1)}
# Training packs whole examples into rows (diffgemma/tasks/packing.py) where that is cheaper per
# example: count (a mean example takes 151 of its 240 layout slots) at 0.88x the unpacked step's
# cost per example. Sort (128 of 160) and infill_count (64 of 72) cost 1.16-1.25x and 1.05-1.13x
# packed, as a packed row's attention grows with the square of its length and its decoder runs
# max_row_examples canvases however many examples fit (RESULTS.md, "Packed rows, per example"),
# so they lay out one example per row. batch_size counts rows: ROWS packed rows see about as many
# examples per step as the unpacked batch of 16 does.
PACKING = {"count": dict(max_row_tokens=320, max_row_examples=2),
           "sort": dict(max_row_tokens=0, max_row_examples=0),
           "infill_count": dict(max_row_tokens=0, max_row_examples=0)}
ROWS = {"count": 10, "sort": 16, "infill_count": 16}


def get_config(variant: str = "count"):
  if variant not in LAYOUTS:
    raise ValueError(f"unknown sft_chat variant {variant!r}; choose one of {tuple(LAYOUTS)}")
  c = base.get_config()
  c.task = ml_collections.ConfigDict(dict(name="chat"))

  # Model: Sudoku-sized DiffusionGemma (about 2.3M parameters) over the byte vocabulary; theta
  # 100 spreads the RoPE frequencies over the ~250-token context.
  c.model = base.small_model(vocab_size=BYTE_VOCAB, sliding_rope_theta=100.0,
                             canvas_length=CANVAS)

  # Objective: one supervised canvas per example, uniformly among its valid canvases, the
  # earlier ones clean in the encoder cache; the encoder's next-token loss on the reply.
  c.loss.update(dict(encoder_weight=1.0, encoder_scope="target", canvas_selection="one",
                     **VARIANT_LOSSES.get(variant, {})))

  c.optimizer.warmup_steps = 100
  c.batch_size = ROWS[variant]

  c.data = ml_collections.ConfigDict(dict(
      train="", weights="", eval="", eval_fraction=0.0, tokenizer="bytes",
      **LAYOUTS[variant], **PACKING[variant], overflow="truncate_left", seed=1, num_threads=1,
      prefetch=4, thinking=False))

  # The sampler's budget is the layout's K canvases.
  c.sampler.max_new_tokens = LAYOUTS[variant]["num_canvases"] * CANVAS
  c.sampler.update(VARIANT_SAMPLERS.get(variant, {}))
  # 0: the schedule is fitted to max_train_minutes (30) on the machine it runs on.
  c.num_train_steps = 0
  c.min_useful_steps = VARIANT_MIN_STEPS.get(variant, 0)

  c.eval = ml_collections.ConfigDict(dict(
      every_steps=1000, num_examples=64, batch_size=64, metric="exact", answer_regex="",
      seed=12345, trace_examples=2,  # trace_examples: denoising traces drawn in TensorBoard
      stop_check_step=STOP_CHECK_STEP, stop_overrun_warning=STOP_OVERRUN_WARNING))
  return c
