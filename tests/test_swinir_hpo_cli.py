"""``python -m experiments.swinir_hpo``: flags, presets, bad input rejected with a clear message."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import swinir_hpo

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ("--trials", "--steps", "--devices", "--memory-per-device", "--policy", "--sampler",
         "--seed", "--study-dir", "--storage", "--preset", "--train-dir", "--eval-dir",
         "--elastic")


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)  # the entry point sets up its own devices
    return subprocess.run([sys.executable, "-m", "experiments.swinir_hpo", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_help_explains_every_flag():
    text = swinir_hpo.parser().format_help()
    for flag in FLAGS:
        assert flag in text
    flat = " ".join(text.split())
    assert "Ctrl-C (or SIGTERM) stops the running trials" in flat  # how to stop and resume
    assert "status 130 (143 for SIGTERM)" in flat


@pytest.mark.parametrize("flag, value", [("--policy", "x"), ("--sampler", "x"),
                                         ("--preset", "huge"), ("--pruner", "x"),
                                         ("--elastic", "maybe")])
def test_unknown_choice_is_rejected(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        swinir_hpo.main([flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: '{value}'" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--trials", "0"], "argument --trials: 0 must be at least 1"),
    (["--steps", "many"], "argument --steps: 'many' is not an integer"),
    (["--checkpoint-min-seconds", "-1"], "argument --checkpoint-min-seconds: -1 must be 0"),
    (["--checkpoint-min-seconds", "nan"], "argument --checkpoint-min-seconds: nan must be 0"),
    (["--checkpoint-min-seconds", "soon"],
     "argument --checkpoint-min-seconds: 'soon' is not a number"),
    # a value that starts as a negative number is the flag's, not a flag (argparse's own
    # reading takes only plain numbers so: "expected one argument")
    (["--memory-per-device", "-1GiB"],
     "argument --memory-per-device: memory size must be positive, got '-1GiB'"),
    (["--checkpoint-min-seconds", "-.5"], "argument --checkpoint-min-seconds: -.5 must be 0"),
])
def test_bad_numbers_are_rejected(args, message, capsys):
    with pytest.raises(SystemExit):
        swinir_hpo.main(args)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("value, grow", [(None, None), ("on", True), ("off", False)])
def test_elastic_flag_reaches_the_engine(value, grow):
    from experiments._cli import config_from_args

    args = swinir_hpo.parser().parse_args([] if value is None else ["--elastic", value])
    config = config_from_args(args, swinir_hpo.get_config("smoke"), "runs/x")
    assert config.engine_config(2**30).grow_last_wave is grow


@pytest.mark.parametrize("value, cap", [(None, "auto"), ("none", None), ("3", 3)])
def test_running_cap_flag_reaches_the_engine(value, cap):
    from experiments._cli import config_from_args

    argv = [] if value is None else ["--max-running-trials", value, "--pruner", "none"]
    config = config_from_args(swinir_hpo.parser().parse_args(argv),
                              swinir_hpo.get_config("smoke"), "runs/x")
    assert config.engine_config(2**30).max_running_trials == cap
    assert config.pruner == "none"  # "none" of another flag stays a string


def test_running_cap_flag_rejects_zero(capsys):
    with pytest.raises(SystemExit):
        swinir_hpo.main(["--max-running-trials", "0"])
    assert "--max-running-trials: 0 must be at least 1" in capsys.readouterr().err


def test_presets_are_typed_and_distinct():
    smoke, default, paper = (swinir_hpo.get_config(p) for p in swinir_hpo.PRESETS)
    assert smoke.trials * smoke.steps < default.trials * default.steps < paper.trials * paper.steps
    assert default.policy == "scamp" and default.study_dir == "runs/swinir_hpo"
    assert paper.memory_per_device is None  # the GPUs' own limit
    with pytest.raises(ValueError, match="unknown preset 'x'"):
        swinir_hpo.get_config("x")


def test_the_default_preset_takes_each_trials_batch_from_memory_on_accelerators():
    """On accelerators the default preset caps no batch at the CPU's 4: every GPU with its own
    pool, batches up to a large cap, the same samples per trial at any batch, fusion by default;
    the CPU default stays as it was. The platform is an input: no GPU needed."""
    cpu = swinir_hpo.get_config("default")
    assert swinir_hpo.get_config("default", platform="cpu") == cpu
    assert (cpu.trials, cpu.steps, cpu.reference_batch, cpu.max_batch_size, cpu.devices,
            cpu.memory_per_device, cpu.max_running_trials, cpu.fuse) == (
        6, 1000, 4, 4, swinir_hpo.CPU_POOL_DEVICES, "32MiB", None, None)
    for platform in ("gpu", "tpu"):
        accel = swinir_hpo.get_config("default", platform=platform)
        assert accel.preset == "default" and accel.study_dir == cpu.study_dir
        assert (accel.devices, accel.memory_per_device) == (None, None)  # every device, its pool
        assert accel.max_batch_size >= 256 * cpu.max_batch_size
        # Samples per trial whatever batch its memory allows, more than on CPU.
        samples = accel.steps * accel.reference_batch
        assert samples >= 10 * cpu.steps * cpu.reference_batch
        assert accel.steps_for(accel.max_batch_size) * accel.max_batch_size >= samples
        assert accel.max_running_trials == "auto"  # no cap on accelerators
        assert accel.initial_params == cpu.initial_params
        fused = accel.on_platform(platform)
        assert fused.fuse == "auto" and fused.source_kwargs()["siblings"] == 7
    for preset in ("smoke", "paper"):
        assert swinir_hpo.get_config(preset, platform="gpu") == swinir_hpo.get_config(preset)


def test_flags_apply_on_top_of_the_preset_for_the_pools_platform():
    args = swinir_hpo.parser().parse_args(["--max-batch-size", "16", "--fuse", "1"])
    gpu = swinir_hpo.config_for(args, "gpu")
    assert (gpu.max_batch_size, gpu.fuse, gpu.memory_per_device) == (16, 1, None)
    assert gpu.on_platform("gpu").fuse == 1  # --fuse 1 keeps fusion off on a GPU
    assert swinir_hpo.config_for(args, "cpu").memory_per_device == "32MiB"
    default = swinir_hpo.config_for(swinir_hpo.parser().parse_args([]), "gpu")
    assert default == swinir_hpo.accelerator_default()


def test_checkpoints_keep_their_number_per_trial_when_steps_change():
    """The smoke preset checkpoints every 25 of its 100 steps: with --steps 1000 every 250
    (four writes a trial, not forty), unless --checkpoint-every says otherwise."""
    def config(*flags):
        return swinir_hpo.config_for(swinir_hpo.parser().parse_args(["--preset", "smoke",
                                                                     *flags]))

    assert config().checkpoint_every == 25
    assert config("--steps", "1000").checkpoint_every == 250
    assert config("--steps", "10").checkpoint_every == 2
    assert config("--steps", "1000", "--checkpoint-every", "0").checkpoint_every == 0
    assert config("--checkpoint-every", "7").checkpoint_every == 7
    # a minute of training between two checkpoints at least, unless the flag says otherwise
    assert config().checkpoint_min_seconds == 60
    assert config("--checkpoint-min-seconds", "0").checkpoint_min_seconds == 0
    assert config("--checkpoint-min-seconds", "2.5").checkpoint_min_seconds == 2.5


@pytest.mark.parametrize("argv, platform, pool", [
    ([], "cpu", swinir_hpo.CPU_POOL_DEVICES), ([], "gpu", None),
    (["--devices", "3"], "cpu", 3), (["--devices", "3"], "gpu", 3),
    (["--preset", "smoke"], "cpu", None)])
def test_default_preset_pools_few_cpu_devices_and_every_gpu(argv, platform, pool):
    from experiments._cli import config_from_args, pool_size

    args = swinir_hpo.parser().parse_args(argv)
    config = config_from_args(args, swinir_hpo.get_config(args.preset), "runs/x")
    assert pool_size(args, config, platform) == pool


@pytest.mark.parametrize(("size", "says"), [
    ("lots", "cannot read memory size 'lots': use a number of bytes or a number with a unit"),
    ("0", "memory size must be positive, got '0'")])
def test_unreadable_memory_size_is_rejected_in_the_flags_words(tmp_path, size, says):
    result = cli("--memory-per-device", size, "--study-dir", str(tmp_path))
    assert result.returncode == 2
    assert f"error: argument --memory-per-device: {says}" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("size", "says"), [
    ("1.5", "error: argument --memory-per-device: memory size '1.5' is not a whole number of "
            "bytes; did you leave out its unit? e.g. '1.5GiB' or '1.5GB'"),
    ("16", "error: argument --memory-per-device: memory size '16' is 16 bytes; did you leave "
           "out its unit? e.g. '16GiB' or '16GB'"),
    ("1e2", "error: argument --memory-per-device: memory size '1e2' is 100 bytes; did you "
            "leave out its unit? e.g. '1e2GiB' or '1e2GB'")])
def test_a_size_without_its_unit_is_refused_before_the_study_is_made(tmp_path, size, says):
    """A forgotten unit is said in one line, and the study folder stays empty, so the command
    with the size meant is not refused as a change of the study's settings."""
    result = cli("--preset", "smoke", "--memory-per-device", size, "--study-dir",
                 str(tmp_path / "s"), "--no-live")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(says), result.stderr
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_budget_too_small_for_any_candidate_is_rejected(tmp_path):
    result = cli("--preset", "smoke", "--memory-per-device", "64KiB", "--study-dir",
                 str(tmp_path), "--no-live")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "error: none of the first 3 candidates fits the pool of 8 devices" in result.stderr
    assert "raise --memory-per-device or --devices" in result.stderr
    assert "Traceback" not in result.stderr


