"""Compile once, run many: the training-step executables trials of one architecture share.

Trials of one architecture differ only in data (the seed, the optimizer's hyperparameters live in
its state), so what they compile is the same program. `ExecutableCache` holds the training
step's executable per program (the fingerprint of its lowering) and devices: the planner's own
run-grade executable (`Plan.compiled_step`) is taken when it is the same program on the same
devices; otherwise the first trial on those devices compiles it and later ones run it. (Their
initial states are traced once per architecture and computed without a compile:
`scamp_jax.planning.initial_state.InitialStates`.)

An XLA executable is bound to the devices it was compiled for, so the cache keys by device ids.
On CPU the same machine code serves any device: a program already compiled for other CPU devices
(the planner's, or another trial's) is loaded onto the trial's devices (`load_on_devices`)
instead of being compiled for them. Only a program this process compiled moves: XLA's CPU
executables lose functions when one that was itself read back (from the persistent compilation
cache, `scamp_jax.planning.compile_cache`, or moved) is serialized again (jax 0.12: "Function
... not found" at its first run), so every compile of the project goes through
`compile_lowered`, which remembers those, and `load_on_devices` declines them (the trial
compiles, or finds its own devices' program in the persistent cache, which keys a CPU program
by its devices). In the main job a SwinIR step or evaluation chunk loads in 0.4-0.5 s where its
compile took 1-15 s (benchmarks/notes/main-job.md). JAX has no public way to do this:
`jax.experimental.serialize_executable.deserialize_and_load` loads onto the devices the
executable was compiled for.

`home_mesh` is the host CPU mesh that initial states are made on
(`scamp_jax.planning.initial_state`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import re
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import serialize_executable
from jax.sharding import Mesh
from jaxlib import xla_client

from scamp_jax._once import OncePerKey
from scamp_jax.planning.compile_events import CACHE_HIT_EVENT
from scamp_jax.planning.compile_options import without_default_kernels
from scamp_jax.planning.compile_slots import compile_slot

PyTree = Any
log = logging.getLogger(__name__)

#: platforms whose executables `load_on_devices` moves (checked bit for bit in the tests).
MOVABLE_PLATFORMS = ("cpu",)
#: `jax.monitoring` duration event of each executable `load_on_devices` loads (no compile
#: event is recorded for it; `scamp_jax.hpo.overhead` reports these).
EXECUTABLE_LOAD_EVENT = "/scamp_jax/executable/load"


def lowered_fingerprint(lowered: jax.stages.Lowered) -> str:
    """SHA-256 of a lowered program's text (without source locations)."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


def _moving_unpickler() -> type | None:
    """The unpickler class `load_on_devices` reads a serialized executable with (None: this JAX
    has no such private base class; trials then compile on their own devices)."""
    global _MOVING_UNPICKLER
    if _MOVING_UNPICKLER is not None:
        return _MOVING_UNPICKLER or None
    base = getattr(serialize_executable, "_JaxPjrtUnpickler", None)  # JAX private: see below
    if base is None:
        _MOVING_UNPICKLER = False
        return None

    class MovingUnpickler(base):  # type: ignore[misc, valid-type]
        """Reads `jax.experimental.serialize_executable.serialize`'s output with every device
        replaced by its counterpart in ``mapping`` and the executable loaded there.

        Private part of JAX, a last resort: ``deserialize_and_load`` takes the devices to load
        onto but looks up the shardings' devices by their original ids, so it cannot move an
        executable; this subclass keeps its pickle protocol (``('exec', bytes)``, ``('device',
        id)``, ``('client',)``) and only changes the devices and the executable's device
        assignment (an override PJRT's ``deserialize_executable`` takes: ``compile_options``).
        Any failure of it (another JAX) makes `load_on_devices` return None: the trial compiles.
        """

        def __init__(self, file: io.BytesIO, mapping: dict[int, jax.Device],
                     assigned: Sequence[int]) -> None:
            targets = list(mapping.values())
            super().__init__(file, targets[0].client, targets)
            self.devices_by_id = dict(mapping)
            #: the target of each partition of the executable, in its device assignment's order
            self.assigned = [mapping[i].id for i in assigned]

        def persistent_load(self, pid: Any) -> Any:
            if pid[0] != "exec":
                return super().persistent_load(pid)
            # What JAX compiles with `jax.jit`: one replica, one partition per device. Loading
            # compiles nothing, so the device assignment is the only option that matters here.
            options = xla_client.CompileOptions()
            options.num_replicas, options.num_partitions = 1, len(self.assigned)
            options.device_assignment = xla_client.DeviceAssignment.create(
                np.asarray([self.assigned]))
            return self.backend.deserialize_executable(
                pid[1], executable_devices=self.execution_devices, compile_options=options)

    _MOVING_UNPICKLER = MovingUnpickler
    return MovingUnpickler


