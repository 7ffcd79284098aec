"""Compile once, run many: the training-step executables trials of one architecture share.

Trials of one architecture differ only in data (the seed, the optimizer's hyperparameters live in
its state), so what they compile is the same program. `ExecutableCache` holds the training
step's executable per program (the fingerprint of its lowering) and devices: the planner's own
run-grade executable (`Plan.compiled_step`) is taken when it is the same program on the same
devices; otherwise the first trial on those devices compiles it and later ones run it. (Their
initial states are compiled once per architecture too:
`scamp_jax.planning.initial_state.InitialStates`.)

An XLA executable is bound to the devices it was compiled for, so the cache keys by device ids.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import jax

PyTree = Any

def lowered_fingerprint(lowered: jax.stages.Lowered) -> str:
    """SHA-256 of a lowered program's text (without source locations)."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


class ExecutableCache:
    """Compiled training steps by program fingerprint and devices (thread-safe).

    ``hits`` counts the runs that compiled nothing (the planner's executable or an earlier
    trial's), ``misses`` the compiles.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._key_locks: dict[tuple[str, tuple[int, ...]], threading.Lock] = {}
        self._compiled: dict[tuple[str, tuple[int, ...]], Any] = {}
        self.hits = 0
        self.misses = 0

    def compiled(self, lowered: jax.stages.Lowered, device_ids: tuple[int, ...],
                 ready: Any = None) -> Any:
        """The executable of ``lowered`` on ``device_ids``: ``ready`` (a `CompiledStep`) when it
        is the same program on the same devices, else a cached or a new compile (default XLA
        options). Trials of one program on the same devices wait for one compile."""
        fingerprint = lowered_fingerprint(lowered)
        key = (fingerprint, tuple(device_ids))
        with self._lock:
            if key in self._compiled:
                self.hits += 1
                return self._compiled[key]
            if (ready is not None and ready.fingerprint == fingerprint
                    and tuple(ready.device_ids) == key[1]):
                self.hits += 1
                self._compiled[key] = ready.executable
                return ready.executable
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._compiled:
                    self.hits += 1
                    return self._compiled[key]
            executable = lowered.compile()
            with self._lock:
                self.misses += 1
                self._compiled[key] = executable
            return executable
