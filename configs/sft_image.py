"""SFT of a small DiffusionGemma with a small vision tower, from scratch, on image questions.

  python scripts/make_image_task.py --num=20000 --seed=1 --out=/tmp/shapes/train.jsonl
  python scripts/make_image_task.py --num=500 --seed=2 --out=/tmp/shapes/test.jsonl
  python train.py --config=sft_image --workdir=/tmp/image \
      --config.data.train=/tmp/shapes/train.jsonl --config.data.eval=/tmp/shapes/test.jsonl
  python eval.py --workdir=/tmp/image --data=/tmp/shapes/test.jsonl
  python sample.py --workdir=/tmp/image --image=/tmp/shapes/test_images/000000.png \
      --prompt="How many shapes?"

scripts/make_image_task.py draws 64 px pictures of coloured shapes and asks how many of a kind,
what colour a shape is, or how many shapes there are (docs/images.md: the task, its chance
levels, what 30 CPU minutes give). The tower cuts a picture into 8 px patches and pools 2 x 2 of
them into each of 16 soft tokens, so a 64 px picture goes in unscaled; the byte tokenizer with
Gemma 4's three image tokens ("bytes_image") writes the prompt. The tower trains with the rest
(freeze_vision=False: from scratch, a frozen tower would be random).

The chat task's keys (data.*, eval.*) are documented at `ChatSettings` in
diffgemma/tasks/chat.py, which reads them.
"""

import ml_collections

from configs import base, sft_chat
from diffgemma.io import tokenizer as tokenizer_lib
from diffgemma.model.config import VisionConfig

# The byte tokenizer's 261 ids, then Gemma 4's image tokens: begin of image, the soft-token
# placeholder, end of image.
BOI, IMAGE, EOI = 261, 262, 263
VOCAB = 264
CANVAS = 8  # a reply is a word or a digit and the end of turn: one canvas of 8
SOFT_TOKENS = 16  # a 64 px picture: 8 x 8 patches of 8 px, pooled 2 x 2
# The longest prompt (BOS, the turn markers, the image's 18 tokens, "What colour is the
# triangle?") is 58 tokens.
PROMPT_LEN = 64


def get_config():
  c = sft_chat.get_config()
  c.model = base.small_model(vocab_size=VOCAB, sliding_rope_theta=100.0, canvas_length=CANVAS,
                             boi_token_id=BOI, image_token_id=IMAGE, eoi_token_id=EOI)
  # Every field of the tower is a key (--config.model.vision.KEY=VALUE).
  c.model.vision = base.section(VisionConfig(
      hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=4, head_dim=16, patch_size=8, pooling_kernel_size=2,
      position_embedding_size=16, default_output_length=SOFT_TOKENS))
  c.freeze_vision = False

  # At equal steps (600, 300 held out; RESULTS.md, "Images: the trials behind sft_image"):
  # lr 1e-2 beat 3e-3 and 2e-2, batch 8 beat 16 (and is 1.45 times as many steps a minute), 4
  # text layers beat 2.
  c.batch_size = 8
  c.optimizer.update(dict(lr=1e-2, warmup_steps=20))

  c.data = ml_collections.ConfigDict(dict(
      train="", weights="", eval="", eval_fraction=0.0, tokenizer=tokenizer_lib.BYTES_IMAGE,
      prompt_len=PROMPT_LEN, num_canvases=1, overflow="error", seed=1, num_threads=1,
      prefetch=4, thinking=False, max_images=1, max_soft_tokens=0))
  c.sampler.max_new_tokens = CANVAS
  c.min_useful_steps = 0

  c.eval = ml_collections.ConfigDict(dict(
      every_steps=500, num_examples=200, batch_size=50, metric="exact", answer_regex="",
      seed=12345, trace_examples=2, stop_check_step=0, stop_overrun_warning=1.0))
  return c
