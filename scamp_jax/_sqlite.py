"""SQLite files the package writes (a study's ``study.db``, a plan cache's ``plans.sqlite``):
opened in write-ahead-log mode, synced at checkpoints.

With SQLite's default rollback journal every commit waits for the disk (15-25 ms on a 2-core
test host); a study's record of one trial is a few dozen commits through Optuna's API, so
telling a trial cost more than training a small one. In WAL mode with ``synchronous=NORMAL`` a
commit is an append: a process that is killed loses nothing committed, and a power cut can lose
at most the last commits, never the file's consistency. The mode stays with the file (Optuna,
the dashboard and ``sqlite3`` read it as usual). Processes sharing such a file must run on one
host, which a study on SQLite assumes anyway: several hosts share a study through a database
server (``storage=``).
"""

from __future__ import annotations

import sqlite3
from typing import Any

#: SQLite's words for a write the disk refused (a full disk, a failing one): the plan cache
#: skips such a store, and a command line says it of a study's database.
DISK_REFUSED = ("database or disk is full", "disk I/O error")


def write_ahead(connection: Any) -> None:
    """Switch a new DB-API SQLite ``connection`` to WAL with ``synchronous=NORMAL``.

    A connection that cannot switch the mode (another process holds the file) keeps SQLite's
    defaults: correctness does not depend on the mode.
    """
    cursor = connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        row = cursor.fetchone()
        if row is not None and str(row[0]).lower() == "wal":
            cursor.execute("PRAGMA synchronous=NORMAL")
    except sqlite3.OperationalError:
        pass  # busy: the file keeps its current mode
    finally:
        cursor.close()
