"""scripts/plot_fronts.py: several checkpoints' eval.py scans on one accuracy-TPF chart."""

import json

from tests.helpers import one_line_error, run


def _scan(path, metric, points):
  path.mkdir()
  with open(path / "scan.json", "w", encoding="utf-8") as f:
    json.dump({"headline_metric": metric, "points": [
        {"key": "sampler.entropy_bound", "value": v,
         "metrics": {metric: acc, "tokens_per_forward": tpf, "steps_per_canvas": steps}}
        for v, acc, tpf, steps in points]}, f)
  return path


def test_fronts_table_and_chart(tmp_path):
  sft = _scan(tmp_path / "sft", "accuracy", [(0.1, 0.55, 4.4, 7.3), (0.4, 0.41, 6.2, 5.0)])
  rl = _scan(tmp_path / "rl", "accuracy", [(0.1, 0.61, 5.0, 6.1)])
  out = tmp_path / "front.png"
  r = run("scripts/plot_fronts.py", f"--out={out}", f"SFT={sft}", f"SD·RL={rl / 'scan.json'}")
  assert r.returncode == 0, r.stderr
  cells = [[c.strip() for c in l.split("|")[1:-1]] for l in r.stdout.splitlines()
           if l.startswith("|")]
  assert cells[0][:5] == ["checkpoint", "sampler key", "value", "accuracy", "tokens_per_forward"]
  rows = [row for row in cells if row[0] in ("SFT", "SD·RL")]
  assert [row[:5] for row in rows] == [
      ["SFT", "sampler.entropy_bound", "0.1", "0.550", "4.400"],
      ["SFT", "sampler.entropy_bound", "0.4", "0.410", "6.200"],
      ["SD·RL", "sampler.entropy_bound", "0.1", "0.610", "5.000"]]
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_one_line_errors(tmp_path):
  sudoku = _scan(tmp_path / "sudoku", "puzzle_accuracy", [(0.1, 0.7, 15.0, 9.5)])
  chat = _scan(tmp_path / "chat", "accuracy", [(0.1, 0.55, 4.4, 7.3)])
  one_line_error(run("scripts/plot_fronts.py", f"A={sudoku}", f"B={chat}"), "different metrics")
  one_line_error(run("scripts/plot_fronts.py", f"A={tmp_path / 'none'}"), "no scan.json")
  one_line_error(run("scripts/plot_fronts.py", str(chat)), "LABEL=DIR")
  one_line_error(run("scripts/plot_fronts.py", "--out=x.jpg", f"A={chat}"), "PNG")
