"""The numbers we publish, against brute-force counts on hand-made data.

  * `evaluation.generate_in_batches`: fixed-size batches, the last one padded by repetition;
    padded rows are cut back and never reach the per-row statistics, the averages or the
    trajectory callback (a stub `generate_fn`, no model).
  * `evaluation.sampler_metrics` and `evaluation.evaluate`: means recomputed by hand; the
    sampler clock is a fake one, so tokens per second is exact.
  * `SudokuTask.score`: puzzle and cell accuracies of hand-made solved / partly wrong / invalid
    grids, counted cell by cell.
  * `ChatTask.score` with text_metrics: accuracy, answered, stopped, overran and canvases per
    reply of hand-made replies, counted reply by reply.

Tolerances: every value here is a ratio of small integers, so 1e-12 relative (float rounding of
a division) unless stated.
"""

import types

import jax
import numpy as np
import pytest

from configs import sft_sudoku
from diffgemma.sampling import sampler
from diffgemma.training import evaluation
from diffgemma.tasks import make_task
from diffgemma.tasks import sudoku
from diffgemma.tasks.base import Prompts
from tests.helpers import make_config

RTOL = 1e-12

# ----------------------------------------------------------------------------- a stub sampler

P, K, NSTEPS, C = 3, 2, 4, 2  # prompt slots; canvases, denoising steps, canvas length (stub)


def row_stats(row_id: int) -> dict:
  """The per-row statistics the stub sampler reports for a prompt whose first slot is row_id.
  All differ by row, so a padded (repeated) row would shift every mean."""
  return {"tokens_per_forward": 1.5 * row_id, "steps_per_canvas": float(row_id ** 2),
          "decoder_passes": 2 * row_id + 1, "num_tokens": 3 * row_id,
          "num_canvases": row_id % 3 + 1}


def row_trajectory(row_id: int):
  """argmax [K, NSTEPS, C] in {0, 1} and valid [K, NSTEPS] (a prefix per canvas; canvas 1 of
  some rows never runs), a pure function of the row."""
  rng = np.random.default_rng(row_id)
  argmax = rng.integers(0, 2, (K, NSTEPS, C)).astype(np.int32)
  steps = [int(rng.integers(1, NSTEPS + 1)), int(rng.integers(0, NSTEPS + 1))]
  valid = np.arange(NSTEPS)[None, :] < np.array(steps)[:, None]
  return argmax, valid


def brute_settle(argmax_NxC, valid_N) -> int:
  """The first 1-based step s from which every step that ran has the final step's argmax;
  0 if the canvas never ran."""
  ran = [n for n in range(len(valid_N)) if valid_N[n]]
  if not ran:
    return 0
  final = list(argmax_NxC[ran[-1]])
  for s in range(1, len(ran) + 1):
    if all(list(argmax_NxC[n]) == final for n in ran[s - 1:]):
      return s
  raise AssertionError("unreachable")


def brute_settle_mean(row_id: int) -> float:
  """Mean settle step over the canvases the row ran (0 if none)."""
  argmax, valid = row_trajectory(row_id)
  settles = [brute_settle(argmax[k], valid[k]) for k in range(K)]
  ran = [s for s in settles if s > 0]
  return sum(ran) / len(ran) if ran else 0.0


class StubGenerate:
  """generate_fn(params, prompt_BxP, valid_BxP, rng): replies and stats that depend only on
  each row's first prompt slot (its row id); records every call."""

  def __init__(self, trajectory=False, reply=None):
    self.calls = []
    self.trajectory = trajectory
    self.reply = reply  # row_id -> tokens [L]; default: [row_id, 10 * row_id, ...]

  def __call__(self, params, prompt_BxP, valid_BxP, rng):
    prompt_BxP = np.asarray(prompt_BxP)
    self.calls.append((np.array(prompt_BxP), np.array(valid_BxP), np.asarray(
        jax.random.key_data(rng) if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key)
        else rng)))
    ids = [int(r[0]) for r in prompt_BxP]
    if self.reply is None:
      tokens = np.array([[i, 10 * i, 100 * i, 1000 * i] for i in ids], np.int32)
    else:
      tokens = np.stack([self.reply(i) for i in ids]).astype(np.int32)
    trajectory = None
    if self.trajectory:
      trajs = [row_trajectory(i) for i in ids]
      trajectory = {"argmax": np.stack([a for a, _ in trajs], axis=2),  # [K, N, B, C]
                    "valid": np.stack([v for _, v in trajs], axis=2)}  # [K, N, B]
    return sampler.GenerateOutput(
        tokens=tokens, commit_passes=np.zeros(len(ids), np.int32), trajectory=trajectory,
        **{key: np.array([row_stats(i)[key] for i in ids]) for key in row_stats(0)})


