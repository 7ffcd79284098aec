"""The examples run unchanged from the checkout, and Optuna's dashboard shows the guide's study.

``examples/digits.py`` is started as a user would start it (a fresh process, its own device
set-up), with fewer trials and steps; then ``optuna-dashboard`` serves the study database on
127.0.0.1 and its JSON API is read back over HTTP.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _requirements import require_module

ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the example sets up its own devices
    return env


@pytest.fixture(scope="module")
def digits_study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A finished study of the digits example: its directory and its printed output."""
    require_module("sklearn", "scikit-learn (the `examples` extra) is not installed")
    study_dir = tmp_path_factory.mktemp("digits")
    proc = subprocess.run(
        [sys.executable, "examples/digits.py", "--trials", "2", "--steps", "20",
         "--study-dir", str(study_dir)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return study_dir, proc.stdout


def test_digits_example_runs_a_study_and_reports_the_best_trial(digits_study):
    study_dir, out = digits_study
    results = json.loads((study_dir / "results.json").read_text())
    assert [row["state"] for row in results["trials"]] == ["complete", "complete"]
    best = next(r for r in results["trials"] if r["number"] == results["best"])
    assert f"best: trial {best['number']} " in out
    assert best["accuracy"] > 0.2  # ten classes: chance is 0.1
    # the best model is tested on digits that neither trained a trial nor chose the best
    test = results["test"]
    assert test["trial"] == best["number"] and 0.2 < test["accuracy"] <= 1
    assert (f"accuracy {best['accuracy']:.3f}, test accuracy {test['accuracy']:.3f}"
            in out.splitlines()[-1])
    saved = json.loads((study_dir / "best_model" / "trial.json").read_text())
    assert saved["number"] == best["number"] and saved["test"] == {"accuracy": test["accuracy"]}


def test_digits_example_says_a_study_of_other_steps_in_its_own_flags(digits_study):
    """A rerun with other ``--steps`` is refused in the script's flags (``--steps``,
    ``--study-name``), where it said ``study_name='digits-mlp-2'``, the library's keyword."""
    study_dir, _ = digits_study
    proc = subprocess.run(
        [sys.executable, "examples/digits.py", "--trials", "2", "--steps", "21",
         "--study-dir", str(study_dir)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.strip() == (
        "error: study 'digits-mlp' was created with --steps 20, this run asks for --steps 21; "
        "rerun with --steps 20, or pass --study-name digits-mlp-2 to start a new study")


def test_plan_and_train_example_trains_with_its_plan():
    """``examples/plan_and_train.py``: a user's own model planned, then trained in the user's
    loop on the plan's devices with its shardings; the loss falls."""
    proc = subprocess.run([sys.executable, "examples/plan_and_train.py", "--steps", "20"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mesh (data x model)" in proc.stdout and proc.stderr == ""
    last = proc.stdout.strip().splitlines()[-1]
    first, final = (float(x) for x in last.split("loss ")[1].split(" in ")[0].split(" -> "))
    assert final < 0.5 * first, last


@pytest.mark.parametrize("argv, said", [
    (["examples/plan_and_train.py", "--steps", "0"], "argument --steps: 0 must be at least 1"),
    (["examples/plan_and_train.py", "--width", "-3"], "argument --width: -3 must be at least 1"),
    (["examples/plan_and_train.py", "--memory-per-device", "10KiB"],
     "here: raise --memory-per-device or lower --width"),
    (["examples/digits.py", "--trials", "0"], "error: --trials 0: pass 1 or more"),
])
def test_an_examples_bad_flag_ends_in_one_line_naming_it(argv, said):
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and said in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get_json(url: str, deadline: float, proc: subprocess.Popen) -> dict:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, ConnectionError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_optuna_dashboard_shows_the_study_and_the_placement_of_each_trial(digits_study):
    require_module("optuna_dashboard", "optuna-dashboard (the `dashboard` extra) is not "
                   "installed")
    study_dir, _ = digits_study
    port = _free_port()
    dashboard = Path(sys.executable).with_name("optuna-dashboard")
    proc = subprocess.Popen(
        [str(dashboard), f"sqlite:///{study_dir / 'study.db'}", "--host", "127.0.0.1",
         "--port", str(port), "--quiet"],
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        summaries = _get_json(f"{base}/api/studies", time.monotonic() + 60, proc)
        [study] = summaries["study_summaries"]
        assert study["study_name"] == "digits-mlp"
        detail = _get_json(f"{base}/api/studies/{study['study_id']}", time.monotonic() + 30,
                           proc)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
    assert [t["state"] for t in detail["trials"]] == ["Complete", "Complete"]
    results = json.loads((study_dir / "results.json").read_text())["trials"]
    for trial, row in zip(detail["trials"], results, strict=True):
        attrs = {a["key"]: a["value"] for a in trial["user_attrs"]}
        assert json.loads(attrs["devices"]) == row["devices"]
        assert int(attrs["batch_size"]) == row["batch_size"]
        assert int(attrs["predicted_peak_bytes"]) == row["predicted_peak_bytes"]
        assert int(attrs["predicted_peak_bytes"]) > 0
