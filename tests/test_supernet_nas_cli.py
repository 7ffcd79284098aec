"""``python -m experiments.supernet_nas`` refuses impossible sizes at once, in one line, exit 2."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = [
    (["--layers", "0"], "--layers 0 must be at least 1; pass e.g. --layers 8"),
    (["--stages", "3", "--layers", "8"],
     "--layers 8 is not a multiple of --stages 3 (every stage holds the same number of "
     "layers); pass --layers 9 or --stages one of 1, 2, 4, 8"),
    (["--width", "0"], "--width 0 must be at least 1; pass e.g. --width 16"),
    (["--preset", "smoke", "--subnets", "0"],  # the run's preset's value
     "--subnets 0 must be at least 1; pass e.g. --subnets 24"),
    (["--shared-warmup", "-5"],
     "--shared-warmup -5 must be at least 0 (0: none); pass e.g. --shared-warmup 1000"),
    (["--stages", "-1"], "--stages -1 must be at least 1; pass e.g. --stages 4"),
    (["--seed", "-1"], "--seed -1 must be at least 0; pass e.g. --seed 0"),
    # not the working directory, which Path("") is
    (["--out-dir", ""], """--out-dir '' is empty; pass a directory ("." for this one)"""),
    (["--schedule", "gpipe", "--batch-size", "6", "--microbatches", "4"],
     "--batch-size 6 is not a multiple of --microbatches 4; pass --batch-size 4"),
    (["--preset", "smoke", "--layers", "2", "--stages", "2", "--eval-subnets", "17"],
     "--eval-subnets 17 is more than the 16 different subnets of --choices 4 in --layers 2; "
     "pass --eval-subnets 16 or fewer"),
    # 16 CPU devices at most on a CPU-only machine (MAX_CPU_STAGES), fewer GPUs elsewhere.
    (["--stages", "100", "--layers", "100"],
     r"--stages 100 needs one device per stage but there are \d+ \w+ devices; pass --stages "
     r"\d+ or fewer"),
    # the plot and the checkpoint beside the JSON take its name with their own suffix
    (["--json", "out.png"], "--json 'out.png': the plot beside it takes that name; pass a "
     "name ending in .json, e.g. 'out.json'"),
    (["--json", "run.checkpoint"], "--json 'run.checkpoint': the checkpoint beside it takes "
     "that name; pass a name ending in .json, e.g. 'run.json'"),
    # a flag of another schedule is refused, not ignored
    (["--schedule", "csp", "--microbatches", "3"], "--microbatches 3 applies to --schedule "
     "gpipe only (--schedule csp trains each subnet's whole batch at once); leave it out, or "
     "pass --schedule gpipe"),
    (["--json", "d/a.txt"], "--json 'd/a.txt': the plot and the checkpoint beside it take the "
     "name without its ending, which a run writing 'd/a.json' would share; pass a name ending "
     "in .json, e.g. 'd/a.json'"),
    (["--json", "results"], "--json 'results': the plot and the checkpoint beside it take"),
    (["--json", ""], "argument --json: '' names no file (the plot and the checkpoint beside it "
     "take its stem); pass a name ending in .json, e.g. results.json"),
    (["--json", ".json"], "argument --json: '.json' names no file"),
    # every subnet's patches are drawn before training: more than the host holds is refused
    # (1.4 TiB here; the paper preset's 20.6 GiB on a host of less than 41 GiB)
    (["--preset", "smoke", "--subnets", "100000000"],
     r"--subnets 100000000 x --batch-size 4 draws 1.40 TiB of training patches before "
     r"training, more than 50% of this host's [\d.]+ \w+ of memory; pass --subnets \d+ or "
     r"fewer \(or run on a host with more memory\)"),
    # a usage error like the others, not a failure: without mpirun there is one process
    (["--mpi"], "--mpi needs an MPI launcher with one rank per pipeline stage, e.g. mpirun -n 4"),
]


@pytest.mark.parametrize(("flags", "message"), CASES, ids=lambda x: " ".join(x) if
                         isinstance(x, list) else None)
def test_bad_sizes_exit_2_with_one_line_naming_the_flag(flags, message, tmp_path) -> None:
    started = time.monotonic()
    # As a shell starts it: once another test has initialised MPI in this process, MPI's own
    # variables sit in the environment a child inherits, and would read as a launcher's.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    proc = subprocess.run(  # a case's own --out-dir comes last, so it wins
        [sys.executable, "-m", "experiments.supernet_nas", "--out-dir", str(tmp_path / "out"),
         *flags, "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.search(message if "\\d" in message else re.escape(message), last), last
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "out").exists()  # nothing written before the check
    assert time.monotonic() - started < 60  # fails fast, no compile


def test_ranks_of_mpirun_without_mpi_are_refused_before_any_work(tmp_path) -> None:
    """``mpirun -n 2`` without ``--mpi``: each rank would train the whole supernet into one
    folder; every rank refuses in one line, exit 2, and writes nothing."""
    from test_mpi_runs import launcher

    proc = subprocess.run(
        [*launcher(2), sys.executable, "-m", "experiments.supernet_nas", "--preset", "smoke",
         "--out-dir", str(tmp_path / "out"), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=_cli_env())
    assert proc.returncode == 2, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "without --mpi" in line]
    assert said == ["python -m experiments.supernet_nas: error: launched by MPI as 2 ranks "
                    "without --mpi: every rank would train the whole supernet into the same "
                    "--out-dir; pass --mpi to run one pipeline stage per rank (mpirun -n 4 "
                    "...), or run it without mpirun"] * 2, proc.stderr
    assert not (tmp_path / "out").exists()


def test_mpi_under_a_launcher_of_one_rank_says_to_launch_one_per_stage(tmp_path) -> None:
    """``mpirun -n 1 ... --mpi`` (the launcher's variables of one rank): not "needs a launcher"
    but how many to launch, exit 2, before MPI or JAX start."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.supernet_nas", "--mpi", "--out-dir",
         str(tmp_path / "out"), "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**env, "OMPI_COMM_WORLD_SIZE": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(
        "--mpi under an MPI launcher of one rank: the pipeline runs one stage per rank; launch "
        "one per stage (mpirun -n 4 ...) or drop --mpi to run every stage in this process")
    assert not (tmp_path / "out").exists()


