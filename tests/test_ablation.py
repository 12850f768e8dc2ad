"""Ablation tools: sweep.py over real train.py runs, compare_runs.py's table and plot, denoising
traces against the sampler's own step counts, TensorBoard images and text, run provenance."""

import dataclasses
import html.parser
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from diffgemma.io import tb_writer
from diffgemma.runs import provenance
from diffgemma.sampling import traces
from diffgemma.tools import compare
from diffgemma.tasks import sudoku_puzzles
from diffgemma.tasks import sudoku_traces

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# tests/test_training.py's tiny Sudoku model; 2 steps, an eval at the end (2 puzzles, 2 steps).
TINY_CONFIG = '''
from configs import sft_sudoku


def get_config():
  c = sft_sudoku.get_config()
  c.model.update(dict(
      vocab_size=16, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2,
      num_kv_heads=1, head_dim=8, global_head_dim=8, num_global_kv_heads=1, num_experts=4,
      top_k_experts=2, moe_intermediate_size=8, moe_tile_size=8, layer_types=()))
  c.data.prompt_format = "digits"
  c.data.num_threads = 0
  c.batch_size = 4
  c.num_train_steps = 2
  c.log_every = 1
  c.checkpoint_every = 100
  c.optimizer.warmup_steps = 1
  c.eval.update(dict(every_steps=2, num_puzzles=2, batch_size=2))
  c.sampler.max_denoising_steps = 2
  return c
'''
# Grid order: the first two points (run together) differ in learning rate, so they compile the
# two training steps at once; the last two find every program in the compilation cache.
GRID = ("--grid", "data.seed=1,2", "--grid", "optimizer.lr=1e-3,3e-3")
POINTS = ["data.seed=1,optimizer.lr=1e-3", "data.seed=1,optimizer.lr=3e-3",
          "data.seed=2,optimizer.lr=1e-3", "data.seed=2,optimizer.lr=3e-3"]
# Columns of compare_runs' table besides the run name and the differing config keys.
METRIC_COLUMNS = ["puzzle_accuracy final / best", "blank_cell_accuracy final / best",
                  "tokens_per_forward final / best", "steps_per_canvas final / best", "steps",
                  "minutes", "tokens/s"]
PUZZLE = "53..7....6..195....98....6.8...6...34..8.3..17...2...6.6....28....419..5....8..79"


def run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        env=env, timeout=600)


def one_line_error(result, *needles):
  assert result.returncode == 2, (result.stdout, result.stderr)
  lines = [l for l in result.stderr.strip().splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
  for needle in needles:
    assert needle in lines[0], lines[0]


def parse_table(stdout: str):
  """(header, rows) of the markdown table in a tool's output."""
  lines = [l for l in stdout.splitlines() if l.startswith("| ")]
  cells = [[c.strip() for c in l.strip().strip("|").split("|")] for l in lines]
  return cells[0], cells[1:]


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory):
  path = tmp_path_factory.mktemp("config") / "tiny_sudoku.py"
  path.write_text(TINY_CONFIG)
  return str(path)


@pytest.fixture(scope="module")
def sweep(tiny_config, tmp_path_factory):
  """The 2 x 2 sweep, run once; its last point was stopped at step 1 beforehand (as a
  preemption would), so the sweep resumes it."""
  root = tmp_path_factory.mktemp("sweep") / "root"
  partial = run("-c", "import sys; from diffgemma import cli; from diffgemma.training import loop; loop.train(cli."
                "parse_config(sys.argv[1], sys.argv[3:]), sys.argv[2], stop_at=1)", tiny_config,
                str(root / POINTS[3]), "--config.data.seed=2", "--config.optimizer.lr=3e-3")
  assert partial.returncode == 0, partial.stderr
  assert provenance.load_run_info(root / POINTS[3])["invocations"][-1]["stop_reason"] == \
      provenance.STOP_AT
  cores = sorted(os.sched_getaffinity(0))[:2]  # two points side by side, one core each
  args = ("scripts/sweep.py", f"--config={tiny_config}", f"--root={root}", *GRID,
          f"--cores={','.join(map(str, cores))}")
  first = run(*args)
  assert first.returncode == 0, first.stdout + first.stderr
  return args, root, first


