"""Sample from a model: a text reply to a prompt, or one Sudoku solved step by step.

Text, from a model checkpoint directory (transformers DiffusionGemma format, or our converter's
output, with the tokenizer files beside the weights), with the report's sampler defaults:

  python sample.py --init_from=/ckpt/diffusiongemma-26b-a4b-it --prompt="Why is the sky blue?"

The prompt is one user turn of the chat template (`--chat=false`: plain text after BOS;
`--thinking`: in the template's thinking mode, and a reply that thinks is printed as its thought,
then its answer); the reply ends at EOS or at the end-of-turn marker. `--image=PATH`
(repeatable) puts image files before the text in that turn, for a checkpoint with a vision
tower (or a training run whose task reads images, e.g. configs/sft_image.py):

  python sample.py --init_from=/ckpt/diffusiongemma-26b-a4b-it --image=cat.png \
      --prompt="What is in the picture?"

Sudoku, from a training run, showing the canvas after every denoising step:

  python sample.py --workdir=/tmp/sudoku --puzzle=53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79

`--trace=FILE.gif` (Sudoku) draws the grid at every step as an animation; `--trace=FILE.html`
(either mode) writes the canvas tokens of every step, shaded by entropy (diffgemma/sampling/traces.py).
Either mode takes --quantize=int8|int4: the weights quantized (weight-only) before sampling,
and `--sampler.KEY=VALUE` for any sampler field (diffgemma.sampling.sampler.SamplerConfig), e.g.
--sampler.entropy_bound=0.3.
"""

import json
import os
import statistics
import sys
import time

from absl import flags

from diffgemma import cli
from diffgemma.runs import distributed

distributed.define_flags()  # --distributed, --coordinator_address, --num_processes, ...
_INIT_FROM = flags.DEFINE_string(
    "init_from", None, "Text mode: model checkpoint directory (transformers DiffusionGemma, or "
    "scripts/convert_checkpoint.py output) holding tokenizer.json or tokenizer.model.")
_PROMPT = flags.DEFINE_string("prompt", None, "Text mode: the prompt.")
_IMAGE = flags.DEFINE_multi_string(
    "image", [], "An image file for the prompt (repeatable; in order, before the text of the "
    "user turn): a checkpoint with a vision tower, or a --workdir run whose task reads images.")
_CHAT = flags.DEFINE_bool("chat", True, "Text mode: wrap the prompt in the chat template "
                          "(one user turn, then the opening of the model turn).")
_THINKING = flags.DEFINE_bool(
    "thinking", False, "Text mode: render the prompt in the chat template's thinking mode "
    "(enable_thinking); the reply's thought is printed apart from the answer after it.")
_MAX_NEW_TOKENS = flags.DEFINE_integer(
    "max_new_tokens", None, "Text mode: token budget (whole canvases are denoised); default: "
    "the sampler's (256).")
_DTYPE = flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"],
                           "Text mode: parameter dtype; default: the checkpoint's.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A training run: its task reads --prompt (a "
                               "chat message; a Sudoku puzzle) and shows every denoising step.")
_PUZZLE = flags.DEFINE_string("puzzle", None, "Sudoku runs: 81 characters, row by row; "
                              "'.' or '0' = blank (the same as --prompt).")
_SEED = flags.DEFINE_integer("seed", 0, "Sampler seed.")
_TRACE = flags.DEFINE_string(
    "trace", None, "Write a denoising trace: FILE.gif (Sudoku: the grid at every step) or "
    "FILE.html (any task: the canvas tokens at every step, shaded by entropy, accepted marked).")
_INFILL_PREFIX = flags.DEFINE_string(
    "infill_prefix", None, "Text mode, infilling: the reply starts with this text (fixed).")
_INFILL_SUFFIX = flags.DEFINE_string(
    "infill_suffix", None, "Text mode, infilling: the text that follows the generated middle "
    "(fixed, never re-noised; docs/design.md, \"Infilling\").")
_INFILL_LENGTH = flags.DEFINE_integer(
    "infill_length", None, "Text mode, infilling: tokens of the middle; default: the rest of "
    "the canvas the prefix ends in, less the suffix and one slot for the end of turn.")
_WARM_RUNS = flags.DEFINE_integer(
    "warm_runs", 1, "After the first (cold, compiling) call, time this many warm calls of the "
    "same reply; the summary gives both (0 = cold only).")
_QUANTIZE = flags.DEFINE_enum("quantize", None, ["int8", "int4"], "Quantize the weights "
                              "(weight-only; diffgemma/model/quantize.py defaults) before sampling.")


