"""The GPU suite's CPU rehearsal runs every section inside its minutes and records each one,
cut short or not; a section past its cap is stopped and keeps its record; a failing one is
recorded and the suite goes on."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks import gpu_markdown, gpu_sections, gpu_suite

ROOT = Path(__file__).resolve().parents[1]
MINUTES = 4.0
#: The suite ends inside its minutes; the slack covers the driver's start and last write.
SLACK_S = 60.0
pytestmark = pytest.mark.timeout(int(60 * MINUTES + 300))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``python -m benchmarks.gpu_suite --cpu-smoke --minutes 4`` in its own process."""
    base = tmp_path_factory.mktemp("suite")
    out, archive = base / "suite", base / "results" / "gpu_suite.tar.gz"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu_suite", "--cpu-smoke",
                           "--minutes", str(MINUTES), "--out", str(out), "--archive",
                           str(archive)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60 * MINUTES + 240)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"report": json.loads((out / "gpu_suite.json").read_text()),
            "markdown": (out / "gpu_suite.md").read_text(), "out": out, "archive": archive,
            "seconds": seconds, "stdout": proc.stdout}


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_the_rehearsal_ends_inside_its_minutes(smoke: dict) -> None:
    assert smoke["seconds"] < 60 * MINUTES + SLACK_S, smoke["stdout"]


