"""Does a chat SFT run know where its reply ends? One decoder pass per noise level on the canvas
that holds each reply's end.

  python scripts/chat_stop_diagnostics.py --workdir=runs/chat/count --data=HELDOUT.jsonl \
      [--num=256] [--noise_levels=1.0,0.7,0.5,0.3] [--json=out.json]

For the first --num examples of --data, laid out as training lays them out (scripts/
show_examples.py shows the same), every canvas before the last is clean in the encoder cache and
the last valid canvas (the one holding the end-of-turn marker, then EOS fill) is corrupted at a
fixed noise level t with the training corruption, no self-conditioning. Reported per t:
  * stop_exact: the share of examples whose first predicted stop token (end-of-turn or EOS,
    argmax per position) is at the reference's end-of-turn position;
  * stop_early / stop_late: before it, or after it (including no stop predicted at all);
  * content_accuracy: argmax accuracy on the canvas's reply tokens before the end-of-turn;
  * stop_shown: the share of examples where the corruption left at least one of the canvas's
    stop tokens in place (the position of the end can then be read off the canvas itself).
At t = 1 nothing of the canvas is shown: the end must come from the prompt and the cache. A run
whose stop_exact is high at small t and low at t = 1 reads the end off visible EOS tokens, not
off the request.

The encoder's next-token head (what AR decoding and AR fallback read), teacher-forced over each
clean reply, is reported once:
  * ar_stop_exact: the first reply position whose argmax is a stop token is the reference's end
    (the position whose next token is the end-of-turn): greedy AR decoding would stop there;
  * ar_stop_top: the end is the reply position where the stop probability is highest (the model
    tells the end apart from the rest even when the probability stays below the argmax's);
  * ar_stop_prob_end / ar_stop_prob_rest: the mean stop probability at the end, and at the other
    reply positions before it.
Reads LoRA runs with their adapters merged, as eval.py does.
"""

import json

from absl import flags
import numpy as np

from diffgemma import cli, errors

FLAGS = flags.FLAGS


def define_flags():
  flags.DEFINE_string("workdir", None, "Chat training run directory.")
  flags.DEFINE_string("data", None, "Held-out chat JSONL.")
  flags.DEFINE_integer("num", 256, "Examples (one batch).")
  flags.DEFINE_list("noise_levels", ["1.0", "0.7", "0.5", "0.3"], "Noise levels t.")
  flags.DEFINE_integer("seed", 0, "Noise seed.")
  flags.DEFINE_string("json", None, "Also write the numbers to this JSON file.")


def stop_canvas_batch(task, path: str, num: int):
  """(tokens_NxL, valid_NxL, loss_mask_NxL, stop_canvas_N, end_of_turn_N) for the first `num`
  examples; end_of_turn_N is the end-of-turn's position inside the stop canvas."""
  from diffgemma.tasks import chat_data

  layout = task.layout
  rows = task.describe_file(path, limit=num)
  if not rows:
    raise cli.UserError(f"{path} holds no example")
  seqs, stop_canvas, end_of_turn = [], [], []
  for row in rows:
    seqs.append(chat_data.layout_example(row["prompt_ids"], row["target_ids"], layout,
                                         task.tokenizer.pad_id, task.tokenizer.eos_id))
    target = row["target_ids"]
    stop_canvas.append(row["num_canvases"] - 1)
    first_stop = next(i for i, t in enumerate(target) if t in task.stop_token_ids)
    end_of_turn.append(first_stop - stop_canvas[-1] * layout.canvas_length)
  stack = lambda key: np.stack([s[key] for s in seqs])
  return (stack("tokens"), stack("valid"), stack("loss_mask"), np.asarray(stop_canvas),
          np.asarray(end_of_turn))


def make_probe(model_cfg, layout, stop_ids, noise_schedule: str):
  import jax
  import jax.numpy as jnp

  from diffgemma.model import transformer
  from diffgemma.training import diffusion, losses

  c, p = layout.canvas_length, layout.prompt_len
  encode_len = p + (layout.num_canvases - 1) * c
  stop_ids = jnp.asarray(stop_ids)

  @jax.jit
  def probe(params, tokens_NxL, valid_NxL, mask_NxL, stop_canvas_N, end_N, t, rng):
    n = tokens_NxL.shape[0]
    _, cache = transformer.encode(params, model_cfg, tokens_NxL[:, :encode_len],
                                  transformer.init_cache(model_cfg, n, encode_len),
                                  valid_NxL[:, :encode_len])
    start_N = p + stop_canvas_N * c
    clean_NxC = losses.take_canvas(tokens_NxL, start_N, c)
    mask_NxC = losses.take_canvas(mask_NxL, start_N, c)
    noisy_NxC = diffusion.corrupt(rng, clean_NxC, jnp.full((n,), t), model_cfg.vocab_size,
                                  noise_schedule, mask_NxC)
    logits = transformer.decode(params, model_cfg, noisy_NxC, cache, start_N)
    predicted_NxC = jnp.argmax(logits, -1)
    is_stop = jnp.isin(predicted_NxC, stop_ids)
    first_stop_N = jnp.where(is_stop.any(-1), jnp.argmax(is_stop, -1), c)
    before_end_NxC = jnp.arange(c)[None] < end_N[:, None]
    content_correct = (predicted_NxC == clean_NxC) & before_end_NxC
    shown = (noisy_NxC == clean_NxC) & jnp.isin(clean_NxC, stop_ids) & mask_NxC
    return {
        "stop_exact": jnp.mean(first_stop_N == end_N),
        "stop_early": jnp.mean(first_stop_N < end_N),
        "stop_late": jnp.mean(first_stop_N > end_N),
        "content_accuracy": content_correct.sum() / jnp.maximum(before_end_NxC.sum(), 1),
        "stop_shown": jnp.mean(shown.any(-1)),
    }

  return probe