def test_outputs_that_cannot_be_written_are_refused_before_training(tmp_path) -> None:
    """An ``--out-dir`` that is a file, a ``--json`` that is a folder: one line, exit 2, before
    the supernet trains (the results of a whole run would be lost at its end)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    (tmp_path / "a-file").write_text("")
    for flags, message in (
            (["--out-dir", str(tmp_path / "a-file")],
             f"--out-dir {str(tmp_path / 'a-file')!r} is a file; pass a directory"),
            (["--out-dir", str(tmp_path / "out"), "--json", str(tmp_path)],
             f"--json {str(tmp_path)!r} is a directory; pass a file name")):
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.supernet_nas", "--preset", "smoke", *flags,
             "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(f"error: {message}")
        assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "out").exists()



def test_under_mpi_a_layer_count_the_ranks_do_not_divide_names_the_launch(capsys) -> None:
    """With ``--mpi`` and no ``--stages`` the stages are the launcher's ranks: the fix is
    another ``mpirun -n`` (more than one rank: ``--mpi`` refuses one) or ``--layers``, not
    ``--stages``."""
    import argparse
    import dataclasses

    from experiments.supernet_nas import check_config, get_config

    p = argparse.ArgumentParser(prog="python -m experiments.supernet_nas")
    config = dataclasses.replace(get_config("smoke"), layers=4, stages=3)
    with pytest.raises(SystemExit) as exited:
        check_config(config, p, get_config("smoke"), ranks=3)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "python -m experiments.supernet_nas: error: --layers 4 is not a multiple of the 3 MPI "
        "ranks (one pipeline stage each, every stage holds the same number of layers); pass "
        "--layers 6 or launch 2 or 4 ranks (mpirun -n 2 ...)")


def _cli_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}


def test_a_checkpoint_of_other_settings_is_refused_in_one_line(tmp_path) -> None:
    """A rerun whose settings differ from the unfinished run's checkpoint in ``--out-dir``:
    one line naming what differs and how to start afresh, exit 2, the checkpoint kept.
    ``--no-offload`` is not among them: it moves the supernet, not a bit of what trains."""
    import dataclasses

    import numpy as np

    from experiments.supernet_nas import get_config
    from scamp_jax.pipeline import SupernetState
    from search_spaces.supernet_nas import NASCheckpoint

    out = tmp_path / "out"
    config = dataclasses.replace(get_config("smoke"), out_dir=str(out))
    state = SupernetState(np.zeros((4, 4, 3), np.float32), np.zeros(5, np.float32),
                          {"block_steps": np.ones((4, 4), np.int32)})
    NASCheckpoint(config).save(state, np.ones(3, np.float32), warmup={}, segments=[],
                               resumed_at=[])
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.supernet_nas", "--preset", "smoke", "--seed", "1",
         "--schedule", "sequential", "--no-offload", "--train-shared", "--out-dir", str(out),
         "--quiet"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=_cli_env())
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {out.resolve() / 'checkpoint'} holds an unfinished run with other settings "
        "(--schedule 'csp' there, 'sequential' here; --no-train-shared there, --train-shared "
        "here; --seed 0 there, 1 here); run that command "
        "again to resume it, or pass another --out-dir, or --fresh to discard it and train "
        "from the start")
    assert "Traceback" not in proc.stderr
    assert NASCheckpoint(config).latest() == 3


@pytest.mark.parametrize("damaged", ["settings", "weights", "weights gone"])
def test_a_damaged_checkpoint_is_refused_in_one_line_that_names_it(tmp_path, damaged) -> None:
    """A checkpoint of this run's settings whose JSON (settings and progress) or array data
    (weights and optimizer state) is damaged, or whose weights' folder is gone (orbax's
    `KeyError`): one line naming it, what could not be read and
    how to start afresh, exit 2, no traceback (not orbax's, nor one of each read it
    abandoned), the checkpoint kept."""
    import dataclasses

    import numpy as np

    from experiments.supernet_nas import get_config
    from scamp_jax.pipeline import SupernetState
    from search_spaces.supernet_nas import NASCheckpoint

    out = tmp_path / "out"
    config = dataclasses.replace(get_config("smoke"), out_dir=str(out))
    state = SupernetState(np.zeros((4, 4, 300), np.float32), np.zeros(500, np.float32),
                          {f"m{i}": np.ones((4, 4, 300), np.float32) for i in range(8)})
    NASCheckpoint(config).save(state, np.ones(3, np.float32), warmup={}, segments=[],
                               resumed_at=[])
    step = out.resolve() / "checkpoint" / "3"
    if damaged == "settings":
        (step / "meta" / "metadata").write_text("")
        what = "the run's settings and progress"
    elif damaged == "weights gone":
        shutil.rmtree(step / "state")
        what = "the supernet's weights and optimizer state"
    else:
        data = [p for p in (step / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
        assert data
        for path in data:
            os.truncate(path, path.stat().st_size // 2)
        what = "the supernet's weights and optimizer state"
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.supernet_nas", "--preset", "smoke", "--out-dir",
         str(out), "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=_cli_env())
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: the checkpoint {step} cannot be read as {what} (is it "
                           "damaged?); orbax: "), line
    assert line.endswith("; pass --fresh to discard it and train from the start, or another "
                         "--out-dir"), line
    assert "tensorstore_spec" not in line
    assert NASCheckpoint(config).latest() == 3


def test_a_second_run_in_a_folder_in_use_is_refused_in_one_line(tmp_path) -> None:
    """Another process holds the folder's checkpoint (a run under way): a second run there is
    refused at once in one line naming that process, exit 2, and touches nothing; once it is
    let go, the folder is left as it was (no lock file)."""
    import dataclasses

    from experiments.supernet_nas import get_config
    from search_spaces.supernet_nas import NASCheckpoint

    out = tmp_path / "out"
    hold = NASCheckpoint(dataclasses.replace(get_config("smoke"), out_dir=str(out)))
    with hold.held():
        proc = subprocess.run(
            [sys.executable, "-m", "experiments.supernet_nas", "--preset", "smoke",
             "--out-dir", str(out), "--quiet"], cwd=ROOT, capture_output=True, text=True,
            timeout=300, env=_cli_env())
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint.lock"]
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"error: {out.resolve()} is in use by another run (process {os.getpid()}, which holds "
        "checkpoint.lock); wait for it to end, or pass another --out-dir (or --json)"]
    assert not out.exists()  # made for the hold alone, it goes with it


def test_an_mpi_run_in_a_folder_in_use_is_refused_before_any_rank_trains(tmp_path) -> None:
    """``--mpi`` into a folder another run holds: rank 0, which writes the checkpoint, is
    refused in one line naming that process, and the job ends (exit 2) rather than two runs
    training into one checkpoint; nothing is written there."""
    import dataclasses

    from test_mpi_runs import launcher

    from experiments.supernet_nas import get_config
    from search_spaces.supernet_nas import NASCheckpoint

    out = tmp_path / "out"
    hold = NASCheckpoint(dataclasses.replace(get_config("smoke"), out_dir=str(out)))
    with hold.held():
        proc = subprocess.run(
            [*launcher(2), sys.executable, "-m", "experiments.supernet_nas", "--preset", "smoke",
             "--mpi", "--out-dir", str(out), "--quiet"], cwd=ROOT, capture_output=True,
            text=True, timeout=300, env=_cli_env())
        assert sorted(p.name for p in out.iterdir()) == ["checkpoint.lock"]
    assert proc.returncode == 2, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "in use" in line]
    assert said == [
        f"rank 0 failed: {out.resolve()} is in use by another run (process {os.getpid()}, "
        "which holds checkpoint.lock); wait for it to end, or pass another --out-dir (or "
        "--json)"], proc.stderr


def test_discarding_a_checkpoint_never_removes_the_working_directory(tmp_path, monkeypatch):
    """``--json out.json --fresh`` from an empty folder: the checkpoint is ``./out.checkpoint``
    and its folder the working directory, which a discard (``--fresh``'s, before training, or
    the run's end) leaves in place, where it removed it while empty and the results then had
    nowhere to go. A folder made for the checkpoint alone still goes once empty."""
    import dataclasses

    import numpy as np

    from experiments.supernet_nas import get_config
    from scamp_jax.pipeline import SupernetState
    from search_spaces.supernet_nas import NASCheckpoint

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    config = dataclasses.replace(get_config("smoke"), checkpoint_dir="out.checkpoint")
    NASCheckpoint(config).discard(folder=False)  # --fresh, nothing saved yet
    state = SupernetState(np.zeros((4, 4, 3), np.float32), np.zeros(5, np.float32),
                          {"block_steps": np.ones((4, 4), np.int32)})
    NASCheckpoint(config).save(state, np.ones(3, np.float32), warmup={}, segments=[],
                               resumed_at=[])
    NASCheckpoint(config).discard()  # the run's end
    assert work.is_dir() and not (work / "out.checkpoint").exists()
    made = dataclasses.replace(config, checkpoint_dir=str(tmp_path / "made" / "checkpoint"))
    NASCheckpoint(made).save(state, np.ones(3, np.float32), warmup={}, segments=[],
                             resumed_at=[])
    NASCheckpoint(made).discard()
    assert not (tmp_path / "made").exists()


def ctrl_c_after_checkpoint(command: list[str], env: dict[str, str], checkpoint: Path,
                            step: int = 3) -> str:
    """Run ``command`` until ``checkpoint`` holds ``step``, then send it a Ctrl-C (SIGINT);
    its stderr, once it exited 130."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not (checkpoint / str(step)).is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    return err


@pytest.mark.slow  # three smoke runs, about two minutes on 2 shared cores
@pytest.mark.parametrize("resume_flags", [[], ["--no-offload"]],
                         ids=["the same command", "without offload"])
def test_a_run_stopped_by_ctrl_c_resumes_to_the_uninterrupted_result(tmp_path, resume_flags
                                                                     ) -> None:
    """SIGINT after the first checkpoint, then the same command (or one that keeps the
    supernet on the devices, which changes no bit): it says where it resumes and ends with
    the losses and weights hash of a run that never stopped (one segment, no checkpoint);
    the finished run leaves no checkpoint behind."""
    import json

    def command(out: Path, every: int) -> list[str]:
        return [sys.executable, "-m", "experiments.supernet_nas", "--preset", "smoke",
                "--subnets", "8", "--eval-subnets", "1", "--checkpoint-every", str(every),
                "--out-dir", str(out)]

    out = tmp_path / "resumed"
    err = ctrl_c_after_checkpoint(command(out, 3) + ["--quiet"], _cli_env(), out / "checkpoint")
    assert err.strip().splitlines()[-1] == (
        f"interrupted: the last checkpoint is in {out / 'checkpoint'}; run the same command to "
        "resume from it")
    assert not (out / "results.json").exists()

    resumed = subprocess.run(command(out, 3) + resume_flags, cwd=ROOT, env=_cli_env(),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert re.search(r"resuming from subnet [36] of 8", resumed.stdout), resumed.stdout
    assert not (out / "checkpoint").exists()

    whole = subprocess.run(command(tmp_path / "whole", 0) + ["--quiet"], cwd=ROOT,
                           env=_cli_env(), capture_output=True, text=True, timeout=300)
    assert whole.returncode == 0, whole.stderr
    a = json.loads((out / "results.json").read_text())
    b = json.loads((tmp_path / "whole" / "results.json").read_text())
    assert a["params_sha256"] == b["params_sha256"] and a["losses"] == b["losses"]
    assert a["resumed_at"] in ([3], [6]) and b["resumed_at"] == []
    assert [s["subnets"] for s in a["segments"]] == [3, 3, 2] and len(b["segments"]) == 1
    assert a["ticks"] > b["ticks"]  # each segment drains the pipeline
    # the best subnet tested on photographs no subnet was chosen by: the same weights' score
    assert a["test"] == b["test"] and a["test"]["index"] == a["best"]["index"]
    assert a["test"]["bicubic_psnr"] != a["bicubic_psnr"]  # other photographs
    assert (f"tested on photographs no subnet was chosen by: {a['test']['psnr']:.2f} dB"
            in resumed.stdout)
    # the run says its weights' hash, which the uninterrupted run's JSON holds too
    assert (f"weights sha256 {b['params_sha256'][:16]}... (params_sha256 in the JSON): a run "
            "of these settings under --schedule csp or sequential, resumed or not, trains the "
            "same bits" in " ".join(resumed.stdout.split())), resumed.stdout


def test_a_json_runs_checkpoint_is_its_own_and_a_stop_says_whether_one_was_saved(tmp_path):
    """Runs that write their own ``--json`` files keep their checkpoints beside them, never in
    a shared ``runs/supernet_nas/checkpoint``; a stop before the first save says none was
    saved, one after it where it is."""
    from experiments import supernet_nas as cli

    args = cli.parser().parse_args(["--preset", "smoke", "--json", str(tmp_path / "seq.json")])
    assert cli.checkpoint_dir(args) == str(tmp_path / "seq.checkpoint")
    words = cli._stopped_words(args)
    assert words().startswith("no checkpoint was saved yet (one is saved after each segment")
    (tmp_path / "seq.checkpoint" / "3").mkdir(parents=True)
    assert words() == (f"the last checkpoint is in {tmp_path / 'seq.checkpoint'}; run the same "
                       "command to resume from it")
    both = cli.parser().parse_args(["--json", str(tmp_path / "a.json"), "--out-dir", "o"])
    assert cli.checkpoint_dir(both) is None  # results and checkpoint in --out-dir


def test_a_setting_recorded_only_under_another_schedule_reads_as_unset_not_none() -> None:
    """A csp checkpoint records no microbatches (gpipe alone splits batches): resumed under
    gpipe, the difference says so in the command's words, not as Python's None."""
    from search_spaces.supernet_nas import _differs

    assert _differs("microbatches", None, 4) == "--microbatches unset there, 4 here"
    assert _differs("microbatches", 4, None) == "--microbatches 4 there, unset here"
    assert _differs("seed", 0, 1) == "--seed 0 there, 1 here"


_CTRL_C_AT = """
import os, signal, sys
from search_spaces import supernet_nas
from experiments import supernet_nas as command

owner = {owner}
real = getattr(owner, {name!r})

def under_ctrl_c(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, as it starts
    return real(*args, **kwargs)

setattr(owner, {name!r}, under_ctrl_c)
command.main(sys.argv[1:])
"""
#: The command with a Ctrl-C sent as a segment's checkpoint is saved.
_CTRL_C_IN_SAVE = _CTRL_C_AT.format(owner="supernet_nas.NASCheckpoint", name="save")
#: The command with a Ctrl-C sent as its results are written.
_CTRL_C_IN_RESULTS = _CTRL_C_AT.format(owner="supernet_nas", name="write_whole")


def _smoke_of_three_segments(program: str, out: Path) -> subprocess.CompletedProcess:
    """``program`` (one of `_CTRL_C_AT`'s) on the smoke preset's 8 subnets in segments of 3,
    one subnet ranked, its outputs in ``out``."""
    return subprocess.run(
        [sys.executable, "-c", program, "--preset", "smoke", "--subnets", "8",
         "--eval-subnets", "1", "--checkpoint-every", "3", "--out-dir", str(out), "--quiet"],
        cwd=ROOT, env=_cli_env(), capture_output=True, text=True, timeout=300)


def test_a_ctrl_c_as_a_segments_checkpoint_is_saved_waits_for_it(tmp_path) -> None:
    """A Ctrl-C that comes once a segment is trained, while its checkpoint is saved, stops the
    run after the save: the rerun resumes after that segment, not a segment earlier. The
    signal is sent from the save itself (the moment is the test's; the signal is real)."""
    out = tmp_path / "out"
    proc = _smoke_of_three_segments(_CTRL_C_IN_SAVE, out)
    assert proc.returncode == 130, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"interrupted: the last checkpoint is in {out / 'checkpoint'}; run the same command to "
        "resume from it")
    assert [p.name for p in (out / "checkpoint").iterdir() if p.name.isdigit()] == ["3"]



def test_a_ctrl_c_as_the_results_are_written_waits_for_them_and_the_checkpoints_end(
        tmp_path) -> None:
    """A Ctrl-C once training and evaluation are done, as the results are written: the run
    writes them whole, the plot too, and discards its checkpoint before it stops, so the folder
    is a finished run's (before, it held the checkpoint alone, which a rerun trained its last
    segment again from)."""
    out = tmp_path / "out"
    proc = _smoke_of_three_segments(_CTRL_C_IN_RESULTS, out)
    assert proc.returncode == 130, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.png"]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"interrupted: the run had finished: its results are in {out / 'results.json'} and "
        f"{out / 'results.png'}"), proc.stderr


