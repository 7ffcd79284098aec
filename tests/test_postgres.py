"""A study in a real PostgreSQL server, shared by two processes.

The test starts its own server (Debian's ``postgresql`` package: ``initdb`` and ``pg_ctl`` in a
temporary directory, as the ``postgres`` user when the tests run as root) and needs the
``postgres`` extra (``pip install scamp-jax[postgres]``); without either it is skipped and says
which one is missing.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState
from test_resume import _start


def _pg_bin(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """URL of a fresh PostgreSQL server on 127.0.0.1 (stopped and removed afterwards)."""
    pytest.importorskip("psycopg", reason="the postgres extra is not installed: "
                        "pip install scamp-jax[postgres]")
    initdb, pg_ctl = _pg_bin("initdb"), _pg_bin("pg_ctl")
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql)")
    as_user: list[str] = []
    if os.getuid() == 0:  # the server refuses to run as root
        runuser = shutil.which("runuser")
        try:
            import pwd

            owner = pwd.getpwnam("postgres")
        except KeyError:
            owner = None
        if runuser is None or owner is None:
            pytest.skip("running as root without a 'postgres' user and runuser to start "
                        "PostgreSQL as")
        as_user = [runuser, "-u", "postgres", "--"]
    data = Path(tempfile.mkdtemp(prefix="scamp-pg-"))
    if as_user:
        os.chown(data, owner.pw_uid, owner.pw_gid)
    port = _free_port()
    log = data / "server.log"
    subprocess.run([*as_user, initdb, "-D", str(data / "db"), "-A", "trust", "-U", "scamp"],
                   check=True, capture_output=True, timeout=120)
    subprocess.run([*as_user, pg_ctl, "-D", str(data / "db"), "-l", str(log), "-w", "-o",
                    f"-p {port} -k {data} -c listen_addresses=127.0.0.1", "start"],
                   check=True, capture_output=True, timeout=120)
    try:
        yield f"postgresql://scamp@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", str(data / "db"), "-m", "immediate", "stop"],
                       capture_output=True, timeout=120)
        shutil.rmtree(data, ignore_errors=True)


@pytest.mark.slow  # run with -m slow (README: Tests)
def test_two_processes_share_a_postgresql_study(tmp_path, postgres_url):
    study_dir = tmp_path / "study"  # checkpoints and results; the study is in the server
    procs = [_start(study_dir, trials=4, steps=60, storage=postgres_url) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for proc, out in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out
        assert "Traceback" not in out, out
    assert not (study_dir / "study.db").exists()
    [summary] = optuna.get_all_study_summaries(postgres_url)
    trials = optuna.load_study(study_name=summary.study_name, storage=postgres_url).get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3], [(t.number, t.state) for t in trials]
    assert all(t.state == TrialState.COMPLETE for t in trials), [t.state for t in trials]
    assert len({t.user_attrs["checkpoint_key"] for t in trials}) == 4
    assert len({tuple(sorted(t.params.items())) for t in trials}) == 4
