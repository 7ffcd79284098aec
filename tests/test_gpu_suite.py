"""The GPU suite's CPU rehearsal runs every section end to end and records each one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_suite

ROOT = Path(__file__).resolve().parents[1]


#: The rehearsal compiles a few dozen small programs: about 5 CPU-minutes, so about 5 minutes on
#: two idle cores and far more on a loaded one (16 min at a load of ~20); the default 900 s
#: limit is too tight there.
SMOKE_TIMEOUT_S = 2400
pytestmark = pytest.mark.timeout(SMOKE_TIMEOUT_S)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    """``python -m benchmarks.gpu_suite --cpu-smoke`` in its own process: (report, markdown)."""
    out = tmp_path_factory.mktemp("suite")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--cpu-smoke",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=SMOKE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in gpu_suite.SECTIONS:
        assert f"[gpu_suite] {name}: expected about" in proc.stdout  # each says how long
    return (json.loads((out / "gpu_suite.json").read_text()),
            (out / "gpu_suite.md").read_text())


@pytest.mark.parametrize("name", gpu_suite.SECTIONS)
def test_every_section_ran_and_has_rows_or_a_reason(name: str, smoke: tuple[dict, str]) -> None:
    report, md = smoke
    section = report[name]
    assert section["status"] == "ok", section.get("traceback") or section.get("error")
    assert section["rows"], f"{name} has no rows"
    assert f"## {name}" in md


def test_memory_section_says_what_cpu_cannot_measure(smoke: tuple[dict, str]) -> None:
    memory = smoke[0]["memory"]
    for row in memory["rows"]:
        assert row["planned"] > 0 and row["compiled"] > 0
        assert row["measured"] is None and row["error_pct"] is None  # nothing faked on CPU
    fused = [r for r in memory["rows"] if "fused" in r["case"]]
    assert fused and fused[0]["width"] == 2
    for case in memory["cases"].values():
        assert case.get("skipped") or case["first_oom_batch"] == gpu_suite.NOT_ON_CPU
    assert memory["allowance"]["bytes"] == 0 and not memory["allowance"]["stored"]


def test_equalities_hold_on_cpu(smoke: tuple[dict, str]) -> None:
    report = smoke[0]
    assert report["supernet"]["csp_equals_sequential"]
    assert all(row["same_bytes"] for row in report["determinism"]["rows"])
    assert report["fusion"]["fused_vs_solo_max_rel_loss_diff"] < 1e-3
    offloaded = [r for r in report["supernet"]["rows"] if r["offload"]]
    assert all(r["host_to_device_bytes"] > 0 for r in offloaded)


def test_a_failing_section_is_recorded_and_the_suite_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A section that raises is recorded in its entry; the others still run and are written."""
    def broken(cfg: gpu_suite.SuiteConfig, ctx: gpu_suite.Context) -> dict:
        raise RuntimeError("device lost")

    ran = []

    def fine(cfg: gpu_suite.SuiteConfig, ctx: gpu_suite.Context) -> dict:
        ran.append(True)
        return {"rows": [{"what": "x", "same_bytes": True}], "deterministic_gpu_ops": False}

    monkeypatch.setitem(gpu_suite.RUNNERS, "memory", broken)
    monkeypatch.setitem(gpu_suite.RUNNERS, "determinism", fine)
    report = gpu_suite.run_suite(gpu_suite.CPU_SMOKE, tmp_path, ("memory", "determinism"))
    assert report["memory"]["status"] == "failed" and "device lost" in report["memory"]["error"]
    assert ran and report["determinism"]["status"] == "ok"
    assert report["packing"]["status"] == "not run"
    written = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert set(gpu_suite.SECTIONS) <= set(written)
    assert "failed: RuntimeError: device lost" in (tmp_path / "gpu_suite.md").read_text()
