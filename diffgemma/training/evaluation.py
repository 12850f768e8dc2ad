"""Held-out evaluation with the production sampler, for any task.

The evaluator generates replies for a task's `Prompts` in fixed-size batches and merges the
task's metrics (`Task.score`, which knows what the tokens mean) with the sampler's statistics
(which it knows without knowing the task): tokens per forward pass, steps per canvas, canvases
per reply, tokens per second, and latency with the first (cold, compiling) call kept apart from
the warm ones (`latency_metrics`).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from diffgemma.model import vision
from diffgemma.model.config import ModelConfig
from diffgemma.sampling import sampler
from diffgemma.tasks.base import Prompts, Task

# The sampler's per-row statistics (`sampler.GenerateOutput` fields, [B] each) that the
# evaluation keeps and means (`row_stats`).
ROW_STATS = ("tokens_per_forward", "steps_per_canvas", "decoder_passes", "num_tokens",
             "num_canvases", "ar_canvases", "ar_passes")


def row_stats(out: sampler.GenerateOutput) -> dict:
  """{name: [B]} of the ROW_STATS that `out`'s mode filled (the None ones skipped)."""
  return {key: getattr(out, key) for key in ROW_STATS if getattr(out, key) is not None}


SAMPLER_PROFILE_KEYS = ("canvases", "accepted", "entropy", "accepted_final")


def sampler_step_sums(trajectory) -> dict[str, np.ndarray]:
  """Per denoising step n, sums over the canvases (every canvas k of every row b) that ran it,
  of a recorded trajectory ({argmax, accepted, entropy: [K, N, B, C], valid [K, N, B]}):
  canvases (how many ran step n), accepted (positions whose draw was kept), entropy (the mean
  tempered entropy over the canvas's positions) and accepted_final (kept positions whose
  argmax already equals the canvas's final argmax, its last step's). Each [N], float64."""
  argmax, accepted, entropy, valid = (np.asarray(trajectory[k]) for k in
                                      ("argmax", "accepted", "entropy", "valid"))
  last_KxB = np.maximum(valid.sum(1) - 1, 0)
  final_KxBxC = np.take_along_axis(argmax, last_KxB[:, None, :, None], axis=1)[:, 0]
  ran_KxNxB = valid.astype(np.float64)
  kept_KxNxBxC = accepted & valid[..., None]
  return {"canvases": ran_KxNxB.sum((0, 2)),
          "accepted": kept_KxNxBxC.sum((0, 2, 3)).astype(np.float64),
          "entropy": (entropy.mean(-1) * ran_KxNxB).sum((0, 2)),
          "accepted_final": (kept_KxNxBxC & (argmax == final_KxBxC[:, None])).sum(
              (0, 2, 3)).astype(np.float64)}


def format_sampler_profile(profile: dict) -> str:
  """A sampler profile (per-canvas means per step) as a table, one line per denoising step."""
  lines = ["step  canvases | accepted  of them final  mean entropy"]
  for n, (canvases, accepted, entropy, final) in enumerate(
      zip(*(profile[key] for key in SAMPLER_PROFILE_KEYS)), start=1):
    lines.append(f"{n:4d}  {int(canvases):8d} | {accepted:8.2f}  {final:13.2f}  {entropy:12.4f}")
  return "\n".join(lines)


def _per_step_means(sums: dict, count_key: str) -> dict:
  """Sums per step -> means per counted item, over the steps any item ran; the count stays."""
  ran = sums[count_key] > 0
  return {key: (value[ran] if key == count_key else value[ran] / sums[count_key][ran]).tolist()
          for key, value in sums.items()}


def prompt_images(prompts: Prompts, rows=None) -> vision.Images | None:
  """The images of rows `rows` of `prompts` (default all; an index array or a slice) as the
  sampler and `transformer.encode` take them (`vision.batch_images`), or None without images."""
  if prompts.pixel_values_NxIxMxD is None:
    return None
  rows = slice(None) if rows is None else rows
  return vision.batch_images(prompts.pixel_values_NxIxMxD[rows],
                             prompts.image_positions_NxIxMx2[rows])