def main(argv):
  del argv
  if _INIT_FROM.value is not None and (_WORKDIR.value is not None or _PUZZLE.value is not None):
    raise cli.UserError("choose a checkpoint (--init_from, --prompt) or a training run "
                        "(--workdir, --prompt or --puzzle), not both")
  if _TRACE.value and _INIT_FROM.value is not None:
    from diffgemma.sampling import traces

    try:
      traces.check_trace_path(_TRACE.value)  # text replies: HTML
    except ValueError as e:
      raise cli.UserError(str(e)) from None
  if _THINKING.value and _INIT_FROM.value is None:
    raise cli.UserError("--thinking is for text mode (--init_from); a training run's --workdir "
                        "samples in the run's own data.thinking mode")
  if _WARM_RUNS.value < 0:
    raise cli.UserError(f"--warm_runs must be >= 0 (got {_WARM_RUNS.value})")
  if _IMAGE.value and _PUZZLE.value is not None:
    raise cli.UserError("--image goes with --prompt (an image question), not with --puzzle")
  for path in _IMAGE.value:
    if not os.path.isfile(path):
      raise cli.UserError(f"--image file {path!r} not found")
  distributed.initialize_from_flags()  # every process samples the same; 0 prints and writes
  distributed.check_same_run({}, {"argv": distributed.shared_argv()})
  if _WORKDIR.value is not None:
    sample_run()
  elif _INIT_FROM.value is not None:
    sample_text()
  else:
    raise cli.UserError("give --init_from and --prompt (a checkpoint directory), or --workdir "
                        "and --prompt / --puzzle (a training run)")


# ----------------------------------------------------------------------------- text


def sample_text():
  """Reply to --prompt with the checkpoint in --init_from, through the chat task (its template,
  prompt encoding and stop ids: diffgemma/tasks/chat.py, through the task registry); print the text and a summary."""
  path, text = _INIT_FROM.value, _PROMPT.value
  if not path or text is None:
    raise cli.UserError("text mode needs both --init_from and --prompt")
  if not text.strip():
    raise cli.UserError("--prompt is empty")
  if _MAX_NEW_TOKENS.value is not None and _MAX_NEW_TOKENS.value <= 0:
    raise cli.UserError(f"--max_new_tokens must be positive (got {_MAX_NEW_TOKENS.value})")
  if not os.path.isdir(path):
    raise cli.UserError(f"checkpoint directory {path!r} not found")
  from diffgemma.sampling import sampler
  from diffgemma import tasks

  overrides = _sampler_overrides()
  try:
    defaults = sampler.SamplerConfig().replace(**overrides)
  except ValueError as e:
    raise cli.UserError(f"bad sampler override: {e}") from None
  max_new = _MAX_NEW_TOKENS.value or defaults.max_new_tokens
  # Everything cheap is checked before the weights load (minutes for a large model).
  hf_config = _read_json(os.path.join(path, "config.json"))
  try:
    task = tasks.checkpoint_text_task(path, max_new, text, chat=_CHAT.value,
                                      thinking=_THINKING.value, images=_IMAGE.value)
    prompts = task.prompt_from_text(text, chat=_CHAT.value, images=_IMAGE.value)
  except ValueError as e:  # a tokenizer, checkpoint or image file (errors.InputError), a prompt
    raise cli.UserError(str(e)) from None
  num_prompt = prompts.prompt_NxP.shape[1]
  infill = _infill_slots(task)
  context = _context_length(hf_config)
  if context is not None and num_prompt >= context:
    raise cli.UserError(f"prompt is {num_prompt} tokens, longer than the model's context "
                        f"of {context} tokens")
  slots = task.layout.response_len
  if context is not None and num_prompt + slots > context:
    raise cli.UserError(
        f"prompt of {num_prompt} tokens plus {slots} canvas slots exceeds the model's "
        f"context of {context} tokens; lower --max_new_tokens or shorten the prompt")

  import jax

  from diffgemma.io import model_dirs
  from diffgemma.runs import provenance

  model_cfg, params = model_dirs.load_model(path, dtype=_DTYPE.value)
  params = _maybe_quantize(params)
  if int(prompts.prompt_NxP.max()) >= model_cfg.vocab_size:
    raise cli.UserError(f"the tokenizer in {path} gives id {int(prompts.prompt_NxP.max())}, "
                        f"outside the model's vocabulary of {model_cfg.vocab_size}")
  sampler_cfg = defaults.with_stops(task.stop_token_ids).replace(
      max_new_tokens=max_new, record_trajectory=bool(_TRACE.value))
  stops = sampler.stop_ids(model_cfg, sampler_cfg)

  args = (prompts.prompt_NxP, prompts.valid_NxP, jax.random.PRNGKey(_SEED.value))
  if infill is not None:
    args += tuple(x[None] for x in infill)
  from diffgemma.training import evaluation

  if infill is None:
    args += (None, None)  # no fixed tokens
  args += (evaluation.prompt_images(prompts),)
  if prompts.pixel_values_NxIxMxD is not None:
    from diffgemma.model import vision

    try:  # the placeholders against the images (a checkpoint whose config and tokenizer differ)
      vision.check_image_tokens(prompts.prompt_NxP, args[-1], model_cfg)
    except ValueError as e:
      raise cli.UserError(f"{path}: {e}") from None
  generate = jax.jit(sampler.generate, static_argnums=(1, 2))
  timing = {}
  out = _timed_generate(lambda: generate(params, model_cfg, sampler_cfg, *args),
                        _WARM_RUNS.value, timing)

  tokens = [int(t) for t in out.tokens[0]]
  # Infilling: the reply runs at least through the suffix (a stop id before it is a token).
  fixed_end = int(infill[1].nonzero()[0][-1]) + 1 if infill is not None else 0
  end = next((i for i, t in enumerate(tokens) if t in stops and i >= fixed_end), None)
  if infill is not None:
    print(task.infill_reply_text(out.tokens[0], infill[1]))
  else:
    thought, answer = task.split_reply(out.tokens[0])
    if thought is not None:
      print(f"[thought]\n{thought}\n[answer]")
    print(answer)
  num_tokens, canvases = int(out.num_tokens[0]), int(out.num_canvases[0])
  ended = (f"stopped at {task.tokenizer.decode([tokens[end]], skip_special_tokens=False)!r}"
           if end is not None else "token budget reached")
  print(f"[{num_prompt} prompt tokens, {num_tokens} generated ({ended}); "
        f"TPF {float(out.tokens_per_forward[0]):.2f}; {canvases} canvases, "
        f"{float(out.steps_per_canvas[0]):.1f} steps per canvas; "
        + latency_summary(timing, num_tokens, canvases) + "; "
        + provenance.describe_device(provenance.device_info()) + "]")
  if _TRACE.value and distributed.primary():
    rows = task.write_trace(_TRACE.value, prompts, out.trajectory)
    print(f"trace: {_TRACE.value} ({rows} denoising steps)")