def test_plan_only_with_no_candidate_that_fits_says_so_in_flags_and_exits_2(tmp_path):
    result = cli("--preset", "smoke", "--plan-only", "--trials", "2", "--memory-per-device",
                 "1KiB", "--study-dir", str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "trial 1: no plan: SwinIR does not fit" in result.stdout
    assert "more --memory-per-device" in result.stdout and "memory_per_device" not in \
        result.stdout
    assert ("error: none of the 2 candidates fits this pool (each one's reason above)"
            in result.stderr)
    assert "Traceback" not in result.stderr


def test_plan_only_keeps_what_it_compiles_with_the_studys_compiled_programs(tmp_path):
    """The preview compiles on the devices a study of this folder runs on, as the study
    compiles them: its programs go to the study's ``jax_cache`` (beside its plans), and the
    study loads them instead of compiling again."""
    result = cli("--preset", "smoke", "--plan-only", "--trials", "1", "--study-dir",
                 str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    kept = sorted(p.name.split("-")[0] for p in (tmp_path / "jax_cache").glob("*-cache"))
    assert "jit_step" in kept and len(kept) >= 2, kept  # the step, and its evaluation
    assert (tmp_path / "plans.sqlite").is_file()
    # The study then plans, compiles its step and its evaluation from them: nothing anew.
    study = cli("--preset", "smoke", "--trials", "1", "--steps", "3", "--no-live",
                "--study-dir", str(tmp_path))
    assert study.returncode == 0, study.stdout + study.stderr
    overhead = json.loads((tmp_path / "results.json").read_text())["run"]["overhead"]
    assert {k: overhead[k] for k in ("planning_compiles", "runner_step_compiles",
                                     "evaluation_compiles", "runner_step_cache_loads")} == {
        "planning_compiles": 0, "runner_step_compiles": 0, "evaluation_compiles": 0,
        "runner_step_cache_loads": 1}, overhead


def test_plan_only_refuses_more_devices_per_trial_than_the_pool_before_it_says_more(tmp_path):
    """As the study refuses it, and before the preview's header: the error is all it says."""
    result = cli("--preset", "smoke", "--plan-only", "--policy", "fixed", "--devices-per-trial",
                 "9", "--study-dir", str(tmp_path))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "error: --devices-per-trial 9 exceeds the pool of 8 devices; lower --devices-per-trial "
        "to 8 or less, or pass --devices 9 (a larger pool)"]


def test_plan_only_refuses_an_empty_study_dir_as_a_study_does():
    """``--study-dir ''`` is refused as the study refuses it, not read as the working
    directory, where the preview's plans.sqlite went before."""
    result = cli("--preset", "smoke", "--plan-only", "--trials", "1", "--study-dir", "")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [
        """error: --study-dir '' is empty; pass a directory ("." for this one)"""]
    assert not (ROOT / "plans.sqlite").exists()


def test_plan_only_under_mpirun_is_refused_on_every_rank_before_any_plan(tmp_path):
    """``mpirun -n 2 ... --plan-only``: every rank would plan and compile every candidate and
    print the whole table; each refuses in one line, exit 2, and plans nothing."""
    from test_mpi_runs import launcher, mpi_env

    proc = subprocess.run(
        [*launcher(2), sys.executable, "-m", "experiments.swinir_hpo", "--preset", "smoke",
         "--plan-only", "--study-dir", str(tmp_path / "s")], cwd=ROOT, env=mpi_env(),
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if "--plan-only" in line]
    assert said == ["error: --plan-only under an MPI launcher of 2 ranks: it plans in one "
                    "process and trains nothing, and every rank would plan every candidate; "
                    "run it without mpirun (with --devices N for the devices one rank has)"] * 2
    assert "planning" not in proc.stdout and not (tmp_path / "s").exists()


def test_plan_only_plans_without_a_plan_cache_it_cannot_use_and_says_so(tmp_path):
    """The preview keeps its plans in the study folder's ``plans.sqlite``; where that cannot
    be made (here the folder is a file) it says so and plans all the same."""
    (tmp_path / "a-file").write_text("")
    result = cli("--preset", "smoke", "--plan-only", "--trials", "1", "--memory-per-device",
                 "1KiB", "--study-dir", str(tmp_path / "a-file"))
    assert (f"  note: the plan cache {str(tmp_path / 'a-file' / 'plans.sqlite')!r} cannot be "
            f"made: {str(tmp_path / 'a-file')!r} is a file; pass another --study-dir; planning "
            "without it, so nothing is kept") in result.stdout.splitlines(), result.stdout
    assert "trial 0: no plan: SwinIR does not fit" in result.stdout  # planned all the same
    assert "Traceback" not in result.stderr


def test_plan_only_says_its_pruner_would_prune_nothing_as_the_study_would(tmp_path):
    """The preview is where settings are checked: a pruner with no evaluation before the last
    step is said there as the study says it."""
    result = cli("--preset", "smoke", "--plan-only", "--trials", "1", "--pruner", "median",
                 "--memory-per-device", "1KiB", "--study-dir", str(tmp_path))
    assert ("the median pruner prunes nothing in this study: no trial is evaluated before "
            "its last step; pass --eval-every below --steps 100") in result.stdout.splitlines(), \
        result.stdout


@pytest.mark.parametrize(("trials", "says"), [
    ("1", "no group is sized below; pass --trials 2 or more to size them"),
    ("2", "groups of at most 2 below, not 4; pass --trials 4 to size the widest")])
def test_plan_only_says_where_trials_cap_the_fused_groups_it_sizes(tmp_path, trials, says):
    """A fused group holds trials of the study, at most ``--trials``: a preview of fewer
    trials than ``--fuse`` asks for says so, where it showed smaller groups, or none, and
    no word why (the groups themselves: `test_targets.py`, a small pool here)."""
    result = cli("--preset", "smoke", "--plan-only", "--trials", trials, "--fuse", "4",
                 "--memory-per-device", "1KiB", "--study-dir", str(tmp_path))
    assert (f"  a fused group holds trials of the study, at most --trials ({trials}): {says}"
            in result.stdout.splitlines()), result.stdout + result.stderr


@pytest.mark.slow
def test_smoke_preset_runs_end_to_end(tmp_path):
    """The smoke preset trains real SwinIR candidates and writes the full report (minutes)."""
    result = cli("--preset", "smoke", "--study-dir", str(tmp_path), "--no-live", timeout=1500)
    assert result.returncode == 0, result.stdout + result.stderr
    payload = json.loads((tmp_path / "results.json").read_text())
    trials = payload["trials"]
    assert len(trials) == swinir_hpo.get_config("smoke").trials
    for row in trials:
        for key in ("number", "params", "devices", "model_parallel", "batch_size",
                    "predicted_peak_bytes", "state", "steps", "wall_seconds", "psnr",
                    "bicubic_psnr", "rank"):
            assert key in row
    assert any(row["state"] == "complete" for row in trials)
    for name in ("study.db", "results.csv", "psnr_per_trial.png", "device_timeline.png",
                 "memory_utilization.png"):
        assert (tmp_path / name).is_file()
    assert (tmp_path / "best_model").is_dir()
    assert "best trial" in result.stdout and "bicubic_psnr" in result.stdout


# ------------------------------------------------------------------ user mistakes: one line, exit 2
def _one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """The error line of a rejected command (exit 2, no traceback), checked for ``needles``."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), result.stderr
    for needle in needles:
        assert needle in line, line
    return line


def test_study_dir_that_is_a_file_is_rejected_before_anything_is_created(tmp_path):
    target = tmp_path / "taken"
    target.write_text("not a directory")
    _one_line_error(cli("--study-dir", str(target)), "--study-dir", "is a file")
    _one_line_error(cli("--study-dir", str(target / "sub")), "--study-dir", "is a file")


def test_an_empty_study_dir_is_refused_not_taken_for_the_default_or_this_folder():
    _one_line_error(cli("--study-dir", ""), "--study-dir '' is empty; pass a directory")


def test_study_dir_that_is_not_writable_is_rejected():
    # /proc refuses new files even to root, so this holds whoever runs the tests.
    _one_line_error(cli("--study-dir", "/proc/scamp_study"), "--study-dir", "not writable")


def test_a_folder_that_cannot_be_written_is_named_once_and_its_parent_where_it_is_made():
    from scamp_jax.hpo.session import check_directory

    with pytest.raises(ValueError) as there:
        check_directory("/proc", "--study-dir")
    assert str(there.value) == ("--study-dir '/proc' is not writable; pass a directory you can "
                                "write to")
    with pytest.raises(ValueError) as made:
        check_directory("/proc/a/b", "--study-dir")
    assert str(made.value) == ("--study-dir '/proc/a/b' is not writable ('/proc', where it "
                               "would be made, is not); pass a directory you can write to")


@pytest.mark.parametrize("url, needle", [
    ("not a url", "is not a database URL"),
    ("nosuchdb://host/db", "is not a supported database"),
    ("postgresql+nosuchdriver://u@h/db", "is not a supported database"),
    ("postgresql+pg8000://u@h/db", "needs the database driver 'pg8000'"),
    ("sqlite://", "running it again cannot resume the study"),
    # found only when the study opens: /proc takes no new file, even from root
    ("sqlite:////proc/scamp_study.db", "'/proc/scamp_study.db' cannot be created"),
])
def test_bad_storage_url_is_rejected_before_a_study_exists(tmp_path, url, needle):
    _one_line_error(cli("--storage", url, "--study-dir", str(tmp_path / "s")), "--storage",
                    needle)
    assert not (tmp_path / "s").exists()


def test_damaged_study_database_names_the_cause(tmp_path):
    import optuna

    db = tmp_path / "study.db"
    study = optuna.create_study(storage=f"sqlite:///{db}", study_name="swinir")
    for _ in range(20):
        trial = study.ask()
        trial.suggest_float("x", 0.0, 1.0)
        study.tell(trial, 1.0)
    data = bytearray(db.read_bytes())
    data[3 * 4096 : 3 * 4096 + 2000] = b"\xab" * 2000  # a page of the trials table
    db.write_bytes(bytes(data))
    _one_line_error(cli("--study-dir", str(tmp_path)), "database disk image is malformed",
                    "--study-dir")


def test_steps_scale_the_presets_evaluations_and_an_idle_pruner_is_said():
    """``--steps`` keeps the paper preset's evaluations per trial (as its checkpoints); a
    pruner with no evaluation before the last step prunes nothing, and the preset's line says
    so with the flag that changes it."""
    from experiments._cli import config_from_args, preset_text

    paper = swinir_hpo.get_config("paper")
    args = swinir_hpo.parser().parse_args(["--preset", "paper", "--steps", "5000"])
    config = config_from_args(args, paper, "runs/x")
    assert config.eval_every == round(paper.eval_every * 5000 / paper.steps)
    assert config.checkpoint_every == round(paper.checkpoint_every * 5000 / paper.steps)
    assert f"pruner median (evaluations every {config.eval_every:,} steps)" in \
        preset_text("paper", config)
    args = swinir_hpo.parser().parse_args(["--preset", "smoke", "--pruner", "median"])
    smoke = config_from_args(args, swinir_hpo.get_config("smoke"), "runs/x")
    assert ("no pruning (pruner median without an evaluation before the last step: pass "
            "--eval-every below --steps)") in preset_text("smoke", smoke)


def test_eval_every_must_not_be_negative(capsys):
    with pytest.raises(SystemExit) as exit_info:
        swinir_hpo.main(["--eval-every", "-5"])
    assert exit_info.value.code == 2
    assert "argument --eval-every: -5 must be 0 (off) or more" in capsys.readouterr().err


def test_paper_preset_on_cpu_names_the_flag(tmp_path):
    line = _one_line_error(cli("--preset", "paper", "--study-dir", str(tmp_path / "s")),
                           "--memory-per-device")
    assert "plan_mesh" not in line
    assert not (tmp_path / "s" / "study.db").exists()


def test_bad_training_images_are_named(tmp_path):
    from PIL import Image

    train = tmp_path / "train"
    train.mkdir()
    Image.new("RGB", (64, 64)).save(train / "good.png")
    (train / "notes.png").write_text("this is text, not a PNG")
    study = tmp_path / "s"
    _one_line_error(cli("--train-dir", str(train), "--study-dir", str(study)), "notes.png",
                    "not a readable image")
    (train / "notes.png").unlink()
    Image.new("RGB", (8, 8)).save(train / "tiny.png")
    _one_line_error(cli("--train-dir", str(train), "--study-dir", str(study)), "tiny.png",
                    "8x8 pixels")
    assert not (study / "study.db").exists()


def test_image_folders_that_cannot_serve_are_named(tmp_path):
    """A training folder that is a file, and a held-out image too small to score at x2 (SSIM's
    11-pixel window inside a 2-pixel border needs 16 pixels): each error names the path."""
    from PIL import Image

    afile = tmp_path / "afile"
    afile.write_text("x")
    study = tmp_path / "s"
    _one_line_error(cli("--train-dir", str(afile), "--study-dir", str(study)), "afile",
                    "is a file")
    held = tmp_path / "held"
    held.mkdir()
    Image.new("RGB", (64, 64)).save(held / "fine.png")
    Image.new("RGB", (15, 40)).save(held / "small.png")
    _one_line_error(cli("--eval-dir", str(held), "--study-dir", str(study)), "small.png",
                    "40x15 pixels", "held-out score at x2")
    assert not (study / "study.db").exists()


def test_devices_per_trial_needs_the_fixed_policy(capsys):
    with pytest.raises(SystemExit) as exit_info:
        swinir_hpo.main(["--devices-per-trial", "3"])
    assert exit_info.value.code == 2
    assert "--devices-per-trial 3 applies to --policy fixed only" in capsys.readouterr().err


def test_elastic_on_with_the_fixed_policy_is_refused_as_a_setting_it_ignores(tmp_path, capsys):
    """``--policy fixed --elastic on``: the fixed policy never grows a trial's devices, so the
    flag would be silently off; refused in one line before the study is made."""
    with pytest.raises(SystemExit) as exit_info:
        swinir_hpo.main(["--preset", "smoke", "--policy", "fixed", "--elastic", "on",
                         "--study-dir", str(tmp_path / "s"), "--no-live"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --elastic 'on' applies to --policy 'scamp' only (the fixed policy gives every "
        "trial --devices-per-trial devices); pass --elastic 'off' or --policy 'scamp'")
    assert not (tmp_path / "s").exists()


def test_an_empty_study_name_is_refused_with_the_way_out(capsys):
    with pytest.raises(SystemExit) as exit_info:
        swinir_hpo.main(["--study-name", " "])
    assert exit_info.value.code == 2
    assert "leave --study-name out for the search space's name" in capsys.readouterr().err


@pytest.mark.parametrize("second", ["SIGINT", "SIGTERM"])
def test_after_a_sigterm_a_ctrl_c_stops_at_once_and_another_sigterm_changes_nothing(second):
    """The study's stop notice says "Ctrl-C again stops at once": after a SIGTERM too; a
    scheduler's repeated SIGTERM leaves the orderly stop to go on."""
    import signal
    import subprocess
    import sys

    code = ("import os, signal, time\n"
            "from experiments._cli import Terminated, user_errors\n"
            "with user_errors():\n"
            "    try:\n"
            "        os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n"
            "    except Terminated:\n"
            f"        os.kill(os.getpid(), signal.{second}); time.sleep(0.5)\n"
            "        raise\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(root)})
    if second == "SIGINT":
        assert done.returncode == 128 + signal.SIGINT, done.stderr
        assert "stopped at once" in done.stderr
    else:
        assert done.returncode == 128 + signal.SIGTERM, done.stderr
        assert "terminated: finished trials are in the study" in done.stderr


def test_sigterm_exits_143_and_ctrl_c_130(capsys):
    import signal

    from experiments._cli import user_errors

    with pytest.raises(SystemExit) as exit_info, user_errors():
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)  # let the handler run before leaving the block
    assert exit_info.value.code == 143
    assert "terminated" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info, user_errors():
        raise KeyboardInterrupt
    assert exit_info.value.code == 130
    # on its way out, the process takes a scheduler's repeated SIGTERM as nothing (it would
    # otherwise end by the signal, not with 143): the handler stays, and it ignores it
    from experiments._cli import _ignore_repeated_sigterm

    assert signal.getsignal(signal.SIGTERM) is _ignore_repeated_sigterm
    os.kill(os.getpid(), signal.SIGTERM)
    signal.sigtimedwait([], 0)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # this test process's own again


def test_a_file_written_whole_is_the_old_one_or_the_new_one(tmp_path):
    """`write_whole` (the study's record, the supernet experiment's results): a write that
    fails half-way (here text the file's encoding cannot hold, after a first part it can)
    leaves the old file as it was and no part file."""
    from scamp_jax._files import write_whole

    path = tmp_path / "results.json"
    write_whole(path, '{"old": 1}')
    with pytest.raises(UnicodeEncodeError):
        write_whole(path, '{"new": "' + "x" * 100_000 + "\ud800" + '"}')
    assert path.read_text() == '{"old": 1}'
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_the_record_is_replaced_whole(tmp_path):
    """results.json and results.csv are written beside themselves and renamed over the old
    ones (a process stopped mid-write leaves the old record, not a cut one): no part files
    stay, and the new record is read back whole."""
    from scamp_jax.hpo import report

    row = {"number": 0, "params": {}, "state": "complete", "mse": 1.0}
    for elapsed in (3.0, 5.0):
        report.write_results(tmp_path, [row], metric="mse", direction="minimize",
                             run={"elapsed_s": elapsed})
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")]
    assert [r["elapsed_s"] for r in report.read_runs(tmp_path)] == [3.0, 5.0]
    assert (tmp_path / "results.csv").read_text().splitlines()[1].startswith("0,")


@pytest.mark.parametrize("damage", ['{"runs": [{"elapsed_s": 3.0}', "[1, 2]"])
def test_a_damaged_record_is_kept_aside_with_a_warning(tmp_path, caplog, damage):
    """A results.json that is no record (cut on disk, edited) is moved aside, not written over
    unseen: its earlier runs' figures stay readable, and the new record starts afresh."""
    from scamp_jax.hpo import report

    (tmp_path / "results.json").write_text(damage)
    row = {"number": 0, "params": {}, "state": "complete", "mse": 1.0}
    report.write_results(tmp_path, [row], metric="mse", direction="minimize",
                         run={"elapsed_s": 5.0})
    aside = list(tmp_path.glob("results.damaged-*.json"))
    assert len(aside) == 1 and aside[0].read_text() == damage
    assert "is not a results record" in caplog.text and aside[0].name in caplog.text
    assert [r["elapsed_s"] for r in report.read_runs(tmp_path)] == [5.0]


def test_the_best_trials_read_on_a_narrow_terminal():
    """On 80 columns the summary's cells would be cut to nothing: it is lines of text there,
    with every figure and parameter; a wide console gets the table."""
    from rich.console import Console
    from rich.table import Table

    from scamp_jax.hpo import report

    row = {"number": 3, "state": "complete", "devices": [0, 1], "model_parallel": 1,
           "batch_size": 4, "predicted_peak_bytes": 2**20, "steps": 1000, "wall_seconds": 12.3,
           "psnr": 32.0867, "bicubic_psnr": 31.655,
           "params": {"embed_dim": 36, "num_heads": 3, "window_size": 4, "mlp_ratio": 2.0,
                      "learning_rate": 3.12e-4}}
    kw = dict(metric="psnr", direction="maximize", baseline="bicubic_psnr")
    assert isinstance(report.summary_table([row], **kw, width=160), Table)
    console = Console(width=80, record=True)
    console.print(report.summary_table([row], **kw, width=80))
    text = console.export_text()
    assert max(map(len, text.splitlines())) <= 80
    for shown in ("trial 3: psnr 32.087 (bicubic_psnr 31.655)", "batch 4", "1.00 MiB/device",
                  "embed_dim=36", "learning_rate=3.12e-04"):
        assert shown in " ".join(text.split()), text


def test_the_verdicts_gain_is_the_difference_of_the_figures_it_shows():
    """29.501 against 31.655 read -2.153 (from the unrounded scores): the line adds up as read,
    and whether the best beats its baseline is decided on the scores themselves."""
    from scamp_jax.hpo import report

    row = {"number": 2, "state": "complete", "psnr": 29.50139, "bicubic_psnr": 31.65480}
    line = report.verdict([row], "psnr", "maximize", "bicubic_psnr")
    assert line == ("best trial 2: psnr 29.501 vs bicubic_psnr 31.655 (-2.154, does not beat "
                    "the baseline)")
    close = {**row, "psnr": 31.65482}  # above the baseline by less than the figures show
    assert report.verdict([close], "psnr", "maximize", "bicubic_psnr").endswith(
        "(+2e-05, beats the baseline)")


def test_the_best_trials_show_each_fused_members_group():
    """A study with fused groups shows each trial's group (its id and width) in the summary,
    as a table and as lines of text; a study without them has no group column."""
    from rich.console import Console

    from scamp_jax.hpo import report

    base = {"state": "complete", "devices": [0], "model_parallel": 1, "batch_size": 8,
            "predicted_peak_bytes": 2**20, "steps": 10, "wall_seconds": 1.0,
            "params": {"width": 16}}
    rows = [{**base, "number": 0, "mse": 0.5, "fused_group": 0, "fusion_width": 2},
            {**base, "number": 1, "mse": 0.4, "fused_group": 0, "fusion_width": 2},
            {**base, "number": 2, "mse": 0.6, "fused_group": None, "fusion_width": 1}]

    def shown(records, width):
        console = Console(width=width, record=True)
        console.print(report.summary_table(records, "mse", "minimize", width=width))
        return " ".join(console.export_text().split())

    wide = shown(rows, 200)
    assert "group" in wide and "0 x2" in wide and " - " in wide
    assert "peak/device (of its group)" in wide  # a member's peak is its group's
    assert "seconds (of its group)" in wide  # and its seconds, its group's run
    narrow = shown(rows, 60)
    assert "trial 1 (fused group 0 x2): mse 0.4" in narrow
    assert "1.00 MiB/device for its group" in narrow
    assert "10 steps, 1.0 s (its group's run)" in narrow
    assert "group" not in shown([{**base, "number": 2, "mse": 0.6}], 200)
    # A trial that spanned two MPI ranks held its one device on each of them.
    spanned = {**base, "number": 3, "mse": 0.3, "rank": [0, 1]}
    assert "2 (1 on each of 2 ranks)" in shown([spanned], 200)
    assert "trial 3: mse 0.3; 2 device(s) (1 on each of 2 ranks), mp 1" in shown([spanned], 60)


def test_the_record_only_grows(tmp_path):
    from scamp_jax.hpo import report
    row = {"number": 0, "params": {}, "state": "complete", "mse": 1.0}
    first = {"elapsed_s": 10.0, "timeline": {"intervals": [[[0, 0.0, 10.0, 5]]],
                                             "memory_series": [[0.0], [0.5]]}}
    second = {"elapsed_s": 4.0, "interrupted": True}
    third = {"elapsed_s": 2.0, "timeline": {"intervals": [[[1, 0.0, 2.0, 5]]],
                                            "memory_series": [[0.0], [0.25]]}}
    for run in (first, second, third):
        report.write_results(tmp_path, [row], metric="mse", direction="minimize", run=run)
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [r["elapsed_s"] for r in payload["runs"]] == [10.0, 4.0, 2.0]
    assert payload["run"]["elapsed_s"] == 2.0
    intervals, memory, elapsed = report.combined_timeline(payload["runs"])
    assert intervals == [[(0, 0.0, 10.0, 5), (1, 14.0, 16.0, 5)]] and elapsed == 16.0
    assert memory == ([0.0, 10.0, 14.0, 16.0], [0.5, 0.0, 0.25, 0.0])
    assert report.run_starts(payload["runs"]) == [0.0, 10.0, 14.0]  # marked on the plots
    paths = report.plot_results(tmp_path, [row], metric="mse", intervals=intervals,
                                memory_series=memory, elapsed_s=elapsed, capacity_bytes=10,
                                run_marks=report.run_starts(payload["runs"]))
    assert all(p.stat().st_size > 0 for p in paths)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    report._mark_runs(ax, report.run_starts(payload["runs"]))  # the later runs, named
    assert [line.get_xdata()[0] for line in ax.lines] == [10.0, 14.0]
    assert [t.get_text() for t in ax.texts] == [" run 2", " run 3"]
    plt.close(fig)


def test_the_librarys_warnings_name_the_command_lines_flags(tmp_path) -> None:
    """A warning of the library under a command line (a batch that scales the steps down to
    a few) says the flag to pass, not the library's keyword, and says it once."""
    script = ROOT / "tests" / "mpi_scripts" / "hpo_mlp.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--no-live", "--study-dir", str(tmp_path / "study"),
         "--trials", "1", "--devices", "1", "--min-batch-size", "64", "--max-batch-size", "64",
         "--steps", "20"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if "trains 3 step(s)" in line]
    assert len(said) == 1 and said[0].endswith(
        "a trial at batch 64 trains 3 step(s), as --steps 20 at a batch of 8 (the reference "
        "batch) scaled to its batch; lower --max-batch-size (now 64) to keep its batch, and its "
        "steps, nearer the reference"), proc.stderr


