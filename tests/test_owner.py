"""A trial's process: a process that ended on this machine has its trials retried at once, not
after the heartbeat's grace period; a live one, or one this process cannot see, keeps them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from optuna.trial import TrialState

from scamp_jax.hpo.study import AskedTrial, AskLater, TrialOutcome, retried_from
from scamp_jax.hpo.study.owner import OWNER, ended, identity

TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(identity() is None, reason="needs Linux's /proc")

#: a process that asks one trial of the study in argv[1] and stays in it until it is killed
ASKER = """
import sys, time
sys.path.insert(0, {tests!r})
from test_study import source
src = source(sys.argv[1], 2, heartbeat=20)  # a grace period of a minute
asked = src.ask()
print(asked.number, flush=True)
time.sleep(600)
"""


def _ask_in_a_process(study_dir: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", ASKER.format(tests=str(TESTS)),
                             str(study_dir)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu",
                                 "PYTHONPATH": str(TESTS.parent)})
    line = proc.stdout.readline()
    assert line.strip().isdigit(), line
    return proc, int(line)


def test_a_trial_records_the_process_that_runs_it_and_its_retry_does_not(tmp_path):
    from test_study import source

    src = source(tmp_path, 2)
    asked = src.ask()
    stored = src.study.get_trials()[asked.number].user_attrs[OWNER]
    assert stored == json.loads(json.dumps(identity())) and stored["pid"] == os.getpid()
    src.interrupt(asked.number)
    retry = src.study.get_trials(states=(TrialState.WAITING,))[0]
    assert OWNER not in retry.user_attrs
    again = src.ask()
    assert again.retry_of == asked.number
    assert src.study.get_trials()[again.number].user_attrs[OWNER] == stored
    src.close()


def test_a_process_killed_on_this_machine_has_its_trial_retried_at_once(tmp_path):
    """The grace period is a minute; the trial of a process killed a moment ago is failed and
    queued again by the next process that opens the study, and asked by it."""
    from test_study import source

    proc, lost = _ask_in_a_process(tmp_path)
    # Alive: another process leaves its trial alone, and waits for it once the study is full.
    alive = source(tmp_path, 2, heartbeat=20)
    assert alive.recovered == []
    mine = alive.ask()
    assert isinstance(mine, AskedTrial) and mine.number != lost
    assert alive.ask() == AskLater(0.2, (lost,))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    began = time.monotonic()
    answer = alive.ask()  # the next ask sees the process gone
    assert isinstance(answer, AskedTrial), answer
    # well within the grace period of a minute the heartbeat would have taken
    assert time.monotonic() - began < 30 and alive.recovered == [lost]
    assert retried_from(alive.study.get_trials()[answer.number]) == lost
    assert alive.study.get_trials()[lost].state == TrialState.FAIL
    for number in (mine.number, answer.number):
        alive.tell(TrialOutcome(number, "complete", value=1.0))
    assert alive.ask() is None
    alive.close()


def test_a_killed_process_not_yet_reaped_has_ended(tmp_path):
    """A zombie (killed, its parent has not waited for it yet) runs nothing more."""
    proc = subprocess.Popen([sys.executable, "-c",
                             "import json, sys, time\n"
                             f"sys.path.insert(0, {str(TESTS.parent)!r})\n"
                             "from scamp_jax.hpo.study.owner import identity\n"
                             "print(json.dumps(identity()), flush=True)\n"
                             "time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    other = json.loads(proc.stdout.readline())
    assert other["pid"] == proc.pid and not ended(other)
    proc.kill()
    deadline = time.monotonic() + 10
    while not ended(other) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended(other), "a zombie counts as ended"
    proc.wait()
    assert ended(other)


def test_only_a_process_certainly_gone_has_ended():
    me = identity()
    assert me is not None and not ended(me)
    # its pid reused by a later process: the one recorded has ended
    assert ended({**me, "start": me["start"] - 1})
    assert ended({**me, "pid": _a_free_pid()})
    # one this process cannot see: another host, another boot, another PID namespace
    # (or another user's: a /proc mounted with hidepid shows this process none of theirs)
    for key in ("host", "boot", "pid_namespace", "time_namespace", "uid"):
        assert not ended({**me, key: "elsewhere", "pid": _a_free_pid()})
    # no record, or one it cannot read
    for record in (None, "1234", {}, {**me, "pid": "x"}, {k: v for k, v in me.items()
                                                          if k != "start"}):
        assert not ended(record)


def _a_free_pid() -> int:
    """A pid no process has now (that of a child that has ended and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not Path(f"/proc/{proc.pid}").exists()
    return proc.pid


#: a process that prints its `identity` and stays until it is killed
IDENTIFY = ("import json, sys, time\n"
            f"sys.path.insert(0, {str(TESTS.parent)!r})\n"
            "from scamp_jax.hpo.study.owner import identity\n"
            "print(json.dumps(identity()), flush=True)\n"
            "time.sleep(600)")


def _identify_in(*unshare: str) -> tuple[subprocess.Popen, object]:
    """A process in namespaces of its own (``unshare ARGS``; root), and its `identity`."""
    import shutil

    if shutil.which("unshare") is None:
        pytest.skip("no unshare (util-linux)")
    # --kill-child: the process in the namespaces ends with unshare (killed after the test)
    proc = subprocess.Popen(["unshare", *unshare, "--kill-child", sys.executable, "-c", IDENTIFY],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        pytest.skip(f"unshare {' '.join(unshare)} is not allowed here: {proc.stderr.read()}")
    return proc, json.loads(line)


def test_a_process_whose_proc_is_another_pid_namespaces_records_no_process():
    """``unshare --pid`` without ``--mount-proc``: the process is pid 1 of its namespace while
    ``/proc`` shows the namespace outside, where pid 1 is another process. It records nothing
    (its trials are left to the heartbeat) rather than a process that is not itself."""
    proc, recorded = _identify_in("--pid")
    try:
        assert recorded is None
    finally:
        proc.kill()
        proc.wait()


def test_a_process_in_another_time_namespace_is_not_taken_for_ended():
    """A time namespace shifts the start times ``/proc`` shows: seen from outside, a live
    process in one started at another time, which would read as its pid reused."""
    proc, recorded = _identify_in("--time", "--boottime", "100000")
    try:
        assert isinstance(recorded, dict) and not ended(recorded)
        assert recorded["time_namespace"] != identity()["time_namespace"]
    finally:
        proc.kill()
        proc.wait()


def test_a_trial_its_own_process_failed_meanwhile_is_not_retried(tmp_path, monkeypatch):
    """The owner fails its trial itself (its loss went NaN, say) and exits, after another
    process listed the running trials and before it found the owner gone: that trial failed
    for a reason of its own, and is not retried. (The interleaving is made by hand: the
    owner's tell is made inside the check that finds it ended.)"""
    from test_study import source

    from scamp_jax.hpo.study import owner

    first = source(tmp_path, 2, heartbeat=20)
    asked = first.ask()

    def ended_having_failed_its_trial(record: object) -> bool:
        first.study.tell(asked.number, state=TrialState.FAIL)
        return True

    monkeypatch.setattr(owner, "ended", ended_having_failed_its_trial)
    second = source(tmp_path, 2, heartbeat=20)
    assert second.recovered == []
    assert second.study.get_trials(states=(TrialState.WAITING,)) == []
    assert second.study.get_trials()[asked.number].state == TrialState.FAIL
    first.close()
    second.close()


def test_a_trial_whose_process_could_not_be_stored_is_still_asked(tmp_path, monkeypatch,
                                                                   caplog):
    """Storing the trial's process is a help, not a condition: where the storage refuses it
    (made here: a write that raises), the trial is asked and runs, and the heartbeat is what
    finds its process ended."""
    import logging

    from test_study import source

    src = source(tmp_path, 2)
    storage = src._storage
    store = storage.set_trial_user_attr

    def refuse_the_owner(trial_id: int, key: str, value: object) -> None:
        if key == OWNER:
            raise OSError("disk I/O error")
        store(trial_id, key, value)

    monkeypatch.setattr(storage, "set_trial_user_attr", refuse_the_owner)
    with caplog.at_level(logging.WARNING, logger="scamp_jax.hpo.study.source"):
        asked = src.ask()
    assert isinstance(asked, AskedTrial)
    assert OWNER not in src.study.get_trials()[asked.number].user_attrs
    assert f"trial {asked.number}: its process was not stored (OSError: disk I/O error)" in (
        caplog.text)
    src.tell(TrialOutcome(asked.number, "complete", value=1.0))
    src.close()