def id_prompts(n: int) -> Prompts:
  """n prompts whose first slot is the row id 1..n (0 never appears, so a zero row stands out)."""
  prompt = np.zeros((n, P), np.int32)
  prompt[:, 0] = np.arange(1, n + 1)
  prompt[:, 1] = 7
  return Prompts(prompt, np.ones((n, P), bool), [f"ref{i}" for i in range(n)])


def fake_clock():
  """A clock reading 0, 1, 4, 9, ... (call i reads i**2): batch b (its calls 2b, 2b+1) takes
  4b + 1 fake seconds, so a wrong split of the timing shows."""
  ticks = iter(range(10_000))
  return types.SimpleNamespace(perf_counter=lambda: float(next(ticks) ** 2))


def fake_seconds(num_batches):
  return float(sum(4 * b + 1 for b in range(num_batches)))


def fold_key(seed, start):
  return np.asarray(jax.random.fold_in(jax.random.PRNGKey(seed), start))


# ----------------------------------------------------------------------------- generate_in_batches


@pytest.mark.parametrize("n,batch_size", [(5, 2), (6, 3), (3, 8), (1, 1)])
def test_generate_in_batches_pads_the_last_batch_and_cuts_it_back(n, batch_size):
  """Every call sees `min(batch_size, n)` rows (the last batch padded with its last real row),
  each batch's key is fold_in(PRNGKey(seed), start), and tokens / stats hold exactly the n real
  rows in order: the brute-force per-row values."""
  prompts, stub = id_prompts(n), StubGenerate()
  tokens, stats, seconds = evaluation.generate_in_batches(None, stub, prompts, batch_size,
                                                          seed=11)
  b = min(batch_size, n)
  starts = list(range(0, n, b))
  assert len(stub.calls) == len(starts)
  for (prompt_BxP, valid_BxP, key), start in zip(stub.calls, starts):
    real = list(range(start + 1, min(start + b, n) + 1))
    want = real + [real[-1]] * (b - len(real))  # padding repeats the last real row
    assert prompt_BxP.shape == (b, P) and valid_BxP.shape == (b, P)
    assert [int(x) for x in prompt_BxP[:, 0]] == want, (start, prompt_BxP[:, 0])
    np.testing.assert_array_equal(key, fold_key(11, start))
  ids = list(range(1, n + 1))
  np.testing.assert_array_equal(tokens, [[i, 10 * i, 100 * i, 1000 * i] for i in ids])
  assert sorted(stats) == sorted(row_stats(0))
  for key in row_stats(0):
    assert stats[key].shape == (n,), key
    np.testing.assert_array_equal(stats[key], [row_stats(i)[key] for i in ids], err_msg=key)
  assert seconds >= 0.0


def test_generate_in_batches_warmup_is_one_untimed_extra_call():
  prompts, stub = id_prompts(5), StubGenerate()
  orig = evaluation.time
  evaluation.time = fake_clock()
  try:
    _, _, seconds = evaluation.generate_in_batches(None, stub, prompts, 2, seed=0, warmup=True)
  finally:
    evaluation.time = orig
  assert len(stub.calls) == 1 + 3
  assert [int(x) for x in stub.calls[0][0][:, 0]] == [1, 2]  # warmup: the first batch
  # The warmup reads the clock twice (ticks 0, 1: its cold seconds for `timing`) and is not in
  # `seconds`: batch b reads ticks 2b+2 and 2b+3, so it takes 4b + 5 fake seconds.
  assert seconds == sum(4 * b + 5 for b in range(3))