def test_errors_name_the_command_lines_flags_not_the_librarys_keywords() -> None:
    from experiments._cli import as_flags

    message = "the device's 79.65 GiB; pass memory_per_device of at most 79.00 GiB"
    assert as_flags(message) == "the device's 79.65 GiB; pass --memory-per-device of at most " \
                                "79.00 GiB"
    assert as_flags("pass max_batch_size to bound it") == "pass --max-batch-size to bound it"
    assert as_flags("pass another study_dir, or study_name='a-2'") == (
        "pass another --study-dir, or --study-name 'a-2'")
    assert as_flags("use more devices, more memory_per_device, or a smaller model") == (
        "use more devices, more --memory-per-device, or a smaller model")
    kept = "plan_mesh(model, batch, memory_per_device='2GiB')"  # not an instruction to pass
    assert as_flags(kept) == kept
    assert as_flags("min_batch_size=64 is larger than max_batch_size=16; raise max_batch_size "
                    "to at least 64 or lower min_batch_size") == (
        "--min-batch-size 64 is larger than --max-batch-size 16; raise --max-batch-size to at "
        "least 64 or lower --min-batch-size")
    assert as_flags("study_name='a/b': ...; pass e.g. 'swinir-2'") == (
        "--study-name 'a/b': ...; pass e.g. 'swinir-2'")
    assert as_flags("a folder of that name in study_dir, so it may hold no '/'") == (
        "a folder of that name in --study-dir, so it may hold no '/'")


