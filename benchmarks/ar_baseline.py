r"""An independent peer for the chat recipes: a plain byte-level GPT (nanoGPT's shape) in PyTorch,
trained on the same JSONL in the same minutes, answering "what does an ordinary AR model get on
your data in the same budget?".

  python benchmarks/ar_baseline.py --train=runs/chat/count_train.jsonl \
      --test=runs/chat/count_test.jsonl --minutes=25

The caller pins it to one core (`taskset -c N python benchmarks/ar_baseline.py ...`, with
--threads=1, the default) to set it against a diffgemma run of the same minutes on one core.

What it sees is byte-identical to diffgemma's chat task: the byte tokenizer (261 ids) and its
chat template, and the package's own examples (diffgemma/tasks/chat.py, `ChatTask`): one per
assistant turn, the prompt the rendered history plus the generation prompt (BOS included), the
target the turn's stripped content then the end-of-turn marker. The held-out prompts are the
task's `load_eval_file` (the last assistant turn of each conversation is the reference) and the
replies are scored by the task's `score` (text_metrics "exact"), so "accuracy" here means what it
means in eval.py's JSON line.

The model: token and learned position embeddings, pre-LayerNorm blocks of causal multi-head
attention (scaled_dot_product_attention) and a GELU MLP of 4 x width, a final LayerNorm, an
untied head, no dropout. The loss: cross entropy on the reply and its end-of-turn only. AdamW
(0.9, 0.95), linear warmup then cosine to 10% of --lr; the cosine's length is --max_steps, else
estimated from the first 20 steps' speed so that it ends with the minutes. Batches: shuffled
with --seed every epoch, right-padded to the batch's longest sequence.

Evaluation: greedy, batched (64 prompts at a time, left-padded, a KV cache), up to the longest
test reply (with its end-of-turn) + 8 tokens, stopping at end-of-turn or EOS. With
--eval_every_minutes=M the clock stops every M minutes of training to score the first
--curve_examples test conversations (that time does not count against --minutes); the curve
holds those points and one at the end.

The last line printed is one JSON object: accuracy (= exact; headline_metric names it, as in
eval.py), answered, stopped, overran, num_examples, the seen / unseen split (a test prompt is
"seen" when exactly the same user text is a user turn of the training file), train_steps,
examples_seen, train_minutes, steps_per_second, train_cpu_share (CPU seconds per training
second: well under --threads, the core was shared and the speed understated), params, the
curve and the device.
--out=FILE.json writes the same object with every prediction.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from absl import flags
from torch import nn

from diffgemma import cli, errors

FLAGS = flags.FLAGS
ESTIMATE_AFTER_STEPS = 20  # steps timed before the cosine's length is estimated
DECODE_BATCH = 64
DECODE_MARGIN = 8  # tokens past the longest test reply
MIN_LR_FRACTION = 0.1
HUGE = 1 << 30  # a layout no example overflows (only lengths are compared against it)


@dataclasses.dataclass(frozen=True)
class Options:
  """The flags, as `run_benchmark` takes them (tests build one directly)."""

  train: str
  test: str
  minutes: float = 25.0
  max_steps: int = 0
  layers: int = 4
  width: int = 128
  heads: int = 4
  batch_size: int = 32
  lr: float = 3e-3
  warmup: int = 100
  weight_decay: float = 0.1
  seed: int = 0
  threads: int = 1
  limit: int = 0
  eval_every_minutes: float = 0.0
  curve_examples: int = 100
  out: str | None = None
  max_len: int = 0


def define_flags():
  """The flags; their defaults are `Options`' (one place)."""
  d = Options(train="", test="")
  flags.DEFINE_string("train", None, "Training JSONL (diffgemma's chat formats).")
  flags.DEFINE_string("test", None, "Held-out JSONL; the last assistant turn is the reference.")
  flags.DEFINE_float("minutes", d.minutes,
                     "Training wall-clock budget (evaluation not counted).", lower_bound=0.0)
  flags.DEFINE_integer("max_steps", d.max_steps, "Stop after this many steps (0 = when the "
                       "minutes end); also the cosine's length.", lower_bound=0)
  flags.DEFINE_integer("layers", d.layers, "Transformer blocks.", lower_bound=1)
  flags.DEFINE_integer("width", d.width, "Model width.", lower_bound=1)
  flags.DEFINE_integer("heads", d.heads, "Attention heads (must divide --width).", lower_bound=1)
  flags.DEFINE_integer("batch_size", d.batch_size, "Sequences per step.", lower_bound=1)
  flags.DEFINE_float("lr", d.lr, "Peak learning rate.", lower_bound=0.0)
  flags.DEFINE_integer("warmup", d.warmup, "Linear warmup steps.", lower_bound=0)
  flags.DEFINE_float("weight_decay", d.weight_decay,
                     "AdamW weight decay (matrices and embeddings).", lower_bound=0.0)
  flags.DEFINE_integer("seed", d.seed, "Initialization and shuffling seed.")
  flags.DEFINE_integer("threads", d.threads, "torch.set_num_threads.", lower_bound=1)
  flags.DEFINE_integer("limit", d.limit, "Score only the first N test conversations (0 = all).",
                       lower_bound=0)
  flags.DEFINE_float("eval_every_minutes", d.eval_every_minutes, "Curve: evaluate every this "
                     "many training minutes, the clock stopped (0 = only at the end).",
                     lower_bound=0.0)
  flags.DEFINE_integer("curve_examples", d.curve_examples,
                       "Test conversations each curve point scores.", lower_bound=1)
  flags.DEFINE_string("out", None, "Write the final JSON with the curve and every prediction "
                      "to this file.")
  flags.DEFINE_integer("max_len", d.max_len, "Training context in tokens (0 = the longest "
                       "training prompt + reply); longer examples are dropped.", lower_bound=0)


