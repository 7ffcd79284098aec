"""Multi-process runs under a real ``mpirun``: the supernet pipeline with one stage per rank and a
trial that is data parallel across ranks.

Each test launches a script of ``tests/mpi_scripts`` once as a plain process and once under
``mpirun -n R``, and compares the two outputs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _requirements import require_module, unavailable

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "mpi_scripts"

pytestmark = pytest.mark.mpi


def mpi_env() -> dict[str, str]:
    """Environment of an MPI child: CPU JAX, each process choosing its own devices and worker
    pool (XLA_FLAGS and PJRT_NPROC of the pytest process dropped), quiet Open MPI."""
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    # Each rank sets its own device count; drop the 8 devices of the pytest process.
    env.pop("XLA_FLAGS", None)
    env.pop("PJRT_NPROC", None)
    env["PYTHONPATH"] = str(ROOT)
    return env


def launcher(ranks: int) -> list[str]:
    """``mpirun -n ranks`` with the flags this MPI needs (see `mpirun_command`)."""
    from scamp_jax.distributed.mpi import MPIUnavailableError, mpirun_command

    try:
        return mpirun_command(ranks)
    except MPIUnavailableError:
        unavailable("no mpirun on PATH: install an MPI (apt-get install openmpi-bin)")


def launch(args: list[str], ranks: int | None, timeout: float) -> subprocess.CompletedProcess:
    """Run ``python <args>`` (under ``mpirun -n ranks`` when given) in the repository root."""
    cmd = [sys.executable, *args]
    if ranks is not None:
        cmd = [*launcher(ranks), *cmd]
    return subprocess.run(cmd, env=mpi_env(), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def run_script(script: str, args: list[str], ranks: int | None, timeout: float) -> dict:
    """Run ``tests/mpi_scripts/<script>`` (under mpirun when ``ranks``), return its JSON."""
    out = Path(args[args.index("--out") + 1])
    proc = launch([str(SCRIPTS / script), *args], ranks, timeout)
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


@pytest.fixture(autouse=True)
def _needs_mpi() -> None:
    require_module("mpi4py", "the mpi extra is not installed: pip install .[mpi]")
    from scamp_jax.distributed.mpi import MPIUnavailableError, import_mpi4jax

    try:
        import_mpi4jax()  # as the library imports it (see MPI_TESTED_JAX)
    except MPIUnavailableError:
        unavailable("the mpi extra is not installed: pip install .[mpi]")


def test_two_rank_csp_pipeline_matches_single_process_bit_for_bit(tmp_path: Path) -> None:
    single = run_script("supernet_pipeline.py", ["--stages", "2", "--out", str(tmp_path / "s")],
                        None, timeout=300)
    multi = run_script("supernet_pipeline.py", ["--out", str(tmp_path / "m")], 2, timeout=300)
    assert multi["stages"] == 2
    assert multi["losses"] == single["losses"]
    assert multi["params_sha256"] == single["params_sha256"]
    # Same tick program, same resident bytes (the store offloaded to host memory).
    assert multi["ticks"] == single["ticks"]
    assert multi["host_param_bytes"] == single["host_param_bytes"] > 0


@pytest.mark.slow
def test_four_rank_gpipe_pipeline_with_shared_weights_matches_single_process(
    tmp_path: Path,
) -> None:
    args = ["--schedule", "gpipe", "--train-shared", "--no-offload"]
    single = run_script("supernet_pipeline.py", [*args, "--stages", "4", "--out",
                                                 str(tmp_path / "s")], None, timeout=300)
    multi = run_script("supernet_pipeline.py", [*args, "--out", str(tmp_path / "m")], 4,
                       timeout=300)
    assert multi["losses"] == single["losses"]
    assert multi["params_sha256"] == single["params_sha256"]


def test_two_rank_data_parallel_trial_matches_single_process_loss_curve(tmp_path: Path) -> None:
    single = run_script("data_parallel.py", ["--out", str(tmp_path / "s")], None, timeout=300)
    multi = run_script("data_parallel.py", ["--out", str(tmp_path / "m")], 2, timeout=300)
    assert multi["ranks"] == 2 and len(multi["losses"]) == len(single["losses"]) == 4
    # Not bit-identical: the batch mean becomes a mean over ranks of half-batch means, the same
    # float32 numbers added in another order (a few units in the last place). Without the
    # gradient all-reduce each replica would step on half the batch and the curves would part
    # by far more (measured: the second loss moves by about 1e-2 and the replicas diverge).
    np.testing.assert_allclose(multi["losses"], single["losses"], rtol=2e-6)
    hashes = multi["replica_hashes"]
    assert len(hashes) == 2 and hashes[0] == hashes[1], "replicas diverged"


@pytest.mark.parametrize(("fault", "said"), [
    pytest.param("--die-at-tick", "rank 1 exits at tick 4", marks=pytest.mark.slow),
    # an exception: the rank would still finalize MPI as it exits; the pipeline aborts the job
    ("--raise-at-tick", "rank 1 failed: RuntimeError: rank 1 raises at tick 4"),
])
def test_a_rank_that_dies_stops_the_pipeline_instead_of_hanging(tmp_path: Path, fault: str,
                                                                said: str) -> None:
    # The surviving rank blocks in a receive from the dead one; the launcher must end the job
    # (a hang would raise TimeoutExpired here) and report the failed rank's exit status.
    proc = launch([str(SCRIPTS / "supernet_pipeline.py"), fault, "4", "--out",
                   str(tmp_path / "m")], 2, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert said in output
    assert not (tmp_path / "m").exists()


def launch_bounded(args: list[str], ranks: int, timeout: float) -> tuple[int, str]:
    """`launch` under ``mpirun -n ranks`` in a session of its own; a job still running after
    ``timeout`` seconds is killed whole (mpirun and its ranks) and fails the test as a hang.
    Returns the exit status and the output."""
    cmd = [*launcher(ranks), sys.executable, *args]
    proc = subprocess.Popen(cmd, env=mpi_env(), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        in_session = subprocess.run(["ps", "-o", "pid=", "-s", str(proc.pid)],
                                    capture_output=True, text=True).stdout.split()
        for pid in in_session:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the job still ran after {timeout} s (a hang); its output:\n{output}")
    return proc.returncode, output


@pytest.mark.slow
@pytest.mark.parametrize(("disagree", "said"), [
    ("subnets", "ranks disagree on the subnets: rank 1's differ from rank 0's; pass the same "
                "subnets, batches and settings on every rank"),
    ("seed", "ranks disagree on the settings (seed): rank 1's differ from rank 0's"),
], ids=["subnets", "seed"])
def test_ranks_that_pass_different_arguments_are_refused_instead_of_hanging(
    tmp_path: Path, disagree: str, said: str,
) -> None:
    # Other subnets give each rank another schedule: the ranks would wait for each other's
    # messages forever. Every rank refuses, with the same error, before anything trains.
    returncode, output = launch_bounded(
        [str(SCRIPTS / "supernet_pipeline.py"), "--disagree", disagree, "--out",
         str(tmp_path / "m")], 2, timeout=150)
    assert returncode != 0, output
    assert output.count(f"ValueError: {said}") == 2, output
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(("flags", "said"), [
    # each rank's subnets make its own tick program: the ranks would mix their results
    (["--disagree", "subnets"], "ValueError: ranks disagree on the tick program (the subnets or "
     "the schedule): rank 1's differ from rank 0's; pass the same subnets, batches and "
     "settings on every rank"),
    (["--disagree", "seed"], "ValueError: ranks disagree on the starting weights: rank 1's "
     "differ from rank 0's"),
    # rank 1's on_tick raises: rank 0 would wait in its next receive forever
    (["--raise-at-tick", "4"], "rank 1 failed: RuntimeError: rank 1 raises at tick 4"),
], ids=["subnets", "seed", "raises"])
def test_mpi_pipeline_executor_used_directly_refuses_disagreeing_ranks_and_ends_on_a_failure(
        tmp_path: Path, flags: list[str], said: str) -> None:
    returncode, output = launch_bounded(
        [str(SCRIPTS / "supernet_pipeline.py"), "--direct", *flags, "--out",
         str(tmp_path / "m")], 2, timeout=150)
    assert returncode != 0, output
    assert said in output, output
    if "--disagree" in flags:
        assert output.count(said) == 2, output  # every rank refuses, with the same error
        # and closes the executor the call built for it (its communicator), as a run does
        assert output.count("the executors built were closed: True") == 2, output
    assert not (tmp_path / "m").exists()


def test_a_data_parallel_rank_that_raises_ends_the_job_instead_of_hanging() -> None:
    # Rank 1's batches raise at step 2; rank 0 would wait in the step's allreduce forever.
    returncode, output = launch_bounded(
        [str(SCRIPTS / "data_parallel_faults.py"), "raises"], 2, timeout=150)
    assert returncode != 0, output
    assert "rank 1 failed: RuntimeError: rank 1 cannot read its batch 2" in output, output
    assert "trained" not in output


@pytest.mark.parametrize(("case", "said"), [
    # rank 1 has 3 batches, rank 0 has 5: rank 0 would wait in its fourth step forever
    ("uneven", "the ranks ran out of batches apart: only 1 of the 2 had a batch for step 3 "
               "(counting from 0); pass every rank the same global batches"),
    # each rank built the model with its own seed: the replicas would part silently
    ("seeds", "ranks start from different parameters: rank 1's differ from rank 0's; build "
              "the model with the same seed on every rank"),
    # a batch that does not split: every rank says so at that step, none trains it
    ("indivisible", "step 2 (counting from 0): global batch 7 is not a multiple of the 2 "
                    "ranks; use a batch of 6 (or 8)"),
])
def test_data_parallel_ranks_that_do_not_go_together_are_refused_alike_and_can_retry(
        case: str, said: str) -> None:
    returncode, output = launch_bounded(
        [str(SCRIPTS / "data_parallel_faults.py"), case], 2, timeout=150)
    assert returncode == 0, output
    assert output.count(f"caught ValueError: {said}") == 2, output
    # the ranks' retry with the same batches and seed, in the same job
    assert output.count("trained 5 steps, replicas equal True") == 2, output


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_model_of_a_float_type_mpi_has_no_type_for_trains_data_parallel(dtype: str) -> None:
    # mpi4jax knows no MPI type for these: the reduction runs in float32 and casts back
    returncode, output = launch_bounded(
        [str(SCRIPTS / "data_parallel_faults.py"), dtype], 2, timeout=150)
    assert returncode == 0, output
    assert output.count(f"trained 5 steps, replicas equal True, params ['{dtype}']") == 2, output
    for fuse in (False, True):
        assert output.count(f"fuse={fuse} mean 2.0 1.0 {dtype}") == 2, output


def test_a_rank_that_fails_before_the_pipeline_trains_ends_the_job(tmp_path: Path) -> None:
    # Rank 1 fails while it draws its patches, before any collective of the pipeline: the
    # other rank would wait for it forever in the executor's set-up; the job ends instead.
    proc = launch([str(SCRIPTS / "supernet_nas_rank_fault.py"), "fails", "--preset", "smoke",
                   "--stages", "2", "--layers", "2", "--choices", "2", "--subnets", "2",
                   "--eval-subnets", "1", "--quiet", "--json", str(tmp_path / "m.json")], 2,
                  timeout=240)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    assert "rank 1 failed: rank 1 cannot read its training photographs" in output, output
    assert not (tmp_path / "m.json").exists()


def test_a_rank_whose_photographs_differ_is_refused_before_the_pipeline_trains(
        tmp_path: Path) -> None:
    # The experiment's ranks each draw their own patches: a rank whose copy of the photographs
    # differs in one pixel would train its stage on other targets (no error, another result).
    returncode, output = launch_bounded(
        [str(SCRIPTS / "supernet_nas_rank_fault.py"), "differs", "--preset", "smoke",
         "--stages", "2", "--layers", "2", "--choices", "2", "--subnets", "2",
         "--eval-subnets", "1", "--quiet", "--json", str(tmp_path / "m.json")], 2, timeout=240)
    assert returncode != 0, output
    assert ("failed: ranks disagree on the HR batches: rank 1's differ from rank "
            "0's") in output, output
    assert not (tmp_path / "m.json").exists()


def test_supernet_experiment_names_a_stage_count_other_than_the_ranks_once(tmp_path: Path
                                                                          ) -> None:
    proc = launch(["-m", "experiments.supernet_nas", "--mpi", "--preset", "smoke", "--stages",
                   "4", "--out-dir", str(tmp_path / "out"), "--quiet"], 2, timeout=120)
    assert proc.returncode != 0
    said = ("error: --stages 4 but 2 MPI ranks: the pipeline runs one stage per rank; launch "
            "with mpirun -n 4 or pass --stages 2")
    assert proc.stderr.count(said) == 1, proc.stderr  # rank 0's, not one per rank
    assert proc.stderr.count("usage:") == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_supernet_experiment_under_mpirun_matches_the_single_process_run(tmp_path: Path) -> None:
    # The default preset's sizes (width 16): XLA's CPU convolutions split their work by the
    # process's worker pool, and a rank with one device (a pool of 2 here, 8 in the single
    # process) trained to another weight hash.
    flags = ["--subnets", "8", "--shared-warmup", "0", "--eval-subnets", "1", "--quiet"]
    single = launch(["-m", "experiments.supernet_nas", *flags, "--json",
                     str(tmp_path / "s.json")], None, timeout=300)
    assert single.returncode == 0, single.stderr
    multi = launch(["-m", "experiments.supernet_nas", "--mpi", *flags, "--json",
                    str(tmp_path / "m.json")], 4, timeout=300)
    assert multi.returncode == 0, multi.stderr
    a = json.loads((tmp_path / "s.json").read_text())
    b = json.loads((tmp_path / "m.json").read_text())
    assert b["mpi_ranks"] == 4 and b["stage_ranks"] == [0, 1, 2, 3]
    assert b["params_sha256"] == a["params_sha256"] and b["losses"] == a["losses"]
    assert b["evaluation"] == a["evaluation"]


@pytest.mark.slow
def test_supernet_experiment_stopped_in_one_process_resumes_under_mpirun(tmp_path: Path) -> None:
    # A single-process run stopped by Ctrl-C after its first checkpoint, then the same flags
    # under mpirun --mpi in the same --out-dir: every rank reads the checkpoint, rank 0 writes
    # the next one, and the result is the uninterrupted single-process run's.
    from test_supernet_nas_cli import ctrl_c_after_checkpoint

    flags = ["--subnets", "8", "--shared-warmup", "0", "--eval-subnets", "1", "--quiet"]
    whole = launch(["-m", "experiments.supernet_nas", *flags, "--checkpoint-every", "0",
                    "--json", str(tmp_path / "s.json")], None, timeout=300)
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "out"
    resumable = [*flags, "--checkpoint-every", "3", "--out-dir", str(out)]
    ctrl_c_after_checkpoint([sys.executable, "-m", "experiments.supernet_nas", *resumable],
                            mpi_env(), out / "checkpoint")
    multi = launch(["-m", "experiments.supernet_nas", "--mpi", *resumable], 4, timeout=300)
    assert multi.returncode == 0, multi.stderr
    a = json.loads((tmp_path / "s.json").read_text())
    b = json.loads((out / "results.json").read_text())
    assert b["mpi_ranks"] == 4 and b["resumed_at"] in ([3], [6])
    assert b["params_sha256"] == a["params_sha256"] and b["losses"] == a["losses"]
    assert not (out / "checkpoint").exists()


def test_a_rank_that_is_stopped_ends_the_job_saying_it_stopped_not_failed(capsys) -> None:
    """`end_every_rank` with a Ctrl-C (or SIGTERM's `Terminated`): the rank says it stopped
    and how to resume, and ends the job with 130 (143), where it said "rank 2 failed: " with
    nothing after it and ended with 1, as a crash. (A stand-in communicator records the
    abort: a real one ends this process.)"""
    from scamp_jax._signals import Terminated
    from scamp_jax.distributed.mpi import end_every_rank

    class Communicator:
        aborted: list[int] = []

        def Get_rank(self) -> int:  # noqa: N802 - mpi4py's name
            return 2

        def Abort(self, code: int) -> None:  # noqa: N802 - mpi4py's name
            self.aborted.append(code)

    comm = Communicator()
    end_every_rank(comm, KeyboardInterrupt())
    end_every_rank(comm, Terminated())
    end_every_rank(comm, ValueError("--stages 3 does not divide 8 layers"))
    err = capsys.readouterr().err.splitlines()
    assert comm.aborted == [130, 143, 2]
    assert err[:2] == [f"rank 2 stopped ({what}): what the job saved stays; run the same "
                       "command to resume" for what in ("Ctrl-C", "SIGTERM")]
    assert err[2].startswith("rank 2 failed: ") and "--stages 3" in err[2]
    # A library call that keeps nothing says so instead of advising a resume
    # (`train_supernet_mpi`).
    from scamp_jax.distributed.mpi import failures_end_every_rank

    with pytest.raises(KeyboardInterrupt), failures_end_every_rank(
            comm, stopped="this call saves nothing; its training is lost"):
        raise KeyboardInterrupt
    assert capsys.readouterr().err.splitlines() == [
        "rank 2 stopped (Ctrl-C): this call saves nothing; its training is lost"]


def _study(tmp_path: Path, ranks: int, trials: int, *extra: str) -> subprocess.CompletedProcess:
    return launch([str(SCRIPTS / "study_ranks.py"), "--storage",
                   f"sqlite:///{tmp_path / 'study.db'}", "--trials", str(trials), "--out",
                   str(tmp_path / "trials.json"), *extra], ranks, timeout=300)


def _trials(tmp_path: Path) -> list[dict]:
    return json.loads((tmp_path / "trials.json").read_text())["trials"]


def test_study_split_across_three_ranks_records_every_trial_once_with_its_rank(
    tmp_path: Path,
) -> None:
    proc = _study(tmp_path, 3, 9)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trials = _trials(tmp_path)
    assert sorted(t["number"] for t in trials) == list(range(9))
    assert all(t["state"] == "COMPLETE" for t in trials)
    assert all(t["value"] == (t["x"] - 2.0) ** 2 for t in trials)
    assert all(t["steps"] == [0, 1] for t in trials)  # reports reached rank 0's study
    assert {t["rank"] for t in trials} == {0, 1, 2}


def test_a_request_longer_than_mpi4pys_default_receive_buffer_reaches_the_study(
    tmp_path: Path,
) -> None:
    """A tell of 100,000 bytes (a failed trial's traceback and records can pass 32 KiB, the
    buffer mpi4py's ``irecv`` receives into without one): rank 0 receives it whole."""
    proc = _study(tmp_path, 2, 4, "--seconds", "0", "--note-bytes", "100000")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trials = _trials(tmp_path)
    assert sorted(t["number"] for t in trials) == list(range(4))
    assert all(t["state"] == "COMPLETE" and t["note_bytes"] == 100000 for t in trials)
    assert {t["rank"] for t in trials} == {0, 1}


def test_study_restarted_after_a_rank_died_resumes_without_losing_finished_trials(
    tmp_path: Path,
) -> None:
    died = _study(tmp_path, 2, 8, "--die-rank", "1")
    assert died.returncode != 0
    assert "rank 1 exits in trial" in died.stdout + died.stderr
    assert not (tmp_path / "trials.json").exists()
    import optuna
    before = optuna.load_study(study_name="ranks", storage=f"sqlite:///{tmp_path / 'study.db'}")
    finished = {t.number: t.value for t in before.get_trials() if t.state.name == "COMPLETE"}
    assert finished, "rank 1 told its first trial before it died"
    # Same command again: the study resumes from its storage.
    proc = _study(tmp_path, 2, 8)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads((tmp_path / "trials.json").read_text())
    trials = {t["number"]: t for t in out["trials"]}
    assert sum(t["state"] == "COMPLETE" for t in trials.values()) == 8
    assert all(trials[n]["value"] == v for n, v in finished.items())
    # Trials the killed job held were left RUNNING; the restart marks them failed.
    assert out["stale_failed"]
    assert all(trials[n]["state"] == "FAIL" for n in out["stale_failed"])
    assert len(trials) == 8 + len(out["stale_failed"])


@pytest.mark.slow
def test_mpi_stage_step_memory_matches_the_single_process_stage_and_is_the_compile_it_runs(
    tmp_path: Path,
) -> None:
    single = run_script("supernet_pipeline.py", ["--memory", "--stages", "2", "--out",
                                                 str(tmp_path / "s")], None, timeout=300)
    multi = run_script("supernet_pipeline.py", ["--memory", "--out", str(tmp_path / "m")], 2,
                       timeout=300)
    assert multi["stages"] == 2 and len(multi["memory"]) == 2
    one = single["memory"][0]
    for stage in multi["memory"]:
        # The same stage step on one device: the same state and microbatch arguments (plus the
        # int32 stage index), donated and aliased alike.
        assert stage["argument"] == one["argument"] + 4
        assert stage["alias"] == one["alias"] > 0
        assert stage["host_argument"] == one["host_argument"]
        assert stage["device_bytes"] == max(
            stage["argument"] + stage["output"] - stage["alias"] + stage["temp"],
            stage["exchange_bytes"],
        )
        # Whatever program runs, the stage's whole state stays resident.
        assert stage["exchange_bytes"] > stage["alias"]
    # The run on the executor compiled by compiled_memory traced nothing again and trained
    # exactly what the single-process pipeline trains.
    assert multi["traced_after_compile"] == single["traced_after_compile"] == 0
    assert multi["params_sha256"] == single["params_sha256"]
    assert multi["losses"] == single["losses"]
    # Open after the run it was passed to; closed, each rank's communicator is freed and the
    # executor refuses another run with a message that says why.
    for before, refused, after in multi["closed"]:
        assert before is False and after is True
        assert refused.startswith("this MPIPipelineExecutor was closed")