WARNS_AFTER_ORBAX = """
import logging
from experiments._cli import warnings_in_flags
with warnings_in_flags():
    import orbax.checkpoint  # absl configures logging as orbax loads, where nothing has
    logging.getLogger("scamp_jax.hpo.lifecycle").warning("resuming at max_batch_size %d", 4)
    logging.getLogger("another").warning("its own")
"""


def test_a_commands_warnings_print_their_words_alone_after_orbax_loads() -> None:
    """A command's warning once orbax has loaded (a resumed trial's, say): its words in flags,
    not behind ``WARNING:scamp_jax.hpo.lifecycle:`` (the default format of logging, which absl
    configures as orbax loads where nothing has); another package's keep that format. A new
    process: the state of logging at a command's start is the point."""
    proc = subprocess.run([sys.executable, "-c", WARNS_AFTER_ORBAX], cwd=ROOT, timeout=300,
                          capture_output=True, text=True,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["resuming at --max-batch-size 4",
                                        "WARNING:another:its own"], proc.stderr


def test_a_study_scored_on_other_images_is_not_resumed_on_these(tmp_path):
    """The image folders are part of what a study remembers (where given): a rerun on another
    held-out set, or on the bundled one, is refused as a changed seed is; a study that never
    named folders is unchanged."""
    from experiments._cli import HPOConfig
    from scamp_jax.hpo.study import StudySettingsError, open_study
    from scamp_jax.space import SearchSpace

    space = SearchSpace("s", lambda t: {}, lambda p, r: None)
    mine = HPOConfig(preset="smoke", trials=1, steps=1, devices=1, memory_per_device="1GiB",
                     eval_dir=str(tmp_path / "eval"))
    record = mine.study_record(space, 1 << 30)
    assert record["eval_dir"] == str((tmp_path / "eval").resolve()) and "train_dir" not in record
    open_study("s", study_dir=tmp_path, settings=record)
    bundled = HPOConfig(preset="smoke", trials=1, steps=1, devices=1, memory_per_device="1GiB")
    with pytest.raises(StudySettingsError, match="eval_dir="):
        open_study("s", study_dir=tmp_path, settings=bundled.study_record(space, 1 << 30))
    open_study("s", study_dir=tmp_path, settings=record)  # the same folders: resumed


def test_a_study_name_cannot_lead_out_of_the_study_dir():
    from experiments._cli import HPOConfig

    for name in ("../escape", "a/b", ".."):
        with pytest.raises(ValueError, match="may hold no '/'"):
            HPOConfig(preset="smoke", trials=1, steps=1, devices=1, memory_per_device="1GiB",
                      study_name=name)
    HPOConfig(preset="smoke", trials=1, steps=1, devices=1, memory_per_device="1GiB",
              study_name="swinir-2")
    # nor into a folder another study keeps there: a new best model of the study in
    # study_dir replaced its best_model/ whole, the other study's results with it
    for name in ("best_model", "checkpoints", "jax_cache", ".best_model.old"):
        with pytest.raises(ValueError, match="one of the folders a study keeps there"):
            HPOConfig(preset="smoke", trials=1, steps=1, devices=1, memory_per_device="1GiB",
                      study_name=name)


def test_a_ctrl_c_while_the_command_starts_ends_it_in_one_line(tmp_path):
    """Ctrl-C while the command still imports JAX and the rest (sent once JAX's library is
    loaded, before the study's handler is in place): one line and status 130, no traceback of
    the import it cut into, and nothing stored."""
    import signal
    import time

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "experiments.swinir_hpo", "--preset", "smoke",
                             "--no-live", "--study-dir", str(tmp_path / "study")], cwd=root,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if "jaxlib" in maps.read_text():
                break
        except OSError:
            pass
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert err.strip().splitlines()[-1].startswith(("interrupted while starting: nothing was "
                                                    "stored", "interrupted: ")), err
    assert not (tmp_path / "study" / "study.db").exists()