# ----------------------------------------------------------------------------- data


def chat_task(train: str | None, prompt_len: int = HUGE):
  """diffgemma's chat task on the byte tokenizer, metric "exact", every overflow an error:
  with `train`, it reads that file into its training examples; `prompt_len` sizes the
  left-padded held-out prompts of `load_eval_file`."""
  import ml_collections

  from diffgemma.tasks import chat
  from diffgemma.tasks.base import Layout

  config = ml_collections.ConfigDict(dict(
      data=dict(train=train or "", tokenizer="bytes", prompt_len=prompt_len, num_canvases=HUGE,
                overflow="error", num_threads=0),
      eval=dict(metric="exact")))
  settings = chat.settings_from_config(config)
  tok = chat.load_tokenizer(settings, None)
  return chat.ChatTask(settings, tok, Layout(prompt_len, HUGE, 1))


def training_examples(path: str) -> tuple[list[tuple[tuple[int, ...], tuple[int, ...]]], set[str],
                                           object]:
  """([(prompt_ids, target_ids)] of every assistant turn of `path`, exactly as diffgemma's chat
  task makes them; the user texts of the file; the tokenizer)."""
  from diffgemma.tasks import chat_data

  task = chat_task(path)
  count = task.overflow_counts[path].examples
  examples = [(e.prompt_ids, e.target_ids) for e in task.train_examples(0, count)]
  return examples, chat_data.user_texts([path]), task.tokenizer


def held_out(path: str, limit: int):
  """(the chat task whose `score` judges replies, its Prompts of `path`: each conversation's
  last assistant turn, the prompt left-padded to the longest one)."""
  from diffgemma.io import tokenizer as tokenizer_lib
  from diffgemma.tasks import chat_data

  conversations = chat_data.read_jsonl(path)
  if limit:
    conversations = conversations[:limit]
  if any(c.infill is not None for c in conversations):
    raise cli.UserError(f"{path} holds infill records; the AR baseline scores whole replies only")
  tok = tokenizer_lib.load_tokenizer(tokenizer_lib.BYTES)
  longest = 1
  for c in conversations:  # the prompt the task renders for the last assistant turn
    j = max(i for i, m in enumerate(c.messages) if m["role"] == "assistant")
    longest = max(longest, len(tok.render(c.messages[:j], add_generation_prompt=True)))
  task = chat_task(None, longest)
  return task, task.load_eval_file(path, limit or None)


def make_batch(examples, pad_id: int) -> dict[str, np.ndarray]:
  """inputs / labels int64 and loss_mask bool [B, T] of (prompt_ids, target_ids) pairs, T the
  longest sequence less one, right-padded: row b reads seq[:-1] and predicts seq[1:], seq =
  prompt + target; the loss mask holds exactly the labels that are target ids (the reply and
  its end-of-turn); padding and prompt labels are -100."""
  seqs = [list(p) + list(t) for p, t in examples]
  width = max(len(s) for s in seqs) - 1
  inputs = np.full((len(seqs), width), pad_id, np.int64)
  labels = np.full((len(seqs), width), -100, np.int64)
  mask = np.zeros((len(seqs), width), bool)
  for row, ((prompt, _), seq) in enumerate(zip(examples, seqs)):
    n = len(seq) - 1
    inputs[row, :n] = seq[:-1]
    mask[row, len(prompt) - 1:n] = True
    labels[row, :n] = np.where(mask[row, :n], seq[1:], -100)
  return {"inputs": inputs, "labels": labels, "loss_mask": mask}


