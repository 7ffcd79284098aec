"""Which process runs a trial, told so that another process on the same machine can see it end.

Optuna's heartbeat finds a dead process's trials from any host, but only once the grace period
has passed (a minute by default): a study killed and run again at once would wait that long with
its devices idle. A trial therefore also records its process (`OWNER`: host name, the kernel's
boot id, the PID and time namespaces, the user, the pid and the process's start time, all from
Linux's ``/proc``). A process of the study that sees the same host, boot and namespaces, run by
the same user (``/proc`` may hide other users' processes: ``hidepid``), can tell for certain that
the owner has ended: no process of that pid runs, or one that started at another time (the pid
was reused), or only its zombie is left. Its trials are then failed and queued again at once
(`scamp_jax.hpo.study.OptunaTrialSource`). Anything less certain (another host or container, no
``/proc``, a ``/proc`` of another PID namespace than the process's own, a record it cannot read)
leaves the trial to the heartbeat: a live process's trial is never taken from it. (A process's
start time in ``/proc`` is shifted by the reader's time namespace, hence that namespace too.
Two cases would still read as ended, neither of which a Python process running trials is: one
whose main thread ended while its other threads run, and one ``/proc`` hides from its own user,
``hidepid`` with a process not dumpable.)
"""

from __future__ import annotations

import functools
import os
import socket
from pathlib import Path
from typing import Any

#: trial user attribute naming the process that runs it (`identity`)
OWNER = "process"

#: the parts of an `identity` that say the process ran where this one can see it
_SAME_PLACE = ("host", "boot", "pid_namespace", "time_namespace", "uid")


def _stat(pid: int) -> tuple[str, int]:
    """``(state, start time in clock ticks after boot)`` of process ``pid`` (``/proc``)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2:].split()  # the name, in brackets, may hold spaces
    return fields[0], int(fields[19])  # fields 3 and 22 of proc(5)


@functools.cache
def _place() -> dict[str, str] | None:
    """Where this process runs, as `ended` compares it; None where ``/proc`` cannot tell:
    none (not Linux), or one mounted for another PID namespace (``unshare --pid`` without
    ``--mount-proc``), whose pids are not this process's."""
    try:
        if os.readlink("/proc/self") != str(os.getpid()):
            return None
        try:
            time_namespace = os.readlink("/proc/self/ns/time")
        except FileNotFoundError:  # a kernel before time namespaces (5.6): one for all
            time_namespace = ""
        return {"host": socket.gethostname(),
                "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                "pid_namespace": os.readlink("/proc/self/ns/pid"),
                "time_namespace": time_namespace, "uid": str(os.getuid())}
    except OSError:  # no /proc
        return None


def identity() -> dict[str, Any] | None:
    """This process, as `ended` checks it from another process (None: no ``/proc``)."""
    place = _place()
    if place is None:
        return None
    pid = os.getpid()  # not cached: a forked child is another process
    try:
        return {**place, "pid": pid, "start": _stat(pid)[1]}
    except (OSError, ValueError, IndexError):
        return None


def ended(owner: Any) -> bool:
    """Whether the process ``owner`` (an `identity`, as stored) has certainly ended: it ran on
    this host, kernel boot, PID and time namespaces, as this process's user, and no process of
    its pid and start time runs (a zombie has ended). False wherever that is not certain."""
    here = _place()
    if here is None or not isinstance(owner, dict):
        return False
    if any(owner.get(key) != here[key] for key in _SAME_PLACE):
        return False
    try:
        pid, start = int(owner["pid"]), int(owner["start"])
    except (KeyError, TypeError, ValueError):
        return False
    try:
        state, started = _stat(pid)
    except FileNotFoundError:
        return True  # no such process
    except (OSError, ValueError, IndexError):
        return False
    return started != start or state in ("Z", "X")