def test_sweep_runs_the_grid_once(sweep):
  args, root, first = sweep
  assert "4 points" in first.stdout and "0 finished, 1 to resume, 3 new" in first.stdout
  assert first.stdout.count("started") == 4 and first.stderr == ""
  if len(os.sched_getaffinity(0)) >= 2:
    assert first.stdout.count(" on core ") == 4 and "2 at a time, one core each" in first.stdout
  assert sorted(os.listdir(root)) == sorted(POINTS + ["compare.png"])
  for name in POINTS:
    workdir = root / name
    done = provenance.finished(workdir)
    assert done["end_step"] == 2 and done["stop_reason"] == provenance.NUM_TRAIN_STEPS
    starts = [i["start_step"] for i in provenance.load_run_info(workdir)["invocations"]]
    assert starts == ([0, 1] if name == POINTS[3] else [0])  # the partial point resumed
    config = json.loads((workdir / "config.json").read_text())
    seed, lr = (kv.split("=")[1] for kv in name.split(","))
    assert config["data"]["seed"] == int(seed) and config["optimizer"]["lr"] == float(lr)
    argv = done["argv"]
    assert f"--config.optimizer.lr={lr}" in argv and f"--config.data.seed={seed}" in argv
  events = {n: sorted(os.listdir(root / n / "tensorboard")) for n in POINTS}

  second = run(*args)
  assert second.returncode == 0, second.stderr
  assert "4 finished, 0 to resume, 0 new" in second.stdout and "started" not in second.stdout
  for name in POINTS:  # nothing ran: no new invocation, no new event file
    assert len(provenance.load_run_info(root / name)["invocations"]) == 1 + (name == POINTS[3])
    assert sorted(os.listdir(root / name / "tensorboard")) == events[name]
  header, rows = parse_table(second.stdout)
  assert header == ["run", "data.seed", "optimizer.lr"] + METRIC_COLUMNS
  assert sorted(r[:3] for r in rows) == [[POINTS[0], "1", "0.001"], [POINTS[1], "1", "0.003"],
                                         [POINTS[2], "2", "0.001"], [POINTS[3], "2", "0.003"]]
  # Ranked best first by the headline metric's final value (ties keep the grid order).
  finals = [float(r[header.index(METRIC_COLUMNS[0])].split(" / ")[0]) for r in rows]
  assert finals == sorted(finals, reverse=True)
  tied = [r[0] for r, f in zip(rows, finals) if f == finals[0]]
  assert tied == [p for p in POINTS if p in tied]
  assert all(r[header.index("steps")] == "2" for r in rows)
  assert Image.open(root / "compare.png").size == (2400, 600)


def test_compare_runs_table_and_plot(sweep, tmp_path):
  """Two runs that differ only in learning rate: one key column; the plot has one column per
  metric (loss, puzzle and cell accuracy, TPF, steps per canvas) plus the accuracy-TPF plane,
  each 400 x 300 pixels, over two rows."""
  _, root, _ = sweep
  out = tmp_path / "cmp.png"
  r = run("scripts/compare_runs.py", str(root / POINTS[0]), str(root / POINTS[1]), f"--out={out}")
  assert r.returncode == 0, r.stderr
  header, rows = parse_table(r.stdout)
  assert header == ["run", "optimizer.lr"] + METRIC_COLUMNS
  assert sorted(row[1] for row in rows) == ["0.001", "0.003"]
  assert Image.open(out).size == (6 * 400, 2 * 300)


def test_sample_trace_gif_has_a_frame_per_step(sweep, tmp_path):
  _, root, _ = sweep
  gif = tmp_path / "trace.gif"
  r = run("sample.py", f"--workdir={root / POINTS[1]}", f"--puzzle={PUZZLE}", f"--trace={gif}")
  assert r.returncode == 0, r.stderr
  steps = int(r.stdout.split("final reply after ")[1].split(" denoising steps")[0])
  assert Image.open(gif).n_frames == steps
  assert f"trace: {gif} ({steps} denoising steps)" in r.stdout