def test_generate_in_batches_settle_steps_and_trajectory_callback_see_real_rows_only():
  """With trajectories: settle_steps per row = the brute-force mean over the canvases it ran,
  and on_trajectory gets each batch's real rows (and their trajectories) only."""
  n, batch_size = 5, 2
  prompts, stub = id_prompts(n), StubGenerate(trajectory=True)
  seen = []
  _, stats, _ = evaluation.generate_in_batches(
      None, stub, prompts, batch_size, seed=3,
      on_trajectory=lambda rows, traj: seen.append((np.array(rows), traj)))
  want = [brute_settle_mean(i) for i in range(1, n + 1)]
  np.testing.assert_allclose(stats["settle_steps"], want, rtol=RTOL)
  assert [r.tolist() for r, _ in seen] == [[0, 1], [2, 3], [4]]
  for rows, traj in seen:
    assert traj["argmax"].shape == (K, NSTEPS, len(rows), C)
    for j, row in enumerate(rows):
      argmax, valid = row_trajectory(int(row) + 1)
      np.testing.assert_array_equal(np.asarray(traj["argmax"])[:, :, j], argmax)
      np.testing.assert_array_equal(np.asarray(traj["valid"])[:, :, j], valid)


def test_sampler_step_profile_equals_a_loop_over_canvases():
  """evaluation.sampler_step_sums on a random trajectory (rows that stop at different steps)
  against a loop over canvases, steps and positions; the published profile divides by the
  canvases that ran each step."""
  rng = np.random.default_rng(0)
  k, n, b, c = 2, 4, 3, 5
  steps_KxB = np.array([[4, 1, 2], [3, 0, 4]])
  valid = np.arange(n)[None, :, None] < steps_KxB[:, None, :]
  traj = {"argmax": rng.integers(0, 3, (k, n, b, c)), "accepted": rng.random((k, n, b, c)) < 0.5,
          "entropy": rng.random((k, n, b, c)).astype(np.float32), "valid": valid}
  got = evaluation.sampler_step_sums(traj)
  for step in range(n):
    want = dict.fromkeys(evaluation.SAMPLER_PROFILE_KEYS, 0.0)
    for kk in range(k):
      for row in range(b):
        if not valid[kk, step, row]:
          continue
        final = traj["argmax"][kk, steps_KxB[kk, row] - 1, row]
        want["canvases"] += 1
        want["entropy"] += float(np.mean(traj["entropy"][kk, step, row], dtype=np.float64))
        for pos in range(c):
          if traj["accepted"][kk, step, row, pos]:
            want["accepted"] += 1
            want["accepted_final"] += int(traj["argmax"][kk, step, row, pos] == final[pos])
    for key, value in want.items():
      assert got[key][step] == pytest.approx(value, rel=1e-6), (key, step)
  means = evaluation._per_step_means(got, "canvases")
  assert means["canvases"] == [5, 4, 3, 2]
  assert means["accepted"][3] == pytest.approx(got["accepted"][3] / 2)
  assert "step" in evaluation.format_sampler_profile(means).splitlines()[0]


def test_sampler_metrics_equal_brute_force_means():
  ids = [1, 2, 3, 4, 5]
  stats = {key: np.array([row_stats(i)[key] for i in ids]) for key in row_stats(0)}
  stats["settle_steps"] = np.array([brute_settle_mean(i) for i in ids])
  got = evaluation.sampler_metrics(stats, seconds=2.5)
  mean = lambda key: sum(row_stats(i)[key] for i in ids) / len(ids)
  want = {"tokens_per_forward": mean("tokens_per_forward"),
          "steps_per_canvas": mean("steps_per_canvas"), "decoder_passes": mean("decoder_passes"),
          "canvases_per_reply": mean("num_canvases"),
          "tokens_per_second": sum(row_stats(i)["num_tokens"] for i in ids) / 2.5,
          "settle_steps_per_canvas": sum(brute_settle_mean(i) for i in ids) / len(ids)}
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    assert got[key] == pytest.approx(value, rel=RTOL), key
  # Optional keys stay out when the sampler does not report them.
  del stats["num_canvases"], stats["settle_steps"]
  assert sorted(evaluation.sampler_metrics(stats, 1.0)) == [
      "decoder_passes", "steps_per_canvas", "tokens_per_forward", "tokens_per_second"]


# ----------------------------------------------------------------------------- Sudoku scoring

# Wikipedia's example solution; brute-force checks below use sets over 2-D lists.
SOLUTION = np.array([int(c) for c in
                     "534678912672195348198342567859761423426853791713924856961537284"
                     "287419635345286179"], np.int8)


