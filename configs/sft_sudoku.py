"""SFT of a small DiffusionGemma on generated Sudoku: the CPU default.

python train.py --config=sft_sudoku --workdir=/tmp/sudoku [--config.optimizer.lr=3e-3 ...]
"""

import ml_collections

from configs import base


def get_config():
  c = base.get_config()
  # 0: the schedule is fitted to max_train_minutes (30) on the machine it runs on.
  c.num_train_steps = 0
  # Fewer fitted steps are warned about at the start: puzzles start to be solved at steps
  # 1000-1500 (benchmarks/RESULTS.md, the sqrt seed sweep).
  c.min_useful_steps = 1500

  # Model: DiffusionGemma architecture at Sudoku size.
  c.model = base.small_model(
      # 832 ids although the "digits" prompt uses 13: noise draws uniform ids, so a corrupted
      # cell almost always holds an id that never appears clean.
      vocab_size=832,
      # theta ~ (9 / 2 pi)**(head_dim / 2): one RoPE frequency turns once per 9 positions, so the
      # cells of a grid column share a phase.
      sliding_rope_theta=314.6, canvas_length=81)

  # Objective: the decoder's denoising loss alone (prompt_len comes from the task).
  # Noise levels t = sqrt(u): more training near pure noise, where the sampler's first steps
  # place most cells (benchmarks/RESULTS.md, 2026-12-06: the seed sweep against "uniform").
  c.loss.t_distribution = "sqrt"

  # Training data: freshly generated puzzles, givens range moving from easy to the target mix.
  c.data = ml_collections.ConfigDict(dict(
      seed=1, start_min_givens=40, start_max_givens=50, min_givens=28, max_givens=46,
      curriculum_steps=1000, num_threads=1, prefetch=4,
      # "digits": a given is the same token as that digit on the canvas, so copying it needs only
      # the canvas -> prompt attention; "cell_tokens" must also learn 729 rare prompt embeddings
      # and its runs sat on the copy plateau for 700-1100+ steps (benchmarks/RESULTS.md).
      prompt_format="digits"))

  c.sampler.max_new_tokens = 81  # one canvas: the 81 cells

  # Periodic evaluation on held-out generated puzzles (seed differs from training data).
  c.eval = ml_collections.ConfigDict(dict(
      every_steps=500, num_puzzles=64, min_givens=38, max_givens=46, seed=12345, batch_size=64,
      trace_examples=2,  # denoising traces of the first examples, drawn in TensorBoard
      # Early warning: the first eval at or after plateau_check_step warns when blank-cell
      # accuracy is not above plateau_blank_accuracy (a run still copying the givens); 0 = off.
      plateau_check_step=500, plateau_blank_accuracy=0.2))
  return c