#: the class `_moving_unpickler` made (False: none can be made with this JAX; None: not yet).
_MOVING_UNPICKLER: Any = None


def host_cpu_devices() -> list[jax.Device]:
    """This process's CPU devices; none where JAX started without its CPU backend (e.g.
    ``JAX_PLATFORMS=cuda``, which leaves it out)."""
    try:
        return list(jax.local_devices(backend="cpu"))
    except RuntimeError:  # "Unknown backend cpu requested, but no platforms ... are present"
        return []


def home_mesh(mesh: Mesh) -> Mesh:
    """The host CPU mesh that programs and initial states for ``mesh`` are made on: on CPU
    devices the platform's first devices in ``mesh``'s shape (one host's memory: moving a
    program or a state there is local), elsewhere the host's first CPU device, every axis of
    size 1 (`scamp_jax.planning.initial_state`); ``mesh`` itself where JAX has no CPU backend
    (`host_cpu_devices`), so the state is made on the run's own devices."""
    host = host_cpu_devices()
    if not host:
        return mesh
    size = mesh.devices.size
    if mesh.devices.flat[0].platform == "cpu" and len(host) >= size:
        home = np.asarray(host[:size], dtype=object).reshape(mesh.devices.shape)
    else:
        home = np.asarray(host[:1], dtype=object).reshape((1,) * mesh.devices.ndim)
    return Mesh(home, mesh.axis_names, axis_types=mesh.axis_types)


#: Executables read back rather than compiled here: JAX's persistent-cache hits and
#: `load_on_devices`' results. Weak: an executable nothing else holds any more (a finished
#: architecture's) is freed, device memory and all, and leaves the set.
_READ_BACK: weakref.WeakSet[jax.stages.Compiled] = weakref.WeakSet()
_read_back_lock = threading.Lock()
_hits = threading.local()
_listening = False
#: a compile retried without Triton matrix products was said at warning level (once a process)
_retry_said = False


def _count_cache_hit(event: str, **kwargs: Any) -> None:
    if event == CACHE_HIT_EVENT:  # recorded in the thread that asked for the compile
        _hits.count = getattr(_hits, "count", 0) + 1


def _mark_read_back(compiled: jax.stages.Compiled) -> None:
    with _read_back_lock:
        _READ_BACK.add(compiled)


def read_back(compiled: jax.stages.Compiled) -> bool:
    """Whether ``compiled`` was read back (from the persistent cache, or moved) rather than
    compiled by this process (`compile_lowered`): itself, or another ``Compiled`` around the
    same runtime executable (JAX hands a second compile of a lowering already compiled the
    executable it keeps, in a new wrapper, with no cache event)."""
    runtime = compiled.runtime_executable()
    with _read_back_lock:
        return compiled in _READ_BACK or any(
            marked.runtime_executable() is runtime for marked in _READ_BACK)


def compile_lowered(lowered: jax.stages.Lowered,
                    options: dict[str, Any] | None = None) -> jax.stages.Compiled:
    """``lowered.compile(options)`` in one of the study's compile slots
    (`scamp_jax.planning.compile_slots`), remembering an executable JAX read back from the
    persistent compilation cache instead of compiling it (`read_back`). Every compile of the
    project goes through here. A GPU compile in which a fusion got no default kernel
    configuration is compiled again without Triton matrix products
    (`scamp_jax.planning.compile_options.without_default_kernels`)."""
    global _listening
    if not _listening:
        with _read_back_lock:
            if not _listening:
                jax.monitoring.register_event_listener(_count_cache_hit)
                _listening = True
    before = getattr(_hits, "count", 0)
    with compile_slot():
        try:
            compiled = lowered.compile(options)
        except jax.errors.JaxRuntimeError as err:
            retry = without_default_kernels(options, err)
            if retry is None:
                raise
            global _retry_said
            with _read_back_lock:
                first, _retry_said = not _retry_said, True
            log.log(logging.WARNING if first else logging.DEBUG,
                    "XLA found no default kernel for %s of this GPU compile; compiling it again "
                    "with cuBLAS matrix products instead of Triton's%s", _fusions_without(err),
                    " (later compiles that do the same say so at debug level)" if first else "")
            compiled = lowered.compile(retry)
    if getattr(_hits, "count", 0) != before:
        _mark_read_back(compiled)
    return compiled