def ref_valid(grid) -> bool:
  g = [[int(grid[9 * r + c]) for c in range(9)] for r in range(9)]
  units = [set(row) for row in g] + [{g[r][c] for r in range(9)} for c in range(9)]
  units += [{g[br + i][bc + j] for i in range(3) for j in range(3)}
            for br in (0, 3, 6) for bc in (0, 3, 6)]
  return all(u == set(range(1, 10)) for u in units)


def ref_solved(puzzle, grid) -> bool:
  return ref_valid(grid) and all(int(grid[i]) == int(puzzle[i]) for i in range(81) if puzzle[i])


def swap_digits(grid, a, b):
  out = grid.copy()
  out[grid == a], out[grid == b] = b, a
  return out


def sudoku_cases():
  """(puzzle, reply grid, tokens_81 or None) per row; a reply given as tokens holds EOS / PAD
  in some cells (they read as blanks)."""
  every_third = np.where(np.arange(81) % 3 == 0, 0, SOLUTION).astype(np.int8)
  swapped = SOLUTION.copy()
  swapped[[0, 3]] = swapped[[3, 0]]  # two blanks of row 1 exchanged: columns break
  relabelled = swap_digits(SOLUTION, 1, 2)  # a valid grid
  no_ones_twos = np.where(np.isin(SOLUTION, [1, 2]), 0, SOLUTION).astype(np.int8)
  wrong_given = SOLUTION.copy()
  wrong_given[1] = 1 if SOLUTION[1] != 1 else 2  # cell 1 is a given of every_third
  stray = sudoku.solution_tokens(SOLUTION).copy()
  stray[[0, 9, 40]] = [sudoku.EOS, sudoku.PAD, sudoku.EOS]  # 0, 9 blank cells
  return [
      ("solved", every_third, SOLUTION),
      ("two blanks swapped", every_third, swapped),
      ("valid grid contradicting givens", every_third, relabelled),
      ("another solution of an ambiguous puzzle", no_ones_twos, relabelled),
      ("a given changed", every_third, wrong_given),
      ("stray EOS and PAD", every_third, stray),
      ("solved, all givens", SOLUTION, SOLUTION),
  ]


def sudoku_task_and_rows(canvas_length=64):
  config = sft_sudoku.get_config()
  config.model.canvas_length = canvas_length  # 82 slots round up to 2 canvases of 64
  config.data.prompt_format = "digits"
  task = sudoku.SudokuTask(config)
  cases = sudoku_cases()
  puzzles = np.stack([p for _, p, _ in cases])
  width = task.layout.response_len
  tokens = np.full((len(cases), width), sudoku.PAD, np.int32)
  grids = []
  for i, (name, _, reply) in enumerate(cases):
    if name == "stray EOS and PAD":
      tokens[i, :81] = reply
      grid = sudoku.tokens_to_digits(reply)
    else:
      tokens[i, :81] = sudoku.solution_tokens(reply)
      grid = reply
    grids.append(np.asarray(grid))
  tokens[:, 81:] = sudoku.DIGIT_OFFSET + 5  # digits after the grid must be ignored
  prompts = sudoku.puzzle_prompts(puzzles, np.tile(SOLUTION, (len(cases), 1)), "digits")
  return task, cases, prompts, tokens, grids


def brute_sudoku_metrics(cases, grids):
  solved = [ref_solved(p, g) for (_, p, _), g in zip(cases, grids)]
  blank_ok = blank = given_ok = given = 0
  for (_, puzzle, _), grid in zip(cases, grids):
    for i in range(81):
      right = int(grid[i]) == int(SOLUTION[i])
      if puzzle[i]:
        given += 1
        given_ok += right
      else:
        blank += 1
        blank_ok += right
  return solved, {"puzzle_accuracy": sum(solved) / len(solved),
                  "cell_accuracy": (blank_ok + given_ok) / (blank + given),
                  "blank_cell_accuracy": blank_ok / blank,
                  "given_cell_accuracy": given_ok / given, "num_puzzles": len(solved)}


