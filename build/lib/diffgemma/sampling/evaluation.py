"""Held-out evaluation with the production sampler, for any task.

The evaluator generates replies for a task's `Prompts` in fixed-size batches and merges the
task's metrics (`Task.score`, which knows what the tokens mean) with the sampler's statistics
(which it knows without knowing the task): tokens per forward pass, steps per canvas, canvases
per reply, tokens per second.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from diffgemma.model.config import ModelConfig
from diffgemma.sampling import sampler
from diffgemma.tasks.base import Prompts, Task

ROW_STATS = ("tokens_per_forward", "steps_per_canvas", "decoder_passes", "num_tokens",
             "num_canvases", "settle_steps")


def generate_in_batches(params, generate_fn, prompts: Prompts, batch_size: int, seed: int,
                        progress=None, warmup: bool = False, on_trajectory=None):
  """Run `generate_fn(params, prompt_BxP, valid_BxP, rng)` over the prompts in fixed-size
  batches (the last one padded by repetition, so one compiled shape serves all).

  Returns (tokens_NxL, per-row stats {key: [N]}, sampler seconds). With `warmup`, one untimed
  call compiles first. When the sampler records trajectories, each row also gets settle_steps
  (`sampler.settle_steps`, averaged over the canvases it ran), and `on_trajectory(rows, traj)`
  sees each batch's trajectory cut to its real rows (e.g. to accumulate a step profile).
  """
  n = len(prompts)
  batch_size = min(batch_size, n)
  rng = jax.random.PRNGKey(seed)
  if warmup:
    jax.block_until_ready(generate_fn(params, prompts.prompt_NxP[:batch_size],
                                      prompts.valid_NxP[:batch_size], rng))
  tokens, stats, seconds = [], {}, 0.0
  for start in range(0, n, batch_size):
    rows = np.arange(start, min(start + batch_size, n))
    real = len(rows)
    padded = np.concatenate([rows, np.full(batch_size - real, rows[-1])])
    t0 = time.perf_counter()
    out = generate_fn(params, prompts.prompt_NxP[padded], prompts.valid_NxP[padded],
                      jax.random.fold_in(rng, start))
    out = jax.tree_util.tree_map(np.asarray, jax.block_until_ready(out))
    seconds += time.perf_counter() - t0
    tokens.append(out["tokens"][:real])
    if "trajectory" in out:
      settle_KxB = np.asarray(sampler.settle_steps(out["trajectory"]))
      out["settle_steps"] = settle_KxB.sum(0) / np.maximum((settle_KxB > 0).sum(0), 1)
      if on_trajectory is not None:
        on_trajectory(rows, jax.tree_util.tree_map(lambda x: x[:, :, :real],
                                                   out["trajectory"]))
    for key in ROW_STATS:
      if key in out:
        stats.setdefault(key, []).append(out[key][:real])
    if progress is not None:
      progress.update(real)
  stats = {k: np.concatenate(v) for k, v in stats.items()}
  return np.concatenate(tokens), stats, seconds


def sampler_metrics(stats: dict, seconds: float) -> dict[str, float]:
  """Means over rows of the sampler's per-row statistics; tokens_per_second counts generated
  (non-pad) tokens over the sampler's wall time."""
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
  return metrics


def evaluate(task: Task, params, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig,
             prompts: Prompts, batch_size: int, seed: int = 0, generate_fn=None, progress=None,
             warmup: bool = False) -> tuple[dict, list[dict]]:
  """(metrics, predictions) of the model on a held-out set.

  metrics: the task's (`Task.score`) plus `sampler_metrics` and num_examples; a sampler that
  records trajectories adds settle_steps_per_canvas and, where the task profiles trajectories
  (`Task.profile_trajectory`), step_profile: per denoising step, the task's sums as means per
  example that ran the step ("rows": how many did). predictions: one record per example.
  """
  generate_fn = generate_fn or sampler.make_generate_fn(model_cfg, sampler_cfg)
  profile = {}

  def on_trajectory(rows, trajectory):
    sums = task.profile_trajectory(prompts.take(rows), trajectory)
    for key, value in (sums or {}).items():
      profile[key] = profile[key] + value if key in profile else value

  tokens, stats, seconds = generate_in_batches(
      params, generate_fn, prompts, batch_size, seed, progress, warmup,
      on_trajectory if sampler_cfg.record_trajectory else None)
  metrics, predictions = task.score(prompts, tokens, stats)
  metrics.update(sampler_metrics(stats, seconds), num_examples=int(len(prompts)))
  if profile:
    ran = profile["rows"] > 0
    metrics["step_profile"] = {
        key: (value[ran] if key == "rows" else value[ran] / profile["rows"][ran]).tolist()
        for key, value in profile.items()}
  return metrics, predictions
