"""SFT of a small DiffusionGemma on your chat data, from scratch, with the byte-level tokenizer.

  python scripts/make_chat_task.py --task=count --num=20000 --seed=1 --out=/tmp/count.jsonl
  python train.py --config=sft_chat --workdir=/tmp/chat --config.data.train=/tmp/count.jsonl
  python eval.py --workdir=/tmp/chat --data=HELDOUT.jsonl

`--config=sft_chat:sort` sizes the layout for scripts/make_chat_task.py's sort task (its prompts
are up to ~95 bytes; replies fit 2 canvases), `--config=sft_chat:infill_count` for its
infill_count task (replies fit one canvas). To fine-tune a checkpoint on chat data instead,
pass --init_from=DIR: its tokenizer and chat template are used when data.tokenizer is empty
(see configs/sft_pubmedqa_lora.py).

Chat-task keys (diffgemma/tasks/chat.py reads them; data formats, layout and overflow policies
are described in diffgemma/tasks/chat_data.py):
  task.name            "chat".
  data.train           training JSONL: a path, comma-separated paths, or a list of paths. Each
                       line is {"messages": [...]}, {"prompt", "completion"} or ShareGPT
                       {"conversations": [...]}; one example per assistant turn.
  data.weights         mixing weights, one per data.train file (comma-separated or a list);
                       empty = proportional to each file's number of examples.
  data.eval            held-out JSONL for the periodic evaluation (the last assistant turn of
                       each line is the reference); or
  data.eval_fraction   the share of each training file's conversations held out instead (0 =
                       none; not both).
  data.tokenizer       "bytes"; or a directory with tokenizer.json or tokenizer.model and a chat
                       template; empty = the --init_from checkpoint's.
  data.prompt_len      P: prompt slots (the rendered history and generation prompt, BOS
                       included, left-padded).
  data.num_canvases    K: reply canvases of model.canvas_length tokens (the sampler's budget is
                       K * canvas_length).
  data.overflow        prompts longer than P / replies longer than K canvases:
                       "truncate_left" (prompts lose their oldest tokens after BOS; replies keep
                       their beginning), "drop" (skip the example) or "error".
  data.seed            shuffling (per file, new every epoch) and the eval_fraction split.
  data.num_threads, data.prefetch   grain reader threads and prefetched batches.
  eval.every_steps     periodic evaluation on the held-out set (0 = off).
  eval.num_examples    held-out examples it uses (0 = all; a seeded subset when fewer).
  eval.batch_size      sampler batch of evaluation.
  eval.metric          "exact" (stripped match), "choice" ("the answer is yes|no|maybe"), "gsm8k"
                       (the number after ####), "regex" (first group of eval.answer_regex).
  eval.answer_regex    the pattern of metric "regex", with one capturing group.
  eval.seed            which held-out examples when num_examples is smaller than the set.
  eval.stop_check_step, eval.stop_overrun_warning   from that step on (0 = off), the periodic
                       eval warns in one line when at least that share of the held-out replies
                       hold the whole reference and go on past it (the stop is not learned).
An RL stage (configs/sdrl_chat.py): the task's section `rl`; rl.reward is one of the metric
names or the graded "prefix" (configs/sdrl_chat.py's default; diffgemma/tasks/text_metrics.py),
or rl.reward_fn = "package.module:function", called as function(prompt, reply, reference) ->
float in [0, 1] (prompt: the last user turn's text; reply: the generated text up to its first
stop token; reference: the data's reply).
"""

import ml_collections

from configs import base

BYTE_VOCAB = 261  # the byte tokenizer: PAD, EOS, BOS, <|turn>, <turn|>, 256 bytes
CANVAS = 32
# Layouts per synthetic task (scripts/make_chat_task.py): "count" prompts are <= 40 bytes with
# the template and replies <= 164 bytes with the end-of-turn (6 canvases of 32); "sort" prompts
# are <= 96 bytes and replies <= 61 (2 canvases); "infill_count" prompts are 32 bytes and
# replies <= 32 with the end-of-turn (one canvas: prefix, gap and suffix share it).
# The stop check (eval.stop_*): a run at count's target (95% exact) overruns at most 5% of its
# replies. At step 700 the three seeds of this count recipe, which never learn the stop, overran
# 14-22% of the periodic eval's replies (61-64% at step 1050), while the three sort seeds, which
# stop right, overran 0-3% at every eval (benchmarks/RESULTS.md, 2026-12-05). It does not catch
# a run that stops too early (loss.end_weight=40 on count: 0% overran, 96% too short).
STOP_CHECK_STEP, STOP_OVERRUN_WARNING = 700, 0.10
# Sort: parallel denoising loses the letter counts that left-to-right decoding of the same
# weights keeps, so sort decodes through the encoder's next-token head (`sampler.mode="ar"`;
# --sampler.mode=diffusion gives the denoiser). Three seeds, 500 held out (benchmarks/RESULTS.md,
# 2026-12-05): AR 82-90% exact (median 86%), AR fallback after one denoising step 79-87% (the
# step is spent, then 89-93% of canvases fall back), plain diffusion 4-16%.
VARIANT_SAMPLERS = {"sort": dict(mode="ar")}
# Schedules whose cosine decay ends inside 30 minutes on one core of a 2-core CPU (count: 1400
# steps in 30 minutes, sort: 1400 in 22-24; benchmarks/RESULTS.md).
# Fewer fitted steps are warned about: sort answers 28-61% of its periodic eval at step 1000
# (benchmarks/RESULTS.md); count has no measured minimum (it has not learned at any budget).
VARIANT_MIN_STEPS = {"sort": 1000}
LAYOUTS = {"count": dict(prompt_len=48, num_canvases=6),
           "sort": dict(prompt_len=96, num_canvases=2),
           "infill_count": dict(prompt_len=40, num_canvases=1)}


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
  c.loss.update(dict(encoder_weight=1.0, encoder_scope="target", canvas_selection="one"))

  c.optimizer.warmup_steps = 100

  c.data = ml_collections.ConfigDict(dict(
      train="", weights="", eval="", eval_fraction=0.0, tokenizer="bytes",
      **LAYOUTS[variant], overflow="truncate_left", seed=1, num_threads=1, prefetch=4))

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