def test_sudoku_score_equals_a_brute_force_count():
  task, cases, prompts, tokens, grids = sudoku_task_and_rows()
  assert tokens.shape[1] > 81  # the canvases after the grid exist and are ignored
  solved, want = brute_sudoku_metrics(cases, grids)
  # The rows get some givens wrong, so all cells and blank cells score differently.
  assert want["cell_accuracy"] != pytest.approx(want["blank_cell_accuracy"], rel=1e-3)
  # The hand verdicts, so the brute force itself is checked: solved rows are exactly these.
  assert [name for (name, _, _), s in zip(cases, solved) if s] == [
      "solved", "another solution of an ambiguous puzzle", "solved, all givens"]
  metrics, predictions = task.score(prompts, tokens, {})
  assert sorted(metrics) == sorted(want)
  for key, value in want.items():
    assert metrics[key] == pytest.approx(value, rel=RTOL), (key, metrics[key], value)
  assert [p["solved"] for p in predictions] == solved
  for (_, puzzle, _), grid, p in zip(cases, grids, predictions):
    assert p["puzzle"] == "".join(str(int(d)) if d else "." for d in puzzle)
    assert p["grid"] == "".join(str(int(d)) if d else "." for d in grid)


@pytest.mark.parametrize("row", range(len(sudoku_cases())))
def test_sudoku_score_of_each_row_alone(row):
  """Each case as a one-puzzle batch: accuracies are that row's own counts (a row with no blank
  cells scores blank_cell_accuracy 1 by definition, 'nothing could be wrong')."""
  task, cases, prompts, tokens, grids = sudoku_task_and_rows()
  metrics, _ = task.score(prompts.take(np.array([row])), tokens[row:row + 1], {})
  _, puzzle, _ = cases[row]
  grid, blank = grids[row], puzzle == 0
  right = np.asarray(grid) == SOLUTION
  assert metrics["puzzle_accuracy"] == float(ref_solved(puzzle, grid))
  assert metrics["cell_accuracy"] == pytest.approx(right.sum() / 81, rel=RTOL)
  if blank.any():
    assert metrics["blank_cell_accuracy"] == pytest.approx(right[blank].sum() / blank.sum(),
                                                           rel=RTOL)
  else:
    assert metrics["blank_cell_accuracy"] == 1.0
  assert metrics["given_cell_accuracy"] == pytest.approx(right[~blank].sum() / (~blank).sum(),
                                                         rel=RTOL)


# ----------------------------------------------------------------------------- evaluate