class BatchStream:
  """Batches of `batch_size` examples: every epoch a fresh seeded permutation, epochs joined
  (so every batch is full)."""

  def __init__(self, examples, batch_size: int, seed: int, pad_id: int):
    self.examples, self.batch_size, self.pad_id = examples, batch_size, pad_id
    self.rng = np.random.default_rng(seed)
    self.order = np.empty(0, np.int64)

  def next(self) -> dict[str, np.ndarray]:
    while len(self.order) < self.batch_size:
      self.order = np.concatenate([self.order, self.rng.permutation(len(self.examples))])
    rows, self.order = self.order[:self.batch_size], self.order[self.batch_size:]
    return make_batch([self.examples[i] for i in rows], self.pad_id)


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
  """Pre-LayerNorm: x + attention(LN(x)), then x + MLP(LN(x))."""

  def __init__(self, width: int, heads: int):
    super().__init__()
    self.heads = heads
    self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
    self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
    self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

  def forward(self, x, mask=None, past=None):
    """`mask` None: causal (training); else a bool [B, 1, Tq, Tk] of allowed keys. `past`: this
    block's cached (k, v) [B, H, Tpast, D/H]. Returns (x, (k, v) with the new positions)."""
    b, t, d = x.shape
    q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
    q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
    if past is not None:
      k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    if mask is None:
      y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
      y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
    x = x + self.out(F.gelu(self.fc(self.ln2(x))))
    return x, (k, v)


class GPT(nn.Module):
  def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int):
    super().__init__()
    if width % heads:
      raise cli.UserError(f"--heads={heads} does not divide --width={width}")
    self.context = context
    self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
    self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
    self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)
    for name, p in self.named_parameters():  # nanoGPT's initialization
      if name.endswith("bias"):
        nn.init.zeros_(p)
      elif p.dim() >= 2:
        scaled = name.endswith(("proj.weight", "out.weight"))
        nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * layers) if scaled else 0.02)

  def forward(self, tokens, positions=None, mask=None, past=None):
    """logits [B, T, V] and the per-block (k, v) cache. Positions default to 0..T-1."""
    if positions is None:
      positions = torch.arange(tokens.shape[1], device=tokens.device)[None]
    x = self.tokens(tokens) + self.positions(positions)
    present = []
    for i, block in enumerate(self.blocks):
      x, kv = block(x, mask, None if past is None else past[i])
      present.append(kv)
    return self.head(self.ln(x)), present