def test_bad_input_is_one_line_and_starts_nothing(sweep, tiny_config, tmp_path):
  _, root, _ = sweep
  fresh = tmp_path / "never"
  one_line_error(run("scripts/sweep.py", f"--config={tiny_config}", f"--root={fresh}", "--grid",
                     "optimizer.lrr=1e-3,3e-3"), "unknown config key 'optimizer.lrr'")
  one_line_error(run("scripts/sweep.py", f"--config={tiny_config}", f"--root={fresh}", "--grid",
                     "model.num_layers=2,2.5"), "model.num_layers=2.5", "int")
  assert not fresh.exists()
  not_a_run = tmp_path / "empty"
  not_a_run.mkdir()
  one_line_error(run("scripts/compare_runs.py", str(root / POINTS[0]), str(not_a_run)),
                 str(not_a_run), "not a training run")


@pytest.mark.parametrize("grid, sets, needle", [
    (["optimizer.lr=1e-3,fast"], [], "could not convert string to float: 'fast'"),
    (["sampler.fused_step=true,maybe"], [], "Non-boolean"),
    (["optimizer.lr=1e-3"], ["nope=1"], "unknown config key 'nope'"),
    (["optimizer.lr=1e-3"], ["optimizer.lr=1e-2"], "both --grid and --set"),
    (["optimizer.lr=1e-3,1e-3"], [], "appears twice"),
    (["optimizer.lr"], [], "KEY=VALUES"),
    (["model.vocab_size=8"], [], "vocab_size"),  # parses, but train.py would refuse it
])
def test_sweep_plan_rejects(tiny_config, tmp_path, grid, sets, needle):
  from diffgemma import cli
  from diffgemma.tools import sweep as sweep_lib

  with pytest.raises(cli.UserError) as e:
    sweep_lib.plan(tiny_config, str(tmp_path / "r"), grid, sets)
  assert needle in str(e.value) and "\n" not in str(e.value)
  assert not (tmp_path / "r").exists()


def test_vary_plans_the_recipe_and_each_value_alone(tiny_config, tmp_path):
  """--vary: n listed values give n + 1 points, each differing from the recipe in one key."""
  from diffgemma import cli
  from diffgemma.tools import sweep as sweep_lib

  points = sweep_lib.plan(tiny_config, str(tmp_path / "r"), [], ["batch_size=2"],
                          vary_specs=["optimizer.lr=1e-3,2e-3", "model.num_layers=2"])
  assert [p.name for p in points] == [sweep_lib.RECIPE_POINT, "optimizer.lr=1e-3",
                                      "optimizer.lr=2e-3", "model.num_layers=2"]
  recipe = cli.parse_config(tiny_config, ["--config.batch_size=2"]).to_dict()
  for point in points:
    got = point.config.to_dict()
    assert got["batch_size"] == 2
    changed = {k for k in ("optimizer", "model") if got[k] != recipe[k]}
    assert changed == {k.split(".")[0] for k, _ in point.grid}
  assert points[2].config.optimizer.lr == 2e-3 and points[3].config.model.num_layers == 2
  for grid, sets, needle in [(["optimizer.lr=1e-3"], [], "do not mix"),
                             ([], ["optimizer.lr=1e-2"], "both --vary and --set")]:
    with pytest.raises(cli.UserError, match=needle):
      sweep_lib.plan(tiny_config, str(tmp_path / "r"), grid, sets,
                     vary_specs=["optimizer.lr=1e-3"])