def test_evaluate_merges_task_and_sampler_metrics_over_padded_batches():
  """evaluate() with the Sudoku task, a stub sampler replying each puzzle's hand-made grid, 7
  puzzles in batches of 3 (the last padded by two copies of row 7) and a fake clock: metrics are
  the brute-force task metrics plus the brute-force sampler means; tokens per second is the
  generated tokens over the fake clock's time of 3 batches; the step profile's per-step means
  count real rows only."""
  task, cases, prompts, tokens, grids = sudoku_task_and_rows()
  n = len(cases)
  # The stub reads the row id from the prompt: give each row a distinct first slot by prompt
  # content (the puzzles repeat), through a lookup on the whole prompt row plus its index.
  by_prompt = {}
  rows_prompt = np.array(prompts.prompt_NxP)
  rows_prompt[:, 80] = np.arange(1, n + 1) + sudoku.DIGIT_OFFSET  # the last cell: row tag
  tagged = Prompts(rows_prompt, prompts.valid_NxP, prompts.references)
  for i in range(n):
    by_prompt[i + 1] = tokens[i]

  class Stub(StubGenerate):
    def __call__(self, params, prompt_BxP, valid_BxP, rng):
      ids = np.asarray(prompt_BxP)[:, 80] - sudoku.DIGIT_OFFSET
      shifted = np.array(prompt_BxP)
      shifted[:, 0] = ids  # StubGenerate keys its stats on slot 0
      out = super().__call__(params, shifted, valid_BxP, rng)
      traj = [row_trajectory(int(i)) for i in ids]
      # A Sudoku profile reads canvas 0's argmax / accepted / entropy over 81 cells.
      return out.replace(tokens=np.stack([by_prompt[int(i)] for i in ids]), trajectory={
          "argmax": np.stack([np.broadcast_to(by_prompt[int(i)][None, None, :81],
                                              (1, NSTEPS, 81)) for i in ids], axis=2),
          "valid": np.stack([v[:1] for _, v in traj], axis=2),
          "accepted": np.stack([np.broadcast_to((np.arange(81) % (int(i) + 1) == 0)[None, None],
                                                (1, NSTEPS, 81)) for i in ids], axis=2),
          "entropy": np.stack([np.broadcast_to(np.full((1, NSTEPS, 81), 0.01 * int(i)),
                                               (1, NSTEPS, 81)) for i in ids], axis=2)})

  orig = evaluation.time
  evaluation.time = fake_clock()
  try:
    metrics, predictions = evaluation.evaluate(
        task, None, None, sampler.SamplerConfig(record_trajectory=True), tagged, batch_size=3,
        seed=0, generate_fn=Stub(trajectory=True))
  finally:
    evaluation.time = orig
  # The tag changed cell 81 of the puzzles (a given there now, in the prompt only; the
  # references still hold the untagged puzzles), so the task metrics are the untagged ones.
  _, want = brute_sudoku_metrics(cases, grids)
  ids = list(range(1, n + 1))
  mean = lambda key: sum(row_stats(i)[key] for i in ids) / n
  want.update(tokens_per_forward=mean("tokens_per_forward"),
              steps_per_canvas=mean("steps_per_canvas"), decoder_passes=mean("decoder_passes"),
              canvases_per_reply=mean("num_canvases"),
              tokens_per_second=sum(row_stats(i)["num_tokens"] for i in ids) / fake_seconds(3),
              # The stub's Sudoku trajectory has one canvas whose argmax never changes: every
              # row settles at step 1.
              settle_steps_per_canvas=1.0, num_examples=n)
  # Latency (no warmup): batch 0 (1 fake second) is the cold call; batches 1 and 2 (5 and 9 s)
  # are warm, with the real rows' tokens (rows 4-6, then 7) and each call's most canvases
  # (rows 4-6: 3; row 7: 2).
  warm_tokens = sum(row_stats(i)["num_tokens"] for i in (4, 5, 6, 7))
  want.update(cold_seconds=1.0, warm_calls=2, latency_batch_size=3, warm_seconds=7.0,
              seconds_per_canvas=14.0 / 5, tokens_per_second_warm=warm_tokens / 14.0)
  profile = metrics.pop("step_profile")
  sampler_profile = metrics.pop("sampler_profile")
  assert sorted(metrics) == sorted(want)
  for key, value in want.items():
    assert metrics[key] == pytest.approx(value, rel=RTOL), (key, metrics[key], value)
  assert len(predictions) == n
  # Step profile by brute force: per step, the rows that ran it and their per-row means.
  ran_steps = [s for s in range(NSTEPS) if any(row_trajectory(i)[1][0, s] for i in ids)]
  assert profile["rows"] == [sum(bool(row_trajectory(i)[1][0, s]) for i in ids)
                             for s in ran_steps]
  for j, s in enumerate(ran_steps):
    rows = [i for i in ids if row_trajectory(i)[1][0, s]]
    acc = [sum(1 for c in range(81) if cases[i - 1][1][c] == 0 and c % (i + 1) == 0)
           for i in rows]
    corr = [sum(1 for c in range(81) if cases[i - 1][1][c] == 0
                and int(grids[i - 1][c]) == SOLUTION[c])
            for i in rows]
    blank_h = [0.01 * i * int(np.sum(cases[i - 1][1] == 0)) for i in rows]
    given_h = [0.01 * i * int(np.sum(cases[i - 1][1] != 0)) for i in rows]
    for key, values in (("blank_accepted", acc), ("blank_correct", corr),
                        ("blank_entropy", blank_h), ("given_entropy", given_h)):
      assert profile[key][j] == pytest.approx(sum(values) / len(rows), rel=1e-9), (key, s)
    # The task-agnostic profile: one canvas per row, every cell; its argmax never changes, so
    # every accepted cell is already final.
    kept = [sum(1 for c in range(81) if c % (i + 1) == 0) for i in rows]
    assert sampler_profile["canvases"][j] == len(rows)
    for key, values in (("accepted", kept), ("accepted_final", kept),
                        ("entropy", [0.01 * i for i in rows])):
      assert sampler_profile[key][j] == pytest.approx(sum(values) / len(rows), rel=1e-6), key


