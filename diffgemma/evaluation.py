"""Sudoku evaluation with the production sampler: accuracy, TPF, steps, speed."""

from __future__ import annotations

import time

import jax
import numpy as np

from diffgemma import data, sampler, sudoku
from diffgemma.config import ModelConfig


def solve_batches(params, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig,
                  puzzles_Nx81, batch_size: int, seed: int, prompt_format: str,
                  generate_fn=None, progress=None, warmup: bool = False):
  """Run the sampler over puzzles in fixed-size batches (the last one padded by repetition, so
  one compiled shape serves all). Returns (grids_Nx81, per-row stats dict, sampler seconds);
  with `warmup`, one untimed call compiles first."""
  generate_fn = generate_fn or sampler.make_generate_fn(model_cfg, sampler_cfg)
  n = len(puzzles_Nx81)
  grids, stats = [], {}
  rng = jax.random.PRNGKey(seed)
  seconds = 0.0
  batch_size = min(batch_size, n)
  if warmup:
    arrays = data.eval_arrays(puzzles_Nx81[:batch_size], prompt_format)
    jax.block_until_ready(generate_fn(params, arrays["prompt"], arrays["valid"], rng))
  for start in range(0, n, batch_size):
    chunk = puzzles_Nx81[start:start + batch_size]
    real = len(chunk)
    if real < batch_size:
      chunk = np.concatenate([chunk, np.repeat(chunk[-1:], batch_size - real, 0)])
    arrays = data.eval_arrays(chunk, prompt_format)
    t0 = time.perf_counter()
    out = generate_fn(params, arrays["prompt"], arrays["valid"], jax.random.fold_in(rng, start))
    out = jax.tree_util.tree_map(np.asarray, jax.block_until_ready(out))
    seconds += time.perf_counter() - t0
    grids.append(data.tokens_to_digits(out["tokens"][:real, :data.CANVAS_LEN]))
    if "trajectory" in out:
      settle_KxB = np.asarray(sampler.settle_steps(out["trajectory"]))
      out["settle_steps"] = settle_KxB.sum(0) / np.maximum((settle_KxB > 0).sum(0), 1)
    for key in ("tokens_per_forward", "steps_per_canvas", "decoder_passes", "num_tokens",
                "settle_steps"):
      if key in out:
        stats.setdefault(key, []).append(out[key][:real])
    if progress is not None:
      progress.update(real)
  return np.concatenate(grids), {k: np.concatenate(v) for k, v in stats.items()}, seconds


def evaluate_sudoku(params, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig,
                    puzzles_Nx81, solutions_Nx81, batch_size: int, prompt_format: str,
                    seed: int = 0, generate_fn=None, progress=None, warmup: bool = False) -> dict:
  """Metrics over a puzzle set. tokens_per_second counts generated tokens over the sampler's
  wall time (the first batch includes compilation unless the function was warmed up). A sampler
  that records trajectories adds settle_steps_per_canvas (`sampler.settle_steps`: the step from
  which the argmax canvas no longer changed)."""
  grids, stats, seconds = solve_batches(params, model_cfg, sampler_cfg, puzzles_Nx81,
                                        batch_size, seed, prompt_format, generate_fn,
                                        progress, warmup)
  solved = sudoku.batch_solved(puzzles_Nx81, grids)
  extra = ({"settle_steps_per_canvas": float(np.mean(stats["settle_steps"]))}
           if "settle_steps" in stats else {})
  return extra | {
      "puzzle_accuracy": float(np.mean(solved)),
      "cell_accuracy": float(sudoku.cell_accuracy(puzzles_Nx81, grids, solutions_Nx81)),
      "tokens_per_forward": float(np.mean(stats["tokens_per_forward"])),
      "steps_per_canvas": float(np.mean(stats["steps_per_canvas"])),
      "decoder_passes": float(np.mean(stats["decoder_passes"])),
      "tokens_per_second": float(np.sum(stats["num_tokens"]) / max(seconds, 1e-9)),
      "num_puzzles": int(len(puzzles_Nx81)),
  }