def generate_in_batches(params, generate_fn, prompts: Prompts, batch_size: int, seed: int,
                        progress=None, warmup: bool = False, on_trajectory=None,
                        timing: dict | None = None, length_buckets: bool = True):
  """Run `generate_fn(params, prompt_BxP, valid_BxP, rng) -> sampler.GenerateOutput` over the
  prompts in fixed-size batches (the last one padded by repetition, so one compiled shape serves
  all). Prompts with fixed tokens (infilling: `Prompts.fixed_NxL`, `fixed_mask_NxL`) pass their
  rows' as `generate_fn(..., rng, fixed_BxL, fixed_mask_BxL)`; prompts with images
  (`prompt_images`) pass their rows' as `generate_fn(..., images=...)`.

  Per-batch lengths (`length_buckets`): rows go longest prompt first (ties in their order) and
  each batch's prompts are cut to the smallest of `base.prompt_widths` that holds its longest
  one (`Prompts.bucketed`), dropping left padding only; so at most PROMPT_WIDTH_LEVELS prompt
  shapes compile. The sampler's positions are slot indices and attention sees only relative
  ones, so a cut row's reply is the uncut row's up to float rounding; its random draws are those
  of the batch it lands in (batch b draws with fold_in(key, b * batch_size)). A task whose
  prompts fill P (Sudoku) keeps its order and batches exactly.

  Returns (tokens_NxL, per-row stats {key: [N]} (`row_stats`, plus settle_steps), sampler
  seconds), in the prompts' order. With `warmup`, one untimed call per prompt width compiles
  first. When the sampler records trajectories, each row also gets settle_steps
  (`sampler.settle_steps`, averaged over the canvases it ran), and `on_trajectory(rows, traj)`
  sees each batch's trajectory cut to its real rows (`rows`: their indices in `prompts`).
  `timing`, a dict when given, receives the latency of each call (`latency_metrics` reads it):
  cold_seconds (the calls that compiled: the warmups, else each width's first batch),
  warm_seconds_B [calls] (every other call), warm_tokens [calls] (non-pad tokens of the real
  rows) and warm_canvases [calls] (canvases the call ran: the most any of its rows needed).
  """
  n = len(prompts)
  batch_size = min(batch_size, n)
  rng = jax.random.PRNGKey(seed)
  order = (np.argsort(-prompts.needed_widths(), kind="stable") if length_buckets
           else np.arange(n))
  starts = range(0, n, batch_size)

  def batch_at(start):  # the prompts of order[start:start + batch_size], padded by repetition
    rows = order[start:start + batch_size]
    batch = prompts.take(np.concatenate([rows, np.full(batch_size - len(rows), rows[-1])]))
    return rows, batch.bucketed() if length_buckets else batch

  def call(batch, key):
    fixed = () if batch.fixed_NxL is None else (batch.fixed_NxL, batch.fixed_mask_NxL)
    images = {} if batch.pixel_values_NxIxMxD is None else {"images": prompt_images(batch)}
    return generate_fn(params, batch.prompt_NxP, batch.valid_NxP, key, *fixed, **images)

  cold, warm = [], []  # seconds of the compiling calls; (seconds, tokens, canvases) of the rest
  compiled = set()  # the prompt widths called so far
  if warmup:
    for start in starts:
      _, batch = batch_at(start)
      if batch.prompt_NxP.shape[1] not in compiled:
        t0 = time.perf_counter()
        jax.block_until_ready(call(batch, rng))
        cold.append(time.perf_counter() - t0)
        compiled.add(batch.prompt_NxP.shape[1])
  tokens, stats, seconds = [None] * n, {}, 0.0
  for start in starts:
    rows, batch = batch_at(start)
    real, width = len(rows), batch.prompt_NxP.shape[1]
    t0 = time.perf_counter()
    out = call(batch, jax.random.fold_in(rng, start))
    out = jax.tree_util.tree_map(np.asarray, jax.block_until_ready(out))
    call_s = time.perf_counter() - t0
    seconds += call_s
    if width in compiled:
      warm.append((call_s, int(np.sum(out.num_tokens[:real])), int(np.max(out.num_canvases))))
    else:
      cold.append(call_s)
      compiled.add(width)
    for i, row_tokens in zip(rows, out.tokens[:real]):
      tokens[i] = row_tokens
    row = row_stats(out)
    if out.trajectory is not None:
      settle_KxB = np.asarray(sampler.settle_steps(out.trajectory))
      row["settle_steps"] = settle_KxB.sum(0) / np.maximum((settle_KxB > 0).sum(0), 1)
      if on_trajectory is not None:
        on_trajectory(rows, jax.tree_util.tree_map(lambda x: x[:, :, :real], out.trajectory))
    for key, value in row.items():
      if key not in stats:
        stats[key] = np.zeros(n, np.asarray(value).dtype)
      stats[key][rows] = value[:real]
    if progress is not None:
      progress.update(real)
  if timing is not None:
    timing.update(cold_seconds=float(np.sum(cold)),
                  warm_seconds_B=np.asarray([c[0] for c in warm], np.float64),
                  warm_tokens=np.asarray([c[1] for c in warm], np.int64),
                  warm_canvases=np.asarray([c[2] for c in warm], np.int64))
  return np.stack(tokens), stats, seconds