def make_encoder_probe(model_cfg, layout, stop_ids):
  """The encoder head's stop figures (module docstring) over the clean sequences of a batch."""
  import jax
  import jax.numpy as jnp

  from diffgemma.model import transformer

  p = layout.prompt_len
  length = p + layout.num_canvases * layout.canvas_length
  stop_ids = jnp.asarray(stop_ids)

  @jax.jit
  def probe(params, tokens_NxL, valid_NxL, stop_canvas_N, end_N):
    n = tokens_NxL.shape[0]
    hidden, _ = transformer.encode(params, model_cfg, tokens_NxL,
                                   transformer.init_cache(model_cfg, n, length), valid_NxL)
    log_probs_NxLxV = jax.nn.log_softmax(transformer.lm_head(params, hidden, model_cfg), -1)
    stop_prob_NxL = jnp.exp(jax.nn.logsumexp(log_probs_NxLxV[..., stop_ids], -1))
    argmax_stop_NxL = jnp.isin(jnp.argmax(log_probs_NxLxV, -1), stop_ids)
    # Position q predicts slot q + 1: the reply's first token is predicted at p - 1, and the
    # end-of-turn at slot p + k*C + e is predicted at the end position one before it.
    end_at_N = p - 1 + stop_canvas_N * layout.canvas_length + end_N
    slot_L = jnp.arange(length)
    in_reply_NxL = (slot_L[None] >= p - 1) & (slot_L[None] <= end_at_N[:, None])
    first_stop_N = jnp.argmax(argmax_stop_NxL & in_reply_NxL, -1)
    any_stop_N = (argmax_stop_NxL & in_reply_NxL).any(-1)
    top_N = jnp.argmax(jnp.where(in_reply_NxL, stop_prob_NxL, -1.0), -1)
    at_end_NxL = slot_L[None] == end_at_N[:, None]
    rest_NxL = in_reply_NxL & ~at_end_NxL
    return {
        "ar_stop_exact": jnp.mean(any_stop_N & (first_stop_N == end_at_N)),
        "ar_stop_top": jnp.mean(top_N == end_at_N),
        "ar_stop_prob_end": jnp.sum(stop_prob_NxL * at_end_NxL) / n,
        "ar_stop_prob_rest": jnp.sum(stop_prob_NxL * rest_NxL) / jnp.maximum(rest_NxL.sum(), 1),
    }

  return probe


def diagnose(workdir: str, data: str, num: int, levels, seed: int = 0) -> dict:
  import jax

  from diffgemma.training import loaded

  run = loaded.load_run(workdir)
  if run.task.name != "chat":
    raise cli.UserError(f"{workdir!r} is a {run.task.name!r} run; chat_stop_diagnostics reads "
                        "chat runs")
  batch = stop_canvas_batch(run.task, data, num)
  probe = make_probe(run.model_cfg, run.task.layout, run.task.stop_token_ids,
                     run.run_cfg.loss.noise_schedule)
  out = {"workdir": workdir, "step": run.step, "num_examples": int(batch[0].shape[0]),
         "levels": {}}
  for i, t in enumerate(levels):
    numbers = probe(run.params, *batch, t, jax.random.PRNGKey(seed * 1000 + i))
    out["levels"][str(t)] = {k: float(v) for k, v in numbers.items()}
  tokens, valid, _, stop_canvas, end = batch
  encoder = make_encoder_probe(run.model_cfg, run.task.layout, run.task.stop_token_ids)
  out["encoder"] = {k: float(v) for k, v in encoder(run.params, tokens, valid, stop_canvas,
                                                     end).items()}
  return out


def format_report(result: dict) -> str:
  keys = ("stop_exact", "stop_early", "stop_late", "content_accuracy", "stop_shown")
  lines = [f"{result['workdir']} step {result['step']}, {result['num_examples']} examples: the "
           "canvas holding each reply's end, earlier canvases clean in the cache",
           "| t | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
  for t, numbers in result["levels"].items():
    lines.append(f"| {t} | " + " | ".join(f"{numbers[k]:.3f}" for k in keys) + " |")
  if "encoder" in result:
    lines.append("encoder head, teacher-forced: " + " ".join(
        f"{k}={v:.3f}" for k, v in result["encoder"].items()))
  return "\n".join(lines)


def main(argv):
  del argv
  for name in ("workdir", "data"):
    if not FLAGS[name].value:
      raise cli.UserError(f"--{name} is required")
  try:
    levels = [float(t) for t in FLAGS.noise_levels]
  except ValueError:
    levels = []
  if not levels or any(not 0.0 < t <= 1.0 for t in levels):
    raise cli.UserError(f"--noise_levels must be numbers in (0, 1], got {FLAGS.noise_levels}")
  if FLAGS.num < 1:
    raise cli.UserError(f"--num must be >= 1, got {FLAGS.num}")
  if FLAGS.json:
    errors.check_output_file(FLAGS.json, "json")
  result = diagnose(FLAGS.workdir, FLAGS.data, FLAGS.num, levels, FLAGS.seed)
  print(format_report(result))
  if FLAGS.json:
    with open(errors.prepare_output_file(FLAGS.json, "json"), "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  define_flags()
  cli.run(main)
