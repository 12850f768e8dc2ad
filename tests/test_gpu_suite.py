"""`python benchmarks/gpu_suite.py --smoke --out=DIR` runs every section on the CPU at tiny shapes
and writes its table; generation takes exactly the fixed number of steps per canvas."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_run_writes_every_section(tmp_path):
  proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--smoke", f"--out={tmp_path}"],
                        cwd=ROOT, capture_output=True, text=True, timeout=1200,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  report = json.loads((tmp_path / "gpu_suite.json").read_text())
  rows = report["rows"]
  assert not [r for r in rows if "ms" not in r], [r for r in rows if "ms" not in r]
  assert {r["section"] for r in rows} == {"a", "b", "c", "d"}
  table = (tmp_path / "gpu_suite.md").read_text()
  assert table.startswith("GPU suite, ") and "| section | measurement |" in table
  # (a) both paths of each kernel; (b) prefill, decoder step, sampling and commit, on and off.
  for name in ("attention sliding B=1", "attention full B=1", "MoE expert MLP B=1",
               "prefill 32 tokens B=1", "decoder step B=2", "sampling step B=2",
               "canvas commit B=1"):
    assert {r["kernels"] for r in rows if r["measurement"] == name} == {"on", "off"}, name
  # (c) 32 tokens = 2 canvases of 16 at the fixed 2 steps each, never stopped early.
  generate = next(r for r in rows if r["section"] == "c")
  assert generate["note"].startswith("4 decoder passes (2/canvas), 1 commits"), generate
  # eval.py's latency fields: warm after a cold (compiling) call, 32 tokens over 2 canvases.
  assert generate["warm_seconds"] < generate["cold_seconds"]
  assert generate["seconds_per_canvas"] == generate["warm_seconds"] / 2
  assert generate["tokens_per_second_warm"] == 32 / generate["warm_seconds"]
  assert report["device"]["jax"] and report["device"]["cpu"]
  assert any("QLoRA (int4 base)" in r["measurement"] for r in rows if r["section"] == "d")