@pytest.mark.slow  # run with -m slow (README: Tests)
@pytest.mark.parametrize("name", gpu_suite.SECTIONS)
def test_every_section_is_recorded_whole_or_cut_short(name: str, smoke: dict) -> None:
    section = smoke["report"][name]
    assert section["status"] in ("ok", "cut short", "not run"), section.get("traceback")
    assert section["cap_seconds"] > 0
    if section["status"] == "ok":
        assert section["rows"], f"{name} finished with no rows"
        assert section["seconds"] <= section["cap_seconds"] + gpu_suite.GRACE_SECONDS
    else:  # what it measured is kept, and why it stopped is said
        assert section["cut_short"] and (section.get("cut_reasons") or section.get("reason"))
    # BENCHMARKS.md's form: heading, run line, the fixed header row
    md = smoke["markdown"].split(f"### GPU {name}\n", 1)[1].split("### GPU ", 1)[0]
    assert md.lstrip().startswith("Run: ") and "--cpu-smoke" in md.splitlines()[1]
    assert ("**cut short**" in md) == bool(section.get("cut_short"))
    assert "| " + " | ".join(gpu_markdown.HEADERS[name]) + " |" in md


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_memory_is_cut_short_with_what_it_measured(smoke: dict) -> None:
    """The paper SwinIR cannot be planned within the cap on CPU: the section is cut short and
    keeps the cases that finished; nothing CPU cannot measure is filled in."""
    memory = smoke["report"]["memory"]
    assert memory["cut_short"]
    assert memory["cases"]["swinir_paper"]["cut_short"]
    for row in memory["rows"]:
        assert row["planned"] > 0 and row["compiled"] > 0 and row["booked"] >= row["planned"]
        assert row["measured"] is None and row["error_pct"] is None and row["phases"] is None
        # the child records what it ran under: the library's policy for a process that trains
        assert row["allocator_env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"
    for case in memory["cases"].values():
        assert (case.get("skipped") or case.get("cut_short")
                or case["first_oom_batch"] == gpu_sections.NOT_ON_CPU)
    assert memory["allowance"]["bytes"] == 0 and not memory["allowance"]["stored"]


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_equalities_hold_where_measured(smoke: dict) -> None:
    report = smoke["report"]
    noise = report["fusion"].get("noise_floor")
    if noise:  # the same program twice on CPU: bit for bit
        assert noise["same_bytes"] and noise["final_loss_rel_diff"] == 0.0
        assert noise["runs"][1]["wall_s"] < noise["runs"][0]["wall_s"]  # compiled once
    for row in report["fusion"]["rows"]:
        assert row["max_final_loss_rel_diff"] < 1e-3
        assert row["end_to_end_speedup"] > 0 and row["compile_planning_s"] > 0
        # the steady steps are benchmarks.fusion's own, the step alone and one wide step too
        assert row["steady_step_solo_s"] > 0 and row["steady_step_fused_s"] > 0
        assert row["step_speedup"] > 0
        assert row["wide_speedup"] is None or row["wide_speedup"] > 0
        # where time allowed, the fused step in the form CPU does not run by default
        assert row["other_form"] in (None, "grouped")
        assert row["other_form_step_speedup"] is None or row["other_form_step_speedup"] > 0
    if "csp_equals_sequential" in report["supernet"]:
        assert report["supernet"]["csp_equals_sequential"]
    assert all(row["same_bytes"] for row in report["determinism"]["rows"])
    for row in report["supernet"]["rows"]:
        assert row["samples_per_second"] > 0 and row["wall_seconds"] > 0
        assert (row["host_to_device_bytes"] > 0) == row["offload"]
    packing = report["packing"].get("rows", [])
    assert packing or report["packing"].get("cut_short")
    for row in packing:  # initial states made on the host, not compiled
        assert row["host_initial_state_s"] > 0


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_what_a_plan_without_the_gpu_needs_is_recorded(smoke: dict) -> None:
    env = smoke["report"]["meta"]["environment"]
    assert env["status"] == "ok" and env["packages"]["jax"] and env["python"]
    assert env["target_config"] is None and "no XLA target" in env["target_config_reason"]
    files = {p.name for p in (smoke["out"] / "environment").iterdir()}
    assert {"environment.json", "jax_environment.txt"} <= files
    # The serialized topology, or why this JAX could not serialize it (jax 0.10 on CPU).
    assert ("topology.pb" in files) != ("topology_error" in env), env.get("topology_error")


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_results_come_back_as_one_small_archive(smoke: dict) -> None:
    archive = smoke["archive"]
    assert archive.stat().st_size <= gpu_suite.ARCHIVE_LIMIT
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for name in ("gpu_suite.json", "gpu_suite.md", "MANIFEST.txt", "logs/memory.log",
                 "sections/memory.json", "environment/environment.json"):
        assert f"suite/{name}" in names, sorted(names)
    assert json.loads((archive.parent / "gpu_suite.json").read_text()) == smoke["report"]


def test_a_section_past_its_cap_is_stopped_and_keeps_its_record(tmp_path: Path) -> None:
    """The fusion rehearsal needs far more than 12 s: its process is stopped (by its own clock
    or killed with its group) and the record says so."""
    start = time.perf_counter()
    body = gpu_suite._spawn("fusion", gpu_suite.CPU_SMOKE, tmp_path, 12.0, None, 1.0)
    assert time.perf_counter() - start < 12.0 + 40.0
    assert body["status"] == "cut short" and body["cut_short"] and body["cut_reasons"]
    assert body["cap_seconds"] == 12.0
    assert (tmp_path / "logs" / "fusion.log").exists()


def test_a_failing_section_is_recorded_and_the_suite_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend that cannot start fails every section's process; each failure is recorded
    with its cause, the others still run, and the report is written."""
    monkeypatch.setenv("JAX_PLATFORMS", "no_such_platform")
    report = gpu_suite.run_suite(gpu_suite.CPU_SMOKE, tmp_path, 2.0, ("determinism", "tests"))
    for name in ("determinism", "tests"):
        assert report[name]["status"] == "failed"
        assert "no_such_platform" in report[name]["error"], report[name]["error"]
    assert report["packing"]["status"] == "not run"
    written = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert set(gpu_suite.SECTIONS) <= set(written)
    md = (tmp_path / "gpu_suite.md").read_text()
    assert "**failed**: RuntimeError" in md
    assert "**not run**: not selected (--only)." in md  # the sections left out say so
    # The Markdown is made again from the JSON alone, as the run wrote it.
    (tmp_path / "gpu_suite.md").unlink()
    assert gpu_markdown.main([str(tmp_path)]) == md == (tmp_path / "gpu_suite.md").read_text()
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit):
        gpu_markdown.main([str(tmp_path / "other.json")])


def test_gpu_markdown_refuses_an_output_it_cannot_write_before_its_work(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Where the Markdown beside the JSON cannot be written (here a folder is in its place),
    the command says so in one line and how to write it elsewhere, not with a traceback."""
    report = {"meta": {"started": "2026-12-03T00:00:00", "devices": 1, "device_kind": "cpu"}}
    (tmp_path / "gpu_suite.json").write_text(json.dumps(report))
    (tmp_path / "gpu_suite.md").mkdir()
    with pytest.raises(SystemExit) as exc:
        gpu_markdown.main([str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "gpu_suite.md' (the default, beside the JSON) cannot be written there; pass --out " \
        "FILE to write the Markdown elsewhere" in err, err
    out = tmp_path / "elsewhere.md"
    assert gpu_markdown.main([str(tmp_path), "--out", str(out)]) == out.read_text()


def test_caps_share_the_time_left() -> None:
    cfg = gpu_suite.GPU
    left = 400.0
    first = gpu_suite.section_cap(cfg, "mainjob", gpu_suite.SECTIONS, left)
    assert first == pytest.approx(left * cfg.shares["mainjob"] / sum(cfg.shares.values()))
    # the last section gets all that is left
    assert gpu_suite.section_cap(cfg, "tests", ("tests",), 33.0) == pytest.approx(33.0)


def test_a_short_gpu_suite_spends_its_minutes_on_the_open_questions() -> None:
    """In the default 9 minutes the sections of answered questions (packing, determinism,
    supernet) are left out, so the main job, fusion, memory, tests and compiles share the
    time; a 20-minute suite, or one that names them, runs them too. The CPU rehearsal runs
    every section."""
    cfg = gpu_suite.GPU
    left_out = gpu_suite.gated(cfg, 9.0)
    assert set(left_out) == {"packing", "determinism", "supernet"}
    assert all("--only" in why for why in left_out.values())
    assert gpu_suite.gated(cfg, 20.0) == {}
    assert gpu_suite.gated(cfg, 9.0, ("mainjob", "packing"), explicit=True) == {}
    assert gpu_suite.gated(gpu_suite.CPU_SMOKE, 4.0) == {}
    kept = tuple(s for s in gpu_suite.SECTIONS if s not in left_out)
    assert kept[:2] == ("mainjob", "fusion")
    # even where the environment record takes its whole cap and the main job its whole share
    left = 60 * 9.0 - gpu_suite.RESERVE_SECONDS - cfg.environment_seconds
    mainjob = gpu_suite.section_cap(cfg, "mainjob", kept, left)
    assert mainjob >= 135.0
    assert gpu_suite.section_cap(cfg, "fusion", kept[1:], left - mainjob) >= 120.0


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_the_compiles_section_records_each_plans_cost(smoke: dict) -> None:
    section = smoke["report"]["compiles"]
    if section["status"] != "ok":
        assert section["cut_short"], section
        pytest.skip(f"cut short: {section.get('cut_reasons')}")
    (row,) = section["rows"]
    assert row["case"] == "swinir" and row["form"] == "planning only"
    assert row["cpu_s"] > 0 and row["batch"] >= 1 and row["plan_compiles"] >= 1


def test_bisection_brackets_the_first_batch_that_runs_out() -> None:
    """Bisection over a stand-in run (CPU devices cannot run out of memory): runs fail above
    1,000 samples."""
    tried = []

    def run(batch: int) -> dict:
        tried.append(batch)
        return {"oom": batch > 1000}

    cfg = dataclasses.replace(gpu_suite.GPU, oom_probes=5)  # a suite with time for them
    got = gpu_sections._bisect_oom(cfg, {"batch": 900, "data_parallel": 1}, run)
    assert got["resolved"] and got["largest_ok_batch"] <= 1000 < got["first_oom_batch"]
    assert got["first_oom_batch"] - got["largest_ok_batch"] <= 0.02 * 1000
    assert got["probes"] == len(tried) <= cfg.oom_probes
    assert got["planned_over_first_oom"] == pytest.approx(900 / got["first_oom_batch"])


def test_the_archive_leaves_out_what_passes_its_limit(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    (out / "logs").mkdir(parents=True)
    (out / "gpu_suite.json").write_text("{}")
    (out / "logs" / "big.log").write_bytes(os.urandom(200_000))  # incompressible
    (out / "packing" / "checkpoints").mkdir(parents=True)
    (out / "packing" / "checkpoints" / "state.json").write_text("{}")
    # XLA's autotuning results are packed whatever XLA names them; elsewhere, not
    (out / "autotune").mkdir()
    (out / "autotune" / "f3a9.textproto").write_text("autotune result")
    (out / "packing" / "other.textproto").write_text("not a result")
    got = gpu_suite.pack(out, tmp_path / "r.tar.gz", limit=150_000)
    assert got["left_out"] == ["logs/big.log"] and got["bytes"] <= 150_000
    with tarfile.open(tmp_path / "r.tar.gz") as tar:
        names = set(tar.getnames())
        manifest = tar.extractfile("suite/MANIFEST.txt").read().decode()
    assert names == {"suite/gpu_suite.json", "suite/autotune/f3a9.textproto",
                     "suite/MANIFEST.txt"}
    assert "logs/big.log" in manifest.split("left out")[1]


def test_the_autotune_folder_is_set_in_xla_flags_once() -> None:
    from benchmarks.gpu_sections import AUTOTUNE_FLAG, with_xla_flag

    assert with_xla_flag("", AUTOTUNE_FLAG, "/o/autotune") == f"{AUTOTUNE_FLAG}=/o/autotune"
    flags = f"--xla_gpu_deterministic_ops=true {AUTOTUNE_FLAG}=/old"
    assert with_xla_flag(flags, AUTOTUNE_FLAG, "/o/a") == (
        f"--xla_gpu_deterministic_ops=true {AUTOTUNE_FLAG}=/o/a")


def test_the_main_job_sets_a_solo_steps_least_time_beside_the_measured_one() -> None:
    """On a GPU the engine paces trials by the kind's attainable FLOP/s (``run.peak_flops``):
    the row sets the least a solo step takes by that figure (what ``--plan-only`` says for a
    GPU target) beside the step measured, so a slot checks the estimate. A fused member and
    a trial without a step time are left out; on CPU devices (no peak) there is none."""
    def trial(flops, seconds, group=None):
        return {"state": "complete", "batch_size": 4, "step_seconds": seconds,
                "fused_group": group, "plan": {"flops_per_step": flops}}

    results = {"run": {"peak_flops": 1e12, "elapsed_s": 10.0},
               "trials": [trial(2e9, 0.02), trial(4e9, 0.02), trial(8e9, 0.5, group=0),
                          trial(3e9, None)]}
    row = gpu_sections.mainjob_row(results)
    assert row["solo_least_step_s"] == pytest.approx(0.003)  # median of 2 ms and 4 ms
    assert row["solo_step_over_least"] == pytest.approx(7.5)  # median of 10x and 5x
    results["run"]["peak_flops"] = None
    row = gpu_sections.mainjob_row(results)
    assert row["solo_least_step_s"] is None and row["solo_step_over_least"] is None


def test_the_main_job_row_holds_the_best_models_test_scores() -> None:
    """The row keeps the best trial's held-out score and, where the run tested its model on
    images no trial was chosen by, the test score beside bicubic's; a test of another trial's
    model (the best changed since) is not the best's."""
    best = {"number": 3, "state": "complete", "psnr": 32.1, "bicubic_psnr": 31.7}
    results = {"metric": "psnr", "best": 3, "run": {"elapsed_s": 10.0}, "trials": [best],
               "test": {"trial": 3, "psnr": 29.0, "bicubic_psnr": 28.1}}
    row = gpu_sections.mainjob_row(results)
    assert (row["best"], row["bicubic"], row["test"], row["test_bicubic"]) == (
        32.1, 31.7, 29.0, 28.1)
    results["test"]["trial"] = 2
    row = gpu_sections.mainjob_row(results)
    assert row["test"] is None and row["test_bicubic"] is None


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_the_main_job_reports_its_compile_share_and_booking(smoke: dict) -> None:
    """The rehearsal's main job (the CPU preset, 2 trials of 20 steps) reports what the GPU
    targets read: compile seconds against the study's and the pool booked."""
    section = smoke["report"]["mainjob"]
    if section["status"] == "cut short" and not section["rows"]:
        pytest.skip(f"the main job was cut short: {section.get('cut_reasons')}")
    row = section["rows"][0]
    results = json.loads((smoke["out"] / "mainjob" / "results.json").read_text())
    assert {k: row[k] for k in gpu_sections.mainjob_row(results)} == gpu_sections.mainjob_row(
        results)
    # the host's data per step of the widest fused group, timed after the study if time is left
    assert row["host_data"] == "2 x 256"
    assert (row["host_data_s"] or 0) > 0 or "not measured" in section["member_data_error"]
    assert row["solo_step_s"] > 0
    assert row["trials"] == 2 and row["batch_sizes"] and row["compile_s"] > 0
    assert 0 < row["peak_memory_utilization"] <= 1 and row["planning_compiles"] >= 1
    assert row["compile_share"] == row["compile_s"] / row["study_s"]


def test_benchmarks_md_lists_each_sections_header_row_exactly() -> None:
    """BENCHMARKS.md says each section's table has exactly the header row it lists there: the
    rows the suite's Markdown writes (`gpu_markdown.HEADERS`), so that pasted results line up."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    listed = {line.split(":", 1)[0]: line.split(":", 1)[1].strip()
              for line in text.splitlines() if line.split(":", 1)[0] in gpu_markdown.HEADERS}
    assert listed == {name: "| " + " | ".join(header) + " |"
                      for name, header in gpu_markdown.HEADERS.items()}


@pytest.mark.parametrize("args, message", [
    (["--minutes", "0.05", "--cpu-smoke"], "--minutes 0.05 leaves no time for a section"),
    (["--minutes", "1"], "pass at least --minutes 2"),
    (["--only", ""], "--only '': no section"),
    (["--only", "memory,nope"], "unknown section(s) nope"),
])
def test_the_suite_refuses_what_would_measure_nothing_before_it_starts(
        args: list[str], message: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        gpu_suite.main(["--out", str(tmp_path / "out"), *args])
    assert ended.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_output_paths_under_a_file_are_refused_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a-file").write_text("")
    for args in (["--out", str(tmp_path / "a-file")],
                 ["--out", str(tmp_path / "out"), "--archive",
                  str(tmp_path / "a-file" / "x.tar.gz")]):
        with pytest.raises(SystemExit) as ended:
            gpu_suite.main(args)
        assert ended.value.code == 2
        err = capsys.readouterr().err
        assert "a-file" in err and "Traceback" not in err


def test_a_suite_in_which_no_section_ran_ends_with_an_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot whose sections all found too little time (the environment record took it) must
    not read as a good run. The suite's own run is replaced here (a fault that needs a machine
    slow enough to spend the minutes on the environment record): its report says that no
    section ran."""
    report = {"meta": {}, **{name: {"status": "not run", "reason": "5 s left for it"}
                             for name in gpu_suite.SECTIONS}}
    monkeypatch.setattr(gpu_suite, "run_suite", lambda *args, **kwargs: report)
    # what the suite's driver sets for its sections' processes, kept out of this one
    from experiments._cli import TRACEBACK_VARIABLE

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv(TRACEBACK_VARIABLE, os.environ.get(TRACEBACK_VARIABLE, "0"))
    monkeypatch.setattr(gpu_suite.signal, "signal", lambda *args: None)
    with pytest.raises(SystemExit) as ended:
        gpu_suite.main(["--out", str(tmp_path), "--cpu-smoke", "--minutes", "2"])
    assert "no section ran in 2 minutes" in str(ended.value.code)
    report["fusion"] = {"status": "cut short"}  # one that ran, even cut short, is a result
    assert gpu_suite.main(["--out", str(tmp_path), "--cpu-smoke", "--minutes", "2"]) is report