def test_a_job_done_meanwhile_is_skipped(tmp_path):
  """Two sweep processes on one root: a point the other one finished or is training when this
  one's turn comes is skipped, not started a second time."""
  import sys

  from diffgemma.tools import sweep as sweep_lib

  def job(name, skip=None):
    marker = tmp_path / name
    return sweep_lib.Job(name, [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"],
                         str(tmp_path / f"{name}.log"), skip=skip)

  lines = []
  codes = sweep_lib.run_jobs([job("a"), job("b", lambda: "finished by another process"),
                              job("c", lambda: None)], parallel=1, out=lines.append)
  assert codes == {"a": 0, "c": 0}
  assert (tmp_path / "a").exists() and (tmp_path / "c").exists() and not (tmp_path / "b").exists()
  assert "skipped b: finished by another process" in lines
  assert any(line.startswith("[2/2] started c") for line in lines)

  # A job whose lock names another live process is that process's; a stale lock is not.
  other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
  try:
    (tmp_path / "held.lock").write_text(str(other.pid))
    (tmp_path / "stale.lock").write_text("999999999")
    held, stale = job("held"), job("stale")
    held.lock_path, stale.lock_path = str(tmp_path / "held.lock"), str(tmp_path / "stale.lock")
    lines.clear()
    assert sweep_lib.run_jobs([held, stale], parallel=1, out=lines.append) == {"stale": 0}
  finally:
    other.kill()
  assert "skipped held: being run by another sweep process" in lines
  assert (tmp_path / "stale").exists() and not (tmp_path / "stale.lock").exists()


def test_sweep_refuses_a_root_run_with_other_settings(sweep, tiny_config):
  """A --set value that differs from the one a point was trained with is not silently mixed."""
  from diffgemma import cli
  from diffgemma.tools import sweep as sweep_lib

  _, root, _ = sweep
  with pytest.raises(cli.UserError, match="was run with batch_size=4"):
    sweep_lib.plan(tiny_config, str(root), list(GRID[1::2]), ["batch_size=2"])


# ----------------------------------------------------------------------------- traces (in-process)


class _Rows(html.parser.HTMLParser):
  """Counts <tr class="step"> rows and the token spans (and accepted ones) in each."""

  def __init__(self):
    super().__init__()
    self.rows, self.accepted, self.in_row = [], [], False

  def handle_starttag(self, tag, attrs):
    classes = (dict(attrs).get("class") or "").split()
    if tag == "tr" and "step" in classes:
      self.rows.append(0)
      self.accepted.append(0)
      self.in_row = True
    elif tag == "span" and "tok" in classes and self.in_row:
      self.rows[-1] += 1
      self.accepted[-1] += "acc" in classes

  def handle_endtag(self, tag):
    if tag == "tr":
      self.in_row = False


@pytest.fixture(scope="module")
def sampled():
  """A random tiny model's trajectories on 4 puzzles; with no stability requirement and a
  confidence threshold between its rows' entropies, rows stop after different step counts."""
  import jax

  from diffgemma.model import transformer
  from diffgemma.model.config import tiny
  from diffgemma.sampling import sampler
  from diffgemma.tasks import sudoku

  cfg = tiny(vocab_size=16, canvas_length=81, num_layers=2, layer_types=(), sliding_window=256)
  params = transformer.init_params(cfg, jax.random.PRNGKey(0), std=1.0)
  puzzles, solutions = sudoku_puzzles.generate_puzzles(0, 4, 40, 40)
  prompts = sudoku.puzzle_prompts(puzzles, solutions, "digits")
  sampler_cfg = sampler.SamplerConfig(max_denoising_steps=12, max_new_tokens=81,
                                      record_trajectory=True, confidence_threshold=0.2,
                                      stability_threshold=0)
  out = jax.device_get(sampler.make_generate_fn(cfg, sampler_cfg)(
      params, prompts.prompt_NxP, prompts.valid_NxP, jax.random.PRNGKey(1)))
  return out, puzzles, solutions, cfg


def test_sudoku_gif_has_one_frame_per_step(sampled, tmp_path):
  from diffgemma.sampling import sampler

  out, puzzles, solutions, cfg = sampled
  steps_B = out.canvas_steps[:, 0]
  assert len(set(steps_B.tolist())) > 1  # the rows ran different numbers of steps
  for row, steps in enumerate(steps_B):
    path = tmp_path / f"row{row}.gif"
    assert sudoku_traces.sudoku_gif(out.trajectory, puzzles[row], str(path), row,
                             solutions[row]) == steps
    assert Image.open(path).n_frames == steps
    # The last frame shows the canvas the sampler returned (before its EOS handling).
    last = traces.trace_steps(out.trajectory, row, canvases=[0])[-1]
    final, _ = sampler.finalize_canvas(last.tokens_C[None], np.zeros(1, bool), True, cfg)
    np.testing.assert_array_equal(final[0], out.tokens[row, :81])
  row = int(np.argmax(steps_B))
  montage = sudoku_traces.sudoku_montage(out.trajectory, puzzles[row], row, max_frames=8, columns=4,
                                  cell_px=24)
  h, w, _ = sudoku_traces.sudoku_frames(out.trajectory, puzzles[row], row, cell_px=24)[0].shape
  shown = min(8, steps_B[row])
  assert montage.shape == (-(-shown // 4) * h, min(4, shown) * w, 3)


def test_html_trace_has_one_row_per_step(sampled, tmp_path):
  out, puzzles, _, _ = sampled
  trajectory = out.trajectory
  for row in range(len(puzzles)):
    path = tmp_path / f"row{row}.html"
    assert sudoku_traces.write_sudoku_trace(str(path), trajectory, puzzles[row], row) == \
        out.canvas_steps[row, 0]
    parser = _Rows()
    parser.feed(path.read_text(encoding="utf-8"))
    steps = out.canvas_steps[row, 0]
    assert parser.rows == [81] * steps
    valid = trajectory["valid"][0, :, row]
    assert parser.accepted == trajectory["accepted"][0, valid, row, :81].sum(-1).tolist()
  page = path.read_text(encoding="utf-8")
  assert "http" not in page and "<script" not in page and "<link" not in page  # self-contained


def test_text_trace_covers_every_canvas(tmp_path):
  """Two canvases, the second run by row 0 only: row 0 has both canvases' steps in order."""
  valid = np.zeros((2, 3, 2), bool)
  valid[0, :2] = True
  valid[1, :3, 0] = True
  rng = np.random.default_rng(0)
  trajectory = {"argmax": rng.integers(0, 5, (2, 3, 2, 4)), "valid": valid,
                "accepted": rng.random((2, 3, 2, 4)) < 0.5,
                "entropy": rng.random((2, 3, 2, 4)).astype(np.float32)}
  names = ["<a>", " b", "c\n", "&d", "e"]
  path = tmp_path / "t.html"
  assert traces.write_text_trace(str(path), trajectory, lambda t: names[t], row=0) == 5
  parser = _Rows()
  parser.feed(path.read_text(encoding="utf-8"))
  assert parser.rows == [4] * 5
  labels, tokens, _, accepted = traces.text_trace(trajectory, lambda t: names[t], row=1)
  assert labels == ["canvas 1 step 1/2", "canvas 1 step 2/2"]
  assert tokens[1] == [names[t] for t in trajectory["argmax"][0, 1, 1]]
  md = traces.markdown_trace(tokens, accepted, labels)
  assert md.count("\n") == 3 and "&lt;" not in md
  with pytest.raises(ValueError, match=".html"):
    traces.write_text_trace(str(tmp_path / "t.gif"), trajectory, lambda t: names[t])


# ----------------------------------------------------------------------------- TensorBoard, runs


def test_tensorboard_image_and_text_read_back(tmp_path):
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  from tensorboard.util import tensor_util

  rng = np.random.default_rng(0)
  image = rng.integers(0, 256, (30, 20, 3), dtype=np.uint8)
  writer = tb_writer.SummaryWriter(str(tmp_path))
  writer.write(5, {"loss": 1.5})
  writer.write_image(5, "trace/sudoku", image)
  writer.write_text(5, "trace/chat", "| step | tokens |\n|---|---|\n| 1 | **hi** |")
  writer.close()
  acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
  acc.Reload()
  assert acc.Scalars("loss")[0].value == 1.5
  assert acc.SummaryMetadata("trace/sudoku").plugin_data.plugin_name == "images"
  assert acc.SummaryMetadata("trace/chat").plugin_data.plugin_name == "text"
  width, height, png = tensor_util.make_ndarray(acc.Tensors("trace/sudoku")[0].tensor_proto)
  assert (int(width), int(height)) == (20, 30)
  import io

  np.testing.assert_array_equal(np.asarray(Image.open(io.BytesIO(png))), image)
  text = tensor_util.make_ndarray(acc.Tensors("trace/chat")[0].tensor_proto).item()
  assert text.decode().endswith("**hi** |")


def test_periodic_eval_traces_reach_tensorboard(sampled, tmp_path):
  """What the periodic eval writes: a montage image per Sudoku row, a markdown trace of text."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
  from tensorboard.util import tensor_util

  out, puzzles, solutions, _ = sampled
  writer = tb_writer.SummaryWriter(str(tmp_path))
  sudoku_traces.log_sudoku_traces(writer, 3, out.trajectory, puzzles, solutions, rows=(0, 1))
  traces.log_text_traces(writer, 3, out.trajectory, str, rows=(1,), max_steps=4)
  writer.close()
  acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
  acc.Reload()
  width, height, _ = tensor_util.make_ndarray(acc.Tensors("trace/sudoku")[0].tensor_proto)
  montages = [sudoku_traces.sudoku_montage(out.trajectory, puzzles[r], r) for r in (0, 1)]
  assert int(height) == sum(m.shape[0] for m in montages)
  assert int(width) == max(m.shape[1] for m in montages)
  text = tensor_util.make_ndarray(acc.Tensors("trace/text")[0].tensor_proto).item().decode()
  assert text.count("| canvas 1 step") == min(4, out.canvas_steps[1, 0])


def test_compare_plots_each_run_against_its_recorded_headline_metric(tmp_path):
  """The quality axis is the metric the run's task names (run_info.json's headline_metric,
  written by the loop), not a fixed list; a run that recorded none falls back to the old tags."""
  workdir = str(tmp_path / "run")
  provenance.record_start(workdir, 0, headline_metric="exact_match")
  assert provenance.load_run_info(workdir)["headline_metric"] == "exact_match"
  steps = np.arange(3)
  series = lambda: compare.Series(steps, steps * 0.1, steps * 1.0)
  tags = {"loss": series(), "eval/accuracy": series(), "eval/exact_match": series(),
          "eval/tokens_per_forward": series()}
  mine = compare.Run(workdir, {}, tags, 1.0, {}, headline="exact_match")
  assert compare.plotted_metrics([mine]) == (
      ["loss", "eval/exact_match", "eval/accuracy", "eval/tokens_per_forward"],
      "eval/exact_match")
  older = dataclasses.replace(mine, headline=None)
  assert compare.plotted_metrics([older])[1] == "eval/accuracy"


def test_provenance_records_invocations(tmp_path, monkeypatch):
  workdir = str(tmp_path / "run")
  provenance.record_start(workdir, 0, argv=["train.py", "--config=x"])
  assert provenance.finished(workdir) is None
  assert provenance.running(workdir)["argv"] == ["train.py", "--config=x"]  # this process
  provenance.record_end(workdir, 7, provenance.stop_reason(7, 10, timed_out=True))
  assert provenance.finished(workdir)["stop_reason"] == provenance.MAX_TRAIN_MINUTES
  provenance.record_start(workdir, 7)
  provenance.record_end(workdir, 8, provenance.stop_reason(8, 10, timed_out=False))
  info = provenance.load_run_info(workdir)
  assert [i["start_step"] for i in info["invocations"]] == [0, 7]
  assert provenance.finished(workdir) is None  # stopped early: unfinished
  first = info["invocations"][0]
  head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                        text=True)
  if head.returncode == 0:  # this checkout's commit
    assert first["git"]["commit"] == head.stdout.strip()
  assert first["package_version"] == "0.1.0" or first["package_version"] is None
  # Outside a git checkout: no commit, no failure.
  monkeypatch.setattr(provenance, "REPO_ROOT", str(tmp_path))
  assert provenance.git_state() is None
  assert provenance.provenance()["git"] is None