def _infill_slots(task):
  """--infill_prefix / --infill_suffix / --infill_length as (tokens_L, mask_L) over the reply
  slots (the chat task's infill_slots, as its infill data), or None without a suffix."""
  if _INFILL_SUFFIX.value is None:
    if _INFILL_PREFIX.value is not None or _INFILL_LENGTH.value is not None:
      raise cli.UserError("--infill_prefix / --infill_length need --infill_suffix")
    return None
  tok, layout = task.tokenizer, task.layout
  prefix = tok.encode(_INFILL_PREFIX.value) if _INFILL_PREFIX.value else []
  suffix = tok.encode(_INFILL_SUFFIX.value)
  middle = _INFILL_LENGTH.value
  if middle is None:  # the rest of the prefix's canvas, one slot left for the end of turn
    end = -(-max(len(prefix), 1) // layout.canvas_length) * layout.canvas_length
    middle = end - len(prefix) - len(suffix) - 1
    if middle < 1:
      raise cli.UserError(f"the prefix and suffix leave no room for a middle in their canvas of "
                          f"{layout.canvas_length} tokens; give --infill_length")
  try:
    return task.infill_slots(_INFILL_PREFIX.value or "", _INFILL_SUFFIX.value, middle)
  except ValueError as e:
    raise cli.UserError(f"--infill_*: {e}") from None


def _timed_generate(call, warm_runs: int, timing: dict):
  """Run `call()` (a jitted generate) once cold, compile included, then `warm_runs` times warm
  (the same inputs, so the same reply); fill `timing` {cold_seconds, warm_seconds: a list}
  and return the last output on the host."""
  import jax

  start = time.perf_counter()
  out = jax.device_get(call())
  timing["cold_seconds"] = time.perf_counter() - start
  timing["warm_seconds"] = []
  for _ in range(warm_runs):
    start = time.perf_counter()
    out = jax.device_get(call())
    timing["warm_seconds"].append(time.perf_counter() - start)
  return out


def latency_summary(timing: dict, num_tokens: int, num_canvases: int) -> str:
  """cold (compile included) and warm seconds, per-canvas seconds and warm tokens/s (the median
  warm run); "no warm run" when --warm_runs=0."""
  cold = f"cold {timing['cold_seconds']:.2f}s (compile included)"
  if not timing["warm_seconds"]:
    return cold + ", no warm run (--warm_runs=0)"
  warm = statistics.median(timing["warm_seconds"])
  return (f"{cold}, warm {warm:.3f}s, {warm / max(num_canvases, 1):.3f}s per canvas, "
          f"{num_tokens / max(warm, 1e-9):.1f} tokens/s warm")


def _sampler_overrides() -> dict:
  """--sampler.KEY=VALUE, typed by the sampler's fields."""
  from diffgemma.sampling import sampler

  return cli.section_overrides("sampler", sampler.SamplerConfig)


def _maybe_quantize(params):
  """--quantize: the weight-only int8 / int4 base (diffgemma/model/quantize.py defaults)."""
  if not _QUANTIZE.value:
    return params
  from diffgemma.model import quantize

  return quantize.quantize_params(params, quantize.QuantizeConfig(_QUANTIZE.value))


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except ValueError:
    raise cli.UserError(f"{path} is not valid JSON") from None


def _context_length(hf_config: dict) -> int | None:
  """max_position_embeddings of a transformers config.json (text_config or top level)."""
  text = hf_config.get("text_config") or hf_config
  value = text.get("max_position_embeddings")
  return int(value) if value else None


# ----------------------------------------------------------------------------- a training run


def sample_run():
  """Reply to --prompt (Sudoku: --puzzle) with the run in --workdir, through the run's task,
  printing the canvas after every denoising step."""
  text = _PUZZLE.value if _PUZZLE.value is not None else _PROMPT.value
  if not _WORKDIR.value or text is None:
    raise cli.UserError("--workdir and --prompt (or --puzzle) are required")
  import jax
  import numpy as np

  from diffgemma.runs import provenance
  from diffgemma.training import evaluation, loaded
  from diffgemma.sampling import sampler

  run = loaded.open_run(_WORKDIR.value, **{**_sampler_overrides(), "record_trajectory": True})
  if run.untrained_ar_head():
    print(run.untrained_ar_head(), file=sys.stderr)
  if _IMAGE.value and run.task.image_slots is None:
    raise cli.UserError(f"--image: the {run.task.name} run in {_WORKDIR.value} reads no images "
                        "(a chat run with data.max_images > 0 and a vision tower does)")
  # Checked before the weights load.
  prompts = (run.task.prompt_from_text(text, images=_IMAGE.value) if _IMAGE.value
             else run.task.prompt_from_text(text))
  # The run's prompt slots less the left padding this prompt leaves unused (as eval.py's
  # batches: one of four compiled widths).
  prompts = prompts.bucketed()
  if _TRACE.value:
    from diffgemma.sampling import traces

    try:
      traces.check_trace_path(_TRACE.value, run.task.trace_suffixes)
    except ValueError as e:
      raise cli.UserError(str(e)) from None
  run.load()
  run.params = _maybe_quantize(run.params)
  generate_fn = sampler.make_generate_fn(run.model_cfg, run.sampler_cfg)
  timing = {}
  images = ({} if prompts.pixel_values_NxIxMxD is None
            else {"images": evaluation.prompt_images(prompts)})
  out = _timed_generate(lambda: generate_fn(run.params, prompts.prompt_NxP, prompts.valid_NxP,
                                            jax.random.PRNGKey(_SEED.value), **images),
                        _WARM_RUNS.value, timing)
  trajectory = out.trajectory
  print(f"checkpoint step {run.step} ({run.task.name}); prompt:")
  print(run.task.prompt_text(prompts))
  c = run.model_cfg.canvas_length
  num_canvases = int(out.num_canvases[0])
  for k in range(num_canvases):
    num_steps = int(np.sum(trajectory["valid"][k, :, 0]))
    for n in range(num_steps):
      accepted = int(np.sum(trajectory["accepted"][k, n, 0]))
      print(f"\ncanvas {k + 1}, step {n + 1}/{run.sampler_cfg.max_denoising_steps}: {accepted} "
            "positions accepted")
      print(run.task.reply_text(trajectory["argmax"][k, n, 0], prompts, first_slot=k * c))
  print(f"\nfinal reply after {int(out.decoder_passes[0])} denoising steps over "
        f"{num_canvases} canvas(es) (tokens per forward "
        f"{float(out.tokens_per_forward[0]):.2f}; "
        + latency_summary(timing, int(out.num_tokens[0]), num_canvases) + "; "
        + provenance.describe_device(provenance.device_info()) + "):")
  print(run.task.reply_text(out.tokens[0], prompts))
  verdict = run.task.verdict(prompts, out.tokens[0])
  if verdict:
    print(verdict)
  if _TRACE.value and distributed.primary():
    frames = run.task.write_trace(_TRACE.value, prompts, trajectory)
    print(f"trace: {_TRACE.value} ({frames} denoising steps)")


if __name__ == "__main__":
  cli.run(main, sections=("sampler",))