def latency_metrics(timing: dict, batch_size: int) -> dict:
  """Latency a user can trust, from `generate_in_batches`' timing: the cold calls apart.

  cold_seconds: the calls that compiled (one per prompt width); warm_seconds: the mean of the
  other calls (one reply when batch_size is 1, else a batch of replies decoded together);
  seconds_per_canvas: warm seconds over the canvases those calls ran; tokens_per_second_warm:
  their non-pad tokens over their seconds; warm_calls and latency_batch_size (rows per call).
  Without a warm call (one batch, no warmup) the warm figures are None.
  """
  warm_s = np.asarray(timing["warm_seconds_B"], np.float64)
  total = float(np.sum(warm_s))
  canvases = int(np.sum(timing["warm_canvases"]))
  metrics = {"cold_seconds": float(timing["cold_seconds"]), "warm_calls": int(len(warm_s)),
             "latency_batch_size": int(batch_size), "warm_seconds": None,
             "seconds_per_canvas": None, "tokens_per_second_warm": None}
  if len(warm_s) and total > 0:
    metrics.update(warm_seconds=total / len(warm_s),
                   seconds_per_canvas=total / canvases if canvases else None,
                   tokens_per_second_warm=float(np.sum(timing["warm_tokens"])) / total)
  return metrics


def sampler_metrics(stats: dict, seconds: float) -> dict[str, float]:
  """Means over rows of the sampler's per-row statistics; tokens_per_second counts generated
  (non-pad) tokens over the sampler's wall time. With an AR fallback: ar_fallback_rate (the
  share of canvases decoded left to right) and ar_passes_per_reply (their forwards, already in
  decoder_passes and so in TPF)."""
  metrics = {
      "tokens_per_forward": float(np.mean(stats["tokens_per_forward"])),
      "steps_per_canvas": float(np.mean(stats["steps_per_canvas"])),
      "decoder_passes": float(np.mean(stats["decoder_passes"])),
      "tokens_per_second": float(np.sum(stats["num_tokens"]) / max(seconds, 1e-9)),
  }
  if "num_canvases" in stats:
    metrics["canvases_per_reply"] = float(np.mean(stats["num_canvases"]))
  if "settle_steps" in stats:
    metrics["settle_steps_per_canvas"] = float(np.mean(stats["settle_steps"]))
  if "ar_canvases" in stats:  # sampler.ar_fallback: how often it fired and what it cost
    metrics["ar_fallback_rate"] = float(np.sum(stats["ar_canvases"])
                                        / max(np.sum(stats["num_canvases"]), 1))
    metrics["ar_passes_per_reply"] = float(np.mean(stats["ar_passes"]))
  return metrics


def check_prompts(prompts: Prompts, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig
                  ) -> None:
  """ValueError (one line) when the sampler cannot run these prompts: infill prompts (fixed
  tokens) need diffusion mode and exactly the K*C reply slots they were laid out over."""
  if prompts.fixed_NxL is None:
    return
  if sampler_cfg.mode != sampler.DIFFUSION:
    raise ValueError(f"infill data needs sampler.mode={sampler.DIFFUSION!r}, not "
                     f"{sampler_cfg.mode!r}")
  slots = sampler.num_canvases(model_cfg, sampler_cfg) * model_cfg.canvas_length
  if prompts.fixed_NxL.shape[1] != slots:
    raise ValueError(f"the infill data is laid out over {prompts.fixed_NxL.shape[1]} reply "
                     f"slots but sampler.max_new_tokens={sampler_cfg.max_new_tokens} gives "
                     f"{slots}; keep the run's budget for infill data")


def evaluate(task: Task, params, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig,
             prompts: Prompts, batch_size: int, seed: int = 0, generate_fn=None, progress=None,
             warmup: bool = False, length_buckets: bool = True) -> tuple[dict, list[dict]]:
  """(metrics, predictions) of the model on a held-out set, batched by `generate_in_batches`
  (with per-batch prompt widths unless `length_buckets` is False).

  metrics: the task's (`Task.score`) plus `sampler_metrics`, `latency_metrics` and
  num_examples; a sampler that
  records trajectories adds settle_steps_per_canvas, sampler_profile (per denoising step, any
  task: `sampler_step_sums` as means per canvas that ran the step) and, where the task profiles
  trajectories (`Task.profile_trajectory`), step_profile: per denoising step, the task's sums as
  means per example that ran the step ("rows": how many did). predictions: one record per example.
  """
  check_prompts(prompts, model_cfg, sampler_cfg)
  generate_fn = generate_fn or sampler.make_generate_fn(model_cfg, sampler_cfg)
  profile, sampler_sums = {}, {}

  def on_trajectory(rows, trajectory):
    for into, sums in ((profile, task.profile_trajectory(prompts.take(rows), trajectory)),
                       (sampler_sums, sampler_step_sums(trajectory))):
      for key, value in (sums or {}).items():
        into[key] = into[key] + value if key in into else value

  timing = {}
  tokens, stats, seconds = generate_in_batches(
      params, generate_fn, prompts, batch_size, seed, progress, warmup,
      on_trajectory if sampler_cfg.record_trajectory else None, timing, length_buckets)
  metrics, predictions = task.score(prompts, tokens, stats)
  metrics.update(sampler_metrics(stats, seconds), num_examples=int(len(prompts)))
  metrics.update(latency_metrics(timing, min(batch_size, len(prompts))))
  if profile:
    metrics["step_profile"] = _per_step_means(profile, "rows")
  if sampler_sums:
    metrics["sampler_profile"] = _per_step_means(sampler_sums, "canvases")
  return metrics, predictions