def _fusions_without(err: BaseException) -> str:
    """Which of XLA's fused kernels ``err`` says got no configuration: "2 of 25 matrix-product
    kernels" from XLA's "Failed to get configs for: 2 out of 25 instructions", else "a
    matrix-product kernel"."""
    found = re.search(r"Failed to get configs for: (\d+) out of (\d+) instructions", str(err))
    return (f"{found[1]} of {found[2]} matrix-product kernels" if found
            else "a matrix-product kernel")


def load_on_devices(compiled: jax.stages.Compiled, source_ids: Sequence[int],
                    devices: Sequence[jax.Device]) -> jax.stages.Compiled | None:
    """``compiled`` (compiled for the devices ``source_ids``, in mesh order) loaded onto
    ``devices`` (the same count, in the same order) without compiling: the same machine code,
    its shardings and device assignment moved device for device, so it computes what it
    computed there, bit for bit.

    None where that is not possible: another platform than `MOVABLE_PLATFORMS`, other
    devices than the source's counterparts, an executable JAX cannot serialize (closed-over
    constants, host callbacks), or one that was itself read back (`read_back`: XLA serializes
    those again without all their functions).
    """
    start = time.perf_counter()
    devices = list(devices)
    if (len(devices) != len(source_ids) or not devices
            or any(d.platform not in MOVABLE_PLATFORMS for d in devices)):
        return None
    unpickler = _moving_unpickler()
    if unpickler is None or read_back(compiled):
        return None
    try:
        payload, in_tree, out_tree = serialize_executable.serialize(compiled)
        mapping = {int(i): d for i, d in zip(source_ids, devices, strict=True)}
        executable = compiled.runtime_executable()
        assert executable is not None  # `MOVABLE_PLATFORMS`' executables have one
        # a one-process CPU executable's local devices: its device assignment's order
        assigned = [d.id for d in executable.local_devices()]
        if executable.client is not devices[0].client or sorted(assigned) != sorted(mapping):
            return None
        unloaded, args_info, no_kwargs = unpickler(io.BytesIO(payload), mapping,
                                                   assigned).load()
        # as ``serialize_executable.deserialize_and_load`` makes its `jax.stages.Compiled`
        moved = jax.stages.Compiled(unloaded.load(), [], in_tree.unflatten(args_info),
                                    out_tree, no_kwargs=no_kwargs)
    except Exception as err:  # noqa: BLE001 - loading is an aid: the trial compiles instead
        log.info("executable not moved to devices %s: %s", [d.id for d in devices], err)
        return None
    _mark_read_back(moved)
    jax.monitoring.record_event_duration_secs(EXECUTABLE_LOAD_EVENT,
                                              time.perf_counter() - start)
    return moved


class ExecutableCache:
    """Compiled training steps by program fingerprint and devices (thread-safe).

    ``hits`` counts the runs that compiled nothing (the planner's executable or an earlier
    trial's, on their devices or loaded onto the run's: ``moves`` of them), ``misses`` the
    compiles.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: (executable, how it came: "ready", "moved" or "compiled") by (fingerprint, devices)
        self._compiled: OncePerKey[tuple[Any, str]] = OncePerKey()
        self.hits = 0
        self.moves = 0
        self.misses = 0

    def compiled(self, lowered: jax.stages.Lowered, devices: Sequence[jax.Device],
                 ready: Any = None) -> Any:
        """The executable of ``lowered`` on ``devices`` (in mesh order): ``ready`` (a
        `CompiledStep`) when it is the same program on the same devices, else a cached one,
        one of the same program on other devices loaded onto these (`load_on_devices`), or a
        new compile (default XLA options). Trials of one program on the same devices wait for
        one compile."""
        devices = list(devices)
        fingerprint = lowered_fingerprint(lowered)
        key = (fingerprint, tuple(d.id for d in devices))
        if ready is not None and ready.fingerprint != fingerprint:
            ready = None

        def make() -> tuple[Any, str]:
            if ready is not None and tuple(ready.device_ids) == key[1]:
                return ready.executable, "ready"
            sources = [(ids, executable) for (fp, ids), (executable, _) in
                       self._compiled.items() if fp == fingerprint]
            if ready is not None:
                sources.insert(0, (tuple(ready.device_ids), ready.executable))
            for ids, source in sources:
                moved = load_on_devices(source, ids, devices)
                if moved is not None:
                    return moved, "moved"
            return compile_lowered(lowered), "compiled"

        (executable, how), made = self._compiled.get(key, make)
        with self._lock:
            if made and how == "compiled":
                self.misses += 1
            else:
                self.hits += 1
                self.moves += made and how == "moved"
        return executable
