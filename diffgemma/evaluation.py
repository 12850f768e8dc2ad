"""Sudoku evaluation with the production sampler: accuracy, TPF, steps, speed."""

from __future__ import annotations

import time

import jax
import numpy as np

from diffgemma import data, sampler, sudoku
from diffgemma.config import ModelConfig


STEP_PROFILE_KEYS = ("rows", "blank_accepted", "blank_correct", "blank_accepted_correct",
                     "blank_entropy", "given_entropy")


def step_profile(trajectory, puzzles_Nx81, solutions_Nx81) -> dict:
  """Per denoising step of the first canvas (the Sudoku grid), sums over the rows that ran it:
  rows; blank cells whose draw was accepted, whose argmax is the solution digit, and both; the
  tempered entropy summed over blank cells and over givens (the acceptance spends one entropy
  budget on both). Each value is [N] float64; divide by `rows` for per-puzzle means. Sums, so
  that batches add up. `trajectory`: a recorded one (arrays [K, N, B, C]; entropy included)."""
  valid_NxB = np.asarray(trajectory["valid"][0], bool)
  cells = slice(0, data.CANVAS_LEN)
  argmax_NxBx81 = data.tokens_to_digits(np.asarray(trajectory["argmax"][0, :, :, cells]))
  accepted_NxBx81 = np.asarray(trajectory["accepted"][0, :, :, cells], bool)
  entropy_NxBx81 = np.asarray(trajectory["entropy"][0, :, :, cells], np.float64)
  blank_1xBx81 = (np.asarray(puzzles_Nx81) == 0)[None]
  correct_NxBx81 = argmax_NxBx81 == np.asarray(solutions_Nx81)[None]
  ran_NxBx1 = valid_NxB[:, :, None]

  def total(x_NxBx81):
    return np.sum(np.where(ran_NxBx1, x_NxBx81, 0), axis=(1, 2), dtype=np.float64)

  return {"rows": valid_NxB.sum(1).astype(np.float64),
          "blank_accepted": total(accepted_NxBx81 & blank_1xBx81),
          "blank_correct": total(correct_NxBx81 & blank_1xBx81),
          "blank_accepted_correct": total(accepted_NxBx81 & correct_NxBx81 & blank_1xBx81),
          "blank_entropy": total(np.where(blank_1xBx81, entropy_NxBx81, 0)),
          "given_entropy": total(np.where(blank_1xBx81, 0, entropy_NxBx81))}


def format_step_profile(profile: dict) -> str:
  """`evaluate_sudoku`'s step_profile as a table: one line per denoising step."""
  lines = ["step  puzzles | blank cells: accepted  correct  both  entropy | givens: entropy"]
  for n, (rows, accepted, correct, both, blank_h, given_h) in enumerate(
      zip(*(profile[key] for key in STEP_PROFILE_KEYS)), start=1):
    lines.append(f"{n:4d}  {int(rows):7d} | {accepted:21.1f}  {correct:7.1f}  {both:4.1f}  "
                 f"{blank_h:7.3f} | {given_h:15.4f}")
  return "\n".join(lines)


def solve_batches(params, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig,
                  puzzles_Nx81, batch_size: int, seed: int, prompt_format: str,
                  generate_fn=None, progress=None, warmup: bool = False, solutions_Nx81=None):
  """Run the sampler over puzzles in fixed-size batches (the last one padded by repetition, so
  one compiled shape serves all). Returns (grids_Nx81, per-row stats dict, sampler seconds);
  with `warmup`, one untimed call compiles first. A sampler that records trajectories adds
  per-row settle_steps and, given the solutions, `step_profile`'s sums over all puzzles (stats
  key "step_profile")."""
  generate_fn = generate_fn or sampler.make_generate_fn(model_cfg, sampler_cfg)
  n = len(puzzles_Nx81)
  grids, stats, profile = [], {}, None
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
      if solutions_Nx81 is not None:
        rows = jax.tree_util.tree_map(lambda x: x[:, :, :real], out["trajectory"])
        sums = step_profile(rows, chunk[:real], solutions_Nx81[start:start + real])
        profile = {k: profile[k] + sums[k] for k in sums} if profile else sums
    for key in ("tokens_per_forward", "steps_per_canvas", "decoder_passes", "num_tokens",
                "settle_steps"):
      if key in out:
        stats.setdefault(key, []).append(out[key][:real])
    if progress is not None:
      progress.update(real)
  stats = {k: np.concatenate(v) for k, v in stats.items()}
  if profile is not None:
    stats["step_profile"] = profile
  return np.concatenate(grids), stats, seconds


def evaluate_sudoku(params, model_cfg: ModelConfig, sampler_cfg: sampler.SamplerConfig,
                    puzzles_Nx81, solutions_Nx81, batch_size: int, prompt_format: str,
                    seed: int = 0, generate_fn=None, progress=None, warmup: bool = False) -> dict:
  """Metrics over a puzzle set. tokens_per_second counts generated tokens over the sampler's
  wall time (the first batch includes compilation unless the function was warmed up). A sampler
  that records trajectories adds settle_steps_per_canvas (`sampler.settle_steps`: the step from
  which the argmax canvas no longer changed) and step_profile: for each step that some row ran,
  the `step_profile` quantities as means per puzzle that ran it ("rows": how many did)."""
  grids, stats, seconds = solve_batches(params, model_cfg, sampler_cfg, puzzles_Nx81,
                                        batch_size, seed, prompt_format, generate_fn,
                                        progress, warmup, solutions_Nx81)
  solved = sudoku.batch_solved(puzzles_Nx81, grids)
  extra = {}
  if "settle_steps" in stats:
    extra["settle_steps_per_canvas"] = float(np.mean(stats["settle_steps"]))
  if "step_profile" in stats:
    sums = stats["step_profile"]
    ran = sums["rows"] > 0
    extra["step_profile"] = {
        key: (sums[key][ran] if key == "rows" else sums[key][ran] / sums["rows"][ran]).tolist()
        for key in STEP_PROFILE_KEYS}
  return extra | {
      "puzzle_accuracy": float(np.mean(solved)),
      "cell_accuracy": float(sudoku.cell_accuracy(puzzles_Nx81, grids, solutions_Nx81)),
      "tokens_per_forward": float(np.mean(stats["tokens_per_forward"])),
      "steps_per_canvas": float(np.mean(stats["steps_per_canvas"])),
      "decoder_passes": float(np.mean(stats["decoder_passes"])),
      "tokens_per_second": float(np.sum(stats["num_tokens"]) / max(seconds, 1e-9)),
      "num_puzzles": int(len(puzzles_Nx81)),
  }