def test_help_gives_every_size_flags_default_and_how_to_try_a_resume_on_smoke() -> None:
    """Every preset's sizes are in the epilog, with the defaults no preset changes (the
    ``--microbatches`` of gpipe, ``--checkpoint-every``), and ``--checkpoint-every`` says
    that the smoke preset's run is one segment, which saves no checkpoint to resume."""
    from experiments.supernet_nas import get_config, parser

    text = " ".join(parser().format_help().split())
    assert "Every preset: --schedule csp, --offload, --no-train-shared, --seed 0, " \
           "--microbatches 4 (gpipe), --checkpoint-every 100." in text, text
    subnets = get_config("smoke").subnets
    assert f"the smoke preset's {subnets}: pass e.g. --checkpoint-every 6" in text


def test_a_folder_that_cannot_be_locked_is_said_and_the_run_goes_on(tmp_path, monkeypatch,
                                                                     caplog) -> None:
    """A file system without locks (some NFS mounts answer ``flock`` with ENOLCK): the run
    says nothing keeps a second run out, and goes on. The fault is mocked (this machine's
    file systems all lock), and the mock says so."""
    import dataclasses
    import errno
    import fcntl

    from experiments.supernet_nas import get_config
    from search_spaces.supernet_nas import NASCheckpoint

    def no_locks(*args):  # a mock: the file system's answer where it keeps no locks
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    hold = NASCheckpoint(dataclasses.replace(get_config("smoke"), out_dir=str(tmp_path / "o")))
    with caplog.at_level("WARNING"), hold.held():
        ran = True
    assert ran and "cannot be locked" in caplog.text and "nothing keeps a second run out" \
        in caplog.text