# ----------------------------------------------------------------------------- chat scoring

# (reply, stop, reference, correct, answered, overran) by hand; "stop": the reply ends with
# end-of-turn within the budget (else the row is cut with no stop id).
CHAT_CASES = {
    "gsm8k": [
        ("3 + 4 = 7\n#### 7.0", True, "so\n#### 7", True, True, False),
        ("#### 1,234", True, "#### 1234", True, True, False),
        ("the answer is 7", True, "#### 7", False, False, False),
        ("#### 8", True, "7", False, True, False),
        ("#### $12", False, "#### 12", True, True, False),  # right but never stopped
        ("", True, "#### 3", False, False, False),
    ],
    "choice": [
        ("The answer is: Yes.", True, "x. The answer is yes.", True, True, False),
        ("yes", True, "yes", False, False, False),
        ("the answer is maybe", False, "maybe.", True, True, False),
        ("the answer is no", True, "The answer is yes", False, True, False),
    ],
    "exact": [
        (" 1 2 3\n", True, "1 2 3", True, True, False),
        ("1 2 4", True, "1 2 3", False, True, False),
        ("", False, "x", False, True, False),  # an empty reply is an (empty, wrong) answer
        ("1 2 3 4", True, "1 2 3", False, True, True),  # the whole reference, then more
    ],
    "regex": [
        ("blah ANSWER: cat.", True, "ANSWER: cat", True, True, False),
        ("blah ANSWER: dog", True, "cat", False, True, False),
        ("no marker", True, "cat", False, False, False),
    ],
}


def chat_row(task, text, stop):
  tok = task.tokenizer
  ids = tok.encode(text) + ([tok.eot_id] if stop else [])
  row = np.full(task.layout.response_len, tok.pad_id, np.int32)
  row[:len(ids)] = ids
  if stop:  # text after the stop id is not part of the reply
    row[len(ids):len(ids) + 3] = tok.encode("#9!")
  return row


@pytest.mark.parametrize("metric", sorted(CHAT_CASES))
def test_chat_score_equals_a_brute_force_count(metric):
  config = make_config("", prompt_len=32, num_canvases=8)
  config.eval.metric = metric
  config.eval.answer_regex = r"ANSWER: (\w+)" if metric == "regex" else ""
  task = make_task(config, training=False)
  cases = CHAT_CASES[metric]
  n = len(cases)
  prompts = Prompts(np.zeros((n, 32), np.int32), np.ones((n, 32), bool),
                    [reference for _, _, reference, *_ in cases],
                    [{"prompt": f"q{i}"} for i in range(n)])
  tokens = np.stack([chat_row(task, reply, stop) for reply, stop, *_ in cases])
  num_canvases = np.arange(n) % 4 + 1
  metrics, records = task.score(prompts, tokens, {"num_canvases": num_canvases})
  want = {"accuracy": sum(c[3] for c in cases) / n, "answered": sum(c[4] for c in cases) / n,
          "stopped": sum(c[1] for c in cases) / n, "overran": sum(c[5] for c in cases) / n,
          "canvases_per_reply": float(sum(num_canvases)) / n}
  assert sorted(metrics) == sorted(want)
  for key, value in want.items():
    assert metrics[key] == pytest.approx(value, rel=RTOL), (key, metrics[key], value)
  for i, ((reply, _, reference, correct, answered, overran), record) in enumerate(
      zip(cases, records)):
    assert record["reply"] == reply and record["reference"] == reference, i
    assert record["correct"] is correct, (i, reply, record)
    assert (record["answer"] is not None) is answered, (i, reply, record)
    assert record["overran"] is overran, (i, reply, record)
    assert record["prompt"] == f"q{i}"


def test_chat_score_without_num_canvases_reports_no_canvas_mean():
  task = make_task(make_config("", prompt_len=32, num_canvases=8), training=False)
  prompts = Prompts(np.zeros((2, 32), np.int32), np.ones((2, 32), bool), ["a", "b"], None)
  tokens = np.stack([chat_row(task, "a", True), chat_row(task, "c", False)])
  metrics, records = task.score(prompts, tokens, {})
  assert metrics == {"accuracy": 0.5, "answered": 1.0, "stopped": 0.5, "overran": 0.0}
  assert [r["correct"] for r in records] == [True, False]