def lr_at(step: int, peak: float, warmup: int, total: int | None) -> float:
  """Linear warmup over `warmup` steps, then cosine from `peak` to 10% of it at `total` (held
  there after; `total` None: not yet estimated, `peak`)."""
  if step < warmup:
    return peak * (step + 1) / warmup
  if total is None:
    return peak
  progress = min(1.0, (step - warmup) / max(1, total - warmup))
  return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_for(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
  decay = [p for p in model.parameters() if p.dim() >= 2]
  rest = [p for p in model.parameters() if p.dim() < 2]
  return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                            {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def loss_of(model: GPT, batch: dict[str, np.ndarray]) -> torch.Tensor:
  """Mean cross entropy over the supervised labels (reply and end-of-turn) of the batch."""
  logits, _ = model(torch.from_numpy(batch["inputs"]))
  return F.cross_entropy(logits.flatten(0, 1), torch.from_numpy(batch["labels"]).flatten(),
                         ignore_index=-100)


# ----------------------------------------------------------------------------- decoding


@torch.no_grad()
def greedy(model: GPT, prompt_NxP: np.ndarray, valid_NxP: np.ndarray, max_new: int,
           stop_ids, pad_id: int, batch_size: int = DECODE_BATCH) -> np.ndarray:
  """Greedy replies [N, max_new] of left-padded prompts: each row's ids up to and including its
  first stop id, then `pad_id`. Positions count from each prompt's first real token (as in
  training); a KV cache holds the prompt and what was generated."""
  model.eval()
  out = np.full((len(prompt_NxP), max_new), pad_id, np.int64)
  stops = torch.tensor(sorted(stop_ids))
  for start in range(0, len(prompt_NxP), batch_size):
    valid = torch.from_numpy(np.asarray(valid_NxP[start:start + batch_size], bool))
    first = int(valid.any(0).int().argmax())  # drop the columns that pad every row
    valid = valid[:, first:]
    tokens = torch.from_numpy(np.asarray(prompt_NxP[start:start + batch_size], np.int64))
    tokens = tokens[:, first:]
    b, t = tokens.shape
    positions = (valid.long().cumsum(1) - 1).clamp(min=0)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    # A padding query sees itself (no row of the mask is empty); real queries never see pads.
    mask = (causal[None] & valid[:, None, :]) | torch.eye(t, dtype=torch.bool)[None]
    logits, past = model(tokens, positions, mask[:, None])
    next_pos = positions[:, -1] + 1  # the last column is a real token of every row
    done = torch.zeros(b, dtype=torch.bool)
    keys = valid
    for i in range(max_new):
      nxt = logits[:, -1].argmax(-1)
      nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
      out[start:start + b, i] = nxt.numpy()
      done |= torch.isin(nxt, stops)
      if bool(done.all()) or i == max_new - 1:
        break
      keys = torch.cat([keys, torch.ones(b, 1, dtype=torch.bool)], dim=1)
      logits, past = model(nxt[:, None], next_pos[:, None], keys[:, None, None, :], past)
      next_pos = next_pos + 1
  return out


def evaluate(model: GPT, task, prompts, max_new: int) -> tuple[dict, list[dict]]:
  """The chat task's metrics and records of greedy replies to `prompts`."""
  tok = task.tokenizer
  replies = greedy(model, prompts.prompt_NxP, prompts.valid_NxP, max_new, task.stop_token_ids,
                   tok.pad_id)
  if replies.shape[1] == task.layout.seq_len:  # `score` would read the row as prompt + reply
    replies = np.concatenate([replies, np.full((len(replies), 1), tok.pad_id)], axis=1)
  return task.score(prompts, replies, {})


# ----------------------------------------------------------------------------- the run


def device_info(threads: int) -> dict:
  from diffgemma.runs import provenance

  affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
  return {"platform": platform.platform(), "processor": provenance.cpu_model(),
          "torch_threads": threads, "torch": torch.__version__, "cpu_affinity": affinity}


def log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def run_benchmark(o: Options) -> dict:
  """Train for `o.minutes` (or `o.max_steps`), evaluate, and return the result (module doc)."""
  if not o.train or not o.test:
    raise cli.UserError("--train and --test are required")
  if o.minutes <= 0 and not o.max_steps:
    raise cli.UserError("give a positive --minutes or --max_steps")
  if o.width % o.heads:
    raise cli.UserError(f"--heads={o.heads} does not divide --width={o.width}")
  examples, user_texts, tok = training_examples(o.train)
  task, prompts = held_out(o.test, o.limit)
  longest = max(len(p) + len(t) for p, t in examples)
  max_len = o.max_len or longest
  kept = [e for e in examples if len(e[0]) + len(e[1]) <= max_len]
  if not kept:
    raise cli.UserError(f"no training example fits --max_len={max_len} tokens")
  if len(kept) < len(examples):
    log(f"dropped {len(examples) - len(kept)} training examples longer than --max_len={max_len}")
  max_new = max(len(task.target_ids(r)) for r in prompts.references) + DECODE_MARGIN
  context = max(max_len, prompts.prompt_NxP.shape[1] + max_new)

  threads_before = torch.get_num_threads()
  torch.set_num_threads(o.threads)
  try:
    with torch.random.fork_rng():
      torch.manual_seed(o.seed)
      model = GPT(tok.vocab_size, context, o.width, o.layers, o.heads)
    params = sum(p.numel() for p in model.parameters())
    log(f"{len(kept)} training examples (longest {longest} tokens), {len(prompts)} test "
        f"conversations, replies up to {max_new} tokens; {params:,} parameters, "
        f"{o.threads} thread(s)")
    optimizer = optimizer_for(model, o.lr, o.weight_decay)
    stream = BatchStream(kept, o.batch_size, o.seed, tok.pad_id)
    curve_prompts = prompts.take(np.arange(min(o.curve_examples, len(prompts))))
    budget = o.minutes * 60.0 if o.minutes > 0 else math.inf
    every = o.eval_every_minutes * 60.0
    next_mark = every if every > 0 else math.inf
    total = o.max_steps or None
    step, train_seconds, train_cpu_seconds, eval_seconds, last_log = 0, 0.0, 0.0, 0.0, 0.0
    curve, losses = [], []

    def curve_point(records) -> dict:
      correct = [r["correct"] for r in records]
      return {"minutes": round(train_seconds / 60, 4), "step": step,
              "examples_seen": step * o.batch_size, "exact": float(np.mean(correct))}

    while (not o.max_steps or step < o.max_steps) and train_seconds < budget:
      if train_seconds >= next_mark:  # the clock stops while the curve point is scored
        t0 = time.perf_counter()
        _, records = evaluate(model, task, curve_prompts, max_new)
        curve.append(curve_point(records))
        eval_seconds += time.perf_counter() - t0
        log(f"curve: {json.dumps(curve[-1])}")
        next_mark += every
      t0, c0 = time.perf_counter(), time.process_time()
      model.train()
      lr = lr_at(step, o.lr, o.warmup, total)
      for group in optimizer.param_groups:
        group["lr"] = lr
      loss = loss_of(model, stream.next())
      optimizer.zero_grad(set_to_none=True)
      loss.backward()
      optimizer.step()
      losses.append(loss.item())
      step += 1
      train_seconds += time.perf_counter() - t0
      train_cpu_seconds += time.process_time() - c0
      if total is None and step == ESTIMATE_AFTER_STEPS:
        total = step + int(step / train_seconds * max(0.0, budget - train_seconds))
        log(f"{step / train_seconds:.1f} steps/s over the first {step} steps: the cosine ends "
            f"at step {total}")
      if train_seconds - last_log >= 30:
        last_log = train_seconds
        log(f"step {step}  loss {np.mean(losses[-50:]):.4f}  lr {lr:.2e}  "
            f"{train_seconds / 60:.2f} min")

    t0 = time.perf_counter()
    metrics, records = evaluate(model, task, prompts, max_new)
    eval_seconds += time.perf_counter() - t0
    if every > 0:
      curve.append(curve_point(records[:len(curve_prompts)]))
  finally:
    torch.set_num_threads(threads_before)

  from diffgemma.tasks import chat_data

  split = chat_data.seen_prompt_split(records, user_texts)
  result = {
      **metrics,
      "exact": metrics["accuracy"],
      "metric": "exact",
      "headline_metric": task.headline_metric,
      "num_examples": len(records),
      **split,
      "train_steps": step,
      "examples_seen": step * o.batch_size,
      "train_minutes": train_seconds / 60,
      "eval_seconds": eval_seconds,
      "steps_per_second": step / train_seconds if train_seconds else 0.0,
      # CPU seconds the process got per training second: well below --threads, the cores
      # were shared with something else and the speed is not this model's.
      "train_cpu_share": train_cpu_seconds / train_seconds if train_seconds else 0.0,
      "cosine_steps": total,
      "final_loss": float(np.mean(losses[-50:])) if losses else None,
      "params": params,
      "num_train_examples": len(kept),
      "max_len": max_len,
      "max_new_tokens": max_new,
      "model": {"layers": o.layers, "width": o.width, "heads": o.heads, "vocab": tok.vocab_size,
                "context": context},
      "optimizer": {"batch_size": o.batch_size, "lr": o.lr, "warmup": o.warmup,
                    "weight_decay": o.weight_decay, "seed": o.seed},
      "data": {"train": os.path.abspath(o.train), "test": os.path.abspath(o.test)},
      "curve": curve,
      "device": device_info(o.threads),
  }
  if o.out:
    with open(errors.prepare_output_file(o.out, "out"), "w", encoding="utf-8") as f:
      json.dump({**result, "predictions": records}, f, indent=1, ensure_ascii=False)
    result["out"] = os.path.abspath(o.out)
  return result


def main(argv):
  if len(argv) > 1:
    raise cli.UserError(f"unexpected arguments: {' '.join(argv[1:])}")
  options = Options(**{f.name: FLAGS[f.name].value for f in dataclasses.fields(Options)})
  print(json.dumps(run_benchmark(options)))


if __name__ == "__main__":
  define_flags()
  cli.run(main)