def test_progress_note_says_the_time_left_at_the_pace_so_far_only_when_it_is_long():
    from scamp_jax.hpo.preview import PROGRESS_NOTE_MIN_S, progress_note

    assert progress_note(3, 64, 120.0) == "; 3 of 64 planned, about 41 min left"
    assert progress_note(1, 3, 40.0) == "; 1 of 3 planned, about 80 s left"
    assert progress_note(1, 2, PROGRESS_NOTE_MIN_S - 1) == ""  # the rest is soon done
    assert progress_note(2, 2, 600.0) == ""  # nothing left
    assert progress_note(0, 2, 0.0) == ""


_PLAN_ONLY_PROGRESS = """
import sys
from scamp_jax.hpo import preview
from experiments import swinir_hpo
preview.PROGRESS_NOTE_MIN_S = 0.0  # every row says it, however fast
swinir_hpo.main(sys.argv[1:])
"""


def test_plan_only_says_after_each_candidate_how_many_are_planned_and_the_time_left(tmp_path):
    """The paper preset's preview for V100s compiles for about a minute a candidate: each
    progress line says how far it is and about how long the rest takes."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(
        [sys.executable, "-c", _PLAN_ONLY_PROGRESS, "--preset", "smoke", "--plan-only",
         "--trials", "2", "--memory-per-device", "1KiB", "--study-dir", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    rows = [line for line in result.stdout.splitlines() if line.startswith("  trial ")]
    assert len(rows) == 2, result.stdout + result.stderr
    assert "; 1 of 2 planned, about " in rows[0] and rows[0].endswith(" s left"), rows[0]
    assert "planned, about" not in rows[1]  # the last one: nothing left


def test_parser_takes_a_negative_value_as_the_flags_and_leaves_the_rest_as_argparse_reads_it():
    from experiments._cli import Parser

    p = Parser(prog="x")
    p.add_argument("--size")
    p.add_argument("--on", action="store_true")
    p.add_argument("rest", nargs="*")
    assert vars(p.parse_args(["--size", "-2GiB"])) == {"size": "-2GiB", "on": False, "rest": []}
    assert vars(p.parse_args(["--size=-2GiB"]))["size"] == "-2GiB"
    assert vars(p.parse_args(["--size", "1", "--", "-3x"]))["rest"] == ["-3x"]  # after --
    with pytest.raises(SystemExit):  # a word that is no number stays a flag, as argparse reads it
        p.parse_args(["--size", "-x"])
    assert vars(p.parse_args(["--size", "-5"]))["size"] == "-5"  # argparse's own reading
    # after "--" every word is a positional, as argparse has it: none is joined to a flag
    assert vars(p.parse_args(["--", "--on", "-2GiB"]))["rest"] == ["--on", "-2GiB"]


def test_a_closed_pipe_is_not_read_as_bad_input():
    """``--plan-only ... | head -1``: the pipe that closes is no error of the command line's,
    and a full disk's or a read-only file system's OSError is (the one-line error)."""
    from experiments._cli import user_errors

    with pytest.raises(BrokenPipeError), user_errors():
        raise BrokenPipeError(32, "Broken pipe")
    with pytest.raises(SystemExit) as ended, user_errors():
        raise OSError(30, "Read-only file system")
    assert ended.value.code == 2


def test_an_output_file_is_a_file_whose_folder_is_written_or_a_device_written_in_place(tmp_path):
    from experiments._cli import output_file

    assert output_file("/dev/stdout") == Path("/dev/stdout")
    assert output_file(str(tmp_path / "new" / "x.json")) == tmp_path / "new" / "x.json"
    (tmp_path / "dir").mkdir()
    with pytest.raises(argparse.ArgumentTypeError, match="is a folder; pass the path of a file"):
        output_file(str(tmp_path / "dir"))


def test_a_storage_on_a_read_only_folder_is_said_in_one_line(tmp_path):
    """A study database that cannot be made on a read-only mount (or a full disk: a plain
    OSError, which root's permission bits never give) is refused in one line, as a missing
    folder is, not with a traceback."""
    import shutil

    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("no unshare or mount (util-linux)")
    folder = tmp_path / "read-only"
    folder.mkdir()
    command = " ".join([sys.executable, "-m", "experiments.swinir_hpo", "--preset", "smoke",
                        "--trials", "1", "--study-dir", str(tmp_path / "study"), "--storage",
                        f"sqlite:///{folder}/study.db"])
    script = (f"mount --bind {folder} {folder} && mount -o remount,bind,ro {folder} && "
              f"exec {command}")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    result = subprocess.run(["unshare", "--mount", "--kill-child", "sh", "-c", script],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    if result.returncode != 2 and ("mount:" in result.stderr or "unshare:" in result.stderr):
        pytest.skip(f"a read-only mount is not allowed here: {result.stderr.strip()}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: the study database '{folder}/study.db' cannot be created (Read-only file "
        "system); pass --storage as a database file in a folder this process can write to"]


def test_the_best_trials_table_says_when_it_shows_some_of_them():
    """Of 7 complete trials the summary shows the best 5: its title says so and where the
    rest are, as a table and as lines; with 5 or fewer it says nothing more."""
    from rich.console import Console

    from scamp_jax.hpo import report

    rows = [{"number": i, "state": "complete", "devices": [0], "model_parallel": 1,
             "batch_size": 8, "predicted_peak_bytes": 2**20, "steps": 10, "wall_seconds": 1.0,
             "params": {"width": 16}, "mse": 0.1 * (i + 1)} for i in range(7)]

    def shown(records, width):
        console = Console(width=width, record=True)
        console.print(report.summary_table(records, "mse", "minimize", width=width))
        return " ".join(console.export_text().split())

    for width in (200, 60):
        assert ("best 5 of 7 complete trials by mse (results.csv has every trial)"
                in shown(rows, width)), width
    assert "of 5 complete" not in shown(rows[:5], 200) and "best trials by mse" in shown(
        rows[:5], 200)
