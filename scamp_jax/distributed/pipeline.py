"""The supernet pipeline across MPI ranks: one stage per rank, activations moved by mpi4jax.

`MPIPipelineExecutor` is a drop-in for `scamp_jax.pipeline.executor.PipelineExecutor` (same
``init_state`` / ``run`` / ``export`` / ``resident_bytes``), so ``train_supernet(...,
executor=MPIPipelineExecutor(...))`` trains through a pipeline whose stages live in different
processes, typically on different hosts (`train_supernet_mpi` does that after
`check_ranks_pass_the_same`: ranks that pass other subnets would wait for each other forever):

- rank ``s`` owns stage ``s`` on its first local device (one process per host or per GPU);
- every tick each rank runs the very same per-stage function as the single-process executor
  (`scamp_jax.pipeline.stage.stage_tick`, the stage index a traced value in both), then sends its
  activation to rank ``s + 1`` and its input gradient to rank ``s - 1`` with ``mpi4jax`` in a
  second jitted program, where the single-process executor uses ``lax.ppermute``;
- losses live on the last rank and are broadcast; `export` gathers every stage's weights, so
  every rank returns the same `TrainResult` (same ``params_sha256`` as the single-process run).

A rank that dies (its process ends without ``MPI_Finalize``) makes ``mpirun`` abort every other
rank (Open MPI's default), so a broken pipeline stops instead of hanging in a receive. A rank
whose Python code raises (a bug, an out-of-memory on its device, a signal to that process alone)
is another matter: it would still finalize MPI as it exits, leaving the others waiting in their
next receive. `train_supernet_mpi` runs inside `failures_end_every_rank`
(`scamp_jax.distributed.failures_end_every_rank`), and `MPIPipelineExecutor.run` ends the job
on an exception in its ticks: the failing rank prints ``rank R failed: ...`` and aborts the job
(``MPI_Abort``). Code of your own that every rank runs between collectives (drawing the
batches, building the executor, anything around `train_supernet`) belongs inside ``with
failures_end_every_rank(comm):`` too.

Used directly (``train_supernet(..., executor=functools.partial(MPIPipelineExecutor,
comm=comm))``), the executor compares digests of what the ranks pass it (the starting weights
in ``init_state``; the tick program and the batches in ``run``) and raises the same
`ValueError` on every rank where they differ; `train_supernet_mpi` compares every argument
before anything is built (`check_ranks_pass_the_same`).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from scamp_jax.distributed.mpi import (
    end_every_rank,
    failures_end_every_rank,
    import_mpi4jax,
    import_mpi4py,
)
from scamp_jax.pipeline.executor_base import DEVICE_KIND, StageExecutor, StageSizes, memory_stats
from scamp_jax.pipeline.model import StageModel
from scamp_jax.pipeline.program import NUM_FIELDS, TickProgram
from scamp_jax.pipeline.stage import State, receive, stage_tick
from scamp_jax.pipeline.trainer import (
    SupernetState,
    TrainOptions,
    TrainResult,
    train_supernet,
)

# Message tags of the two shifts of a tick, so an activation can never be taken for a gradient.
_ACT_TAG, _GRAD_TAG = 11, 12


class MPIPipelineExecutor(StageExecutor):
    """One pipeline stage per MPI rank; the same tick program as `PipelineExecutor`.

    The state holds this rank's stage only: the single-process state without its leading stage
    axis. ``run``, ``export`` and ``resident_bytes`` are collective (every rank calls them) and
    return the same values on every rank.

    Args:
      layout: the supernet's flat-weight layout (identical on every rank).
      comm: mpi4py communicator of the pipeline (default ``MPI.COMM_WORLD``).
      device: this rank's device (default its first local device).
      **sizes: `StageSizes`, as for `PipelineExecutor`; ``num_stages`` (S) must equal the
        communicator's size (rank = stage).
    """

    def __init__(
        self,
        layout: StageModel,
        *,
        comm: Any = None,
        device: Any = None,
        **sizes: Unpack[StageSizes],
    ):
        mpi = import_mpi4py()
        comm = mpi.COMM_WORLD if comm is None else comm
        num_stages = sizes["num_stages"]
        if comm.Get_size() != num_stages:
            raise ValueError(
                f"{num_stages=} but the communicator has {comm.Get_size()} ranks; the MPI "
                f"pipeline puts one stage on each rank: launch with mpirun -n {num_stages}"
            )
        super().__init__(layout, **sizes)
        self._mpi4jax = import_mpi4jax()
        self.comm = comm
        # mpi4jax's messages travel on their own communicator so that host-side collectives of
        # this class (loss broadcast, export) can never match one of them.
        self._jax_comm = comm.Clone()
        self.rank = comm.Get_rank()
        self.device = jax.local_devices()[0] if device is None else device
        self._tick = self._compile()
        # Stage steps `compiled_memory` built, per (input shape, target shape), run by `tick` on
        # arrays of those shapes. The exchange keeps its jitted function: a compiled program
        # with mpi4jax's ordered effects wants the effect token jit passes for it (jax 0.10.2).
        self._compiled: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}

    # -- this rank's stage and the collectives over all of them -------------------------------
    def _sharding(self, kind: str = DEVICE_KIND) -> SingleDeviceSharding:
        return SingleDeviceSharding(self.device, memory_kind=kind)

    @property
    def _stage_prefix(self) -> tuple[int, ...]:
        return ()

    def _local(self, per_stage: np.ndarray) -> np.ndarray:
        return per_stage[self.rank]

    def _gather_stages(self, local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        stages = self.comm.allgather(local)
        return {k: np.stack([s[k] for s in stages]) for k in local}

    def _sum_over_stages(self, counts: dict[str, int]) -> dict[str, int]:
        return {k: int(self.comm.allreduce(v)) for k, v in counts.items()}

    @property
    def closed(self) -> bool:
        """Whether `close` released the pipeline's communicator (the executor runs no more)."""
        return self._jax_comm is None

    def close(self) -> None:
        """Free the communicator the stages' messages travel on (collective; idempotent)."""
        if self._jax_comm is not None:
            self._jax_comm.Free()
            self._jax_comm = None

    def init_state(
        self, blocks: np.ndarray, shared: np.ndarray,
        optimizer_state: dict[str, np.ndarray] | None = None,
    ) -> State:
        """`StageExecutor.init_state` (collective): first every rank compares digests of the
        weights and optimizer state it passes; where they differ, every rank raises the same
        `ValueError` (each would train its stage from its own weights)."""
        _check_ranks_agree(self.comm, {
            "the starting weights": _digest([np.asarray(blocks), np.asarray(shared)]),
            "the starting optimizer state": _digest(optimizer_state),
        })
        return super().init_state(blocks, shared, optimizer_state)

    def run(self, state: State, program: TickProgram, lr_data: np.ndarray, hr_data: np.ndarray,
            on_tick: Callable[[int, int], None] | None = None) -> tuple[State, np.ndarray]:
        """`StageExecutor.run` (collective). First every rank compares digests of the tick
        program and the batches it passes: where they differ, every rank raises the same
        `ValueError` (ranks running other programs would wait for each other's messages, or
        mix their results). Then an exception on one rank (``on_tick`` included; a stop such as
        Ctrl-C is left to the caller) ends the job (`end_every_rank`) instead of leaving the
        others waiting in a receive."""
        if self._jax_comm is None:
            raise RuntimeError("this MPIPipelineExecutor was closed (its communicator is "
                               "freed); build another one, or pass train_supernet a factory")
        _check_ranks_agree(self.comm, {
            "the tick program (the subnets or the schedule)": _digest(
                [program.table, program.layers_per_stage, program.window_slots,
                 program.act_slots, program.grad_slots, program.prefetch_ahead]),
            "the LR batches": _digest(np.asarray(lr_data)),
            "the HR batches": _digest(np.asarray(hr_data)),
        })
        self._check_program(program, lr_data)  # alike on every rank: raised, not an abort
        try:
            return super().run(state, program, lr_data, hr_data, on_tick)
        except Exception as err:
            # A failure, not a stop: a Ctrl-C reaches every rank, and the caller's guard says
            # what of its job a stop keeps (a checkpoint, or nothing: `train_supernet_mpi`).
            end_every_rank(self.comm, err)
            raise

    def _last_stage_losses(self, losses: list[jax.Array]) -> np.ndarray:
        last_rank = self.spec.num_stages - 1
        mine = np.asarray(jnp.stack(losses)) if self.rank == last_rank else None
        return self.comm.bcast(mine, root=last_rank)

    # -- compiled tick ----------------------------------------------------------------------
    def _exchange(self, act_out: jax.Array, grad_out: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Activations one rank up, gradients one rank down; zeros where nothing arrives
        (what ``lax.ppermute`` delivers to a stage without a source)."""
        m4j, comm, rank, last = self._mpi4jax, self._jax_comm, self.rank, self.spec.num_stages - 1
        act_in, grad_in = jnp.zeros_like(act_out), jnp.zeros_like(grad_out)
        if last == 0:
            return act_in, grad_in
        # Each shift is a chain that ends at a rank which only receives, so blocking sends and
        # sendrecv in the middle cannot deadlock; the two shifts use different tags.
        if rank == 0:
            m4j.send(act_out, 1, tag=_ACT_TAG, comm=comm)
            grad_in = m4j.recv(grad_in, 1, tag=_GRAD_TAG, comm=comm)
        elif rank == last:
            act_in = m4j.recv(act_in, rank - 1, tag=_ACT_TAG, comm=comm)
            m4j.send(grad_out, rank - 1, tag=_GRAD_TAG, comm=comm)
        else:
            act_in = m4j.sendrecv(
                act_out, act_in, rank - 1, rank + 1, sendtag=_ACT_TAG, recvtag=_ACT_TAG, comm=comm
            )
            grad_in = m4j.sendrecv(
                grad_out, grad_in, rank + 1, rank - 1, sendtag=_GRAD_TAG, recvtag=_GRAD_TAG,
                comm=comm,
            )
        return act_in, grad_in

    def _compile(self) -> tuple[jax.stages.Wrapped, jax.stages.Wrapped]:
        spec, layout = self.spec, self.layout

        def compute(state: State, ins: jax.Array, lr: jax.Array, hr: jax.Array, stage: jax.Array):
            # ``stage`` is an argument, not a Python constant: the single-process executor's
            # stage index (``lax.axis_index``) is a runtime value too, so both programs keep the
            # same conditionals on it instead of one of them being specialised per stage.
            return stage_tick(layout, spec, stage, state, ins, lr, hr)

        def exchange(buffers: State, ins: jax.Array, act_out: jax.Array, grad_out: jax.Array):
            act_in, grad_in = self._exchange(act_out, grad_out)
            return receive(buffers, ins, act_in, grad_in)

        # Two programs: jax 0.10.2 fails to lower one function with both an ordered effect
        # (mpi4jax's calls) and outputs in host memory (the offloaded store) -- its output
        # memory kinds and results no longer line up -- so the messages and the receive run in
        # a second, device-only program over the activation/gradient buffers.
        sh = self.state_shardings()
        compute_jit = jax.jit(
            compute,
            out_shardings=(sh, self._sharding(), self._sharding(), self._sharding()),
            donate_argnums=(0,),
        )
        exchange_jit = jax.jit(exchange, donate_argnums=(0,))
        return compute_jit, exchange_jit

    def _compile_memory(
        self, input_shape: tuple[int, ...], target_shape: tuple[int, ...]
    ) -> dict[str, int]:
        """`StageExecutor.compiled_memory` of this rank's stage (not collective).

        A tick here is two programs: the stage step (``compute``: the same `stage_tick` the
        single-process executor runs on each stage device) and the exchange of activations and
        gradients with the neighbouring ranks. ``argument``, ``output``, ``temp``, ``alias``
        and ``host_*`` are the stage step's, as `PipelineExecutor.compiled_memory` reports them
        for one stage device (its arguments hold one more int32: the stage index). What the
        single-process tick keeps as temporaries (the activation and gradient it sends) are
        outputs of the stage step here. ``exchange_bytes`` is what the device holds while the
        exchange runs: its own arguments, outputs and temporaries less what it aliases, plus the
        rest of the stage's state and the loss, which stay resident meanwhile.
        ``device_bytes`` is the larger of the two programs' figures: the most the tick holds in
        device memory at once.
        """
        # Abstract arguments take their memory space (host for the offloaded store) from a
        # NamedSharding only (jax 0.10.2), so lower on this device as a one-device mesh: the
        # executables accept the arrays of `_sharding` the run passes.
        mesh = Mesh(np.array([self.device]), ("rank",))

        def sds(shape: tuple[int, ...], dtype: Any, kind: str = DEVICE_KIND) -> Any:
            return jax.ShapeDtypeStruct(
                shape, dtype, sharding=NamedSharding(mesh, P(), memory_kind=kind)
            )

        state = jax.tree.map(
            lambda a, where: sds(a.shape, a.dtype, where.memory_kind), self.state_shapes(),
            self.state_shardings(),
        )
        ins = sds((NUM_FIELDS + 2 * self.spec.layers_per_stage,), np.int32)
        compute_jit, exchange_jit = self._tick
        compute = compute_jit.lower(
            state, ins, sds(input_shape, np.float32), sds(target_shape, np.float32),
            sds((), np.int32),
        ).compile()
        out_state, act_out, grad_out, loss = compute.out_info
        buffers = {"act": state["act"], "grad": state["grad"]}
        exchange = exchange_jit.lower(
            buffers, ins, sds(act_out.shape, act_out.dtype), sds(grad_out.shape, grad_out.dtype)
        ).compile()
        self._compiled[(tuple(input_shape), tuple(target_shape))] = compute
        out = memory_stats(compute)
        rest = {k: v for k, v in out_state.items() if k not in buffers}
        resident = sum(
            int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
            for leaf in jax.tree.leaves((rest, loss))
        )
        out["exchange_bytes"] = memory_stats(exchange)["device_bytes"] + resident
        out["device_bytes"] = max(out["device_bytes"], out["exchange_bytes"])
        return out

    def tick(
        self, state: State, row: np.ndarray, lr: np.ndarray, hr: np.ndarray
    ) -> tuple[State, jax.Array]:
        """One tick of this rank's stage (collective: every rank ticks together).

        Args:
          state: this stage's state (donated).
          row: (fields,) int32 instruction row of this stage.
          lr: (mb, h, w, 3) this stage's LR microbatch; hr: (mb, r h, r w, 3) its targets.
        Returns:
          ``(state, loss)``: loss is the microbatch loss of a backward on the last stage.
        """
        sh = self._sharding()
        ins = jax.device_put(np.asarray(row, np.int32), sh)
        compute, exchange = self._tick
        if lr.dtype == hr.dtype == np.float32:
            compute = self._compiled.get((lr.shape, hr.shape), compute)
        state, act_out, grad_out, loss = compute(
            state, ins, jax.device_put(lr, sh), jax.device_put(hr, sh),
            jax.device_put(np.int32(self.rank), sh),
        )
        buffers = exchange({"act": state["act"], "grad": state["grad"]}, ins, act_out, grad_out)
        return {**state, **buffers}, loss


def _digest(value: Any) -> str:
    """A short digest of an argument: arrays by shape, dtype and contents, containers by their
    items, anything else by its ``repr``."""
    sha = hashlib.sha256()

    def add(v: Any) -> None:
        if isinstance(v, np.ndarray | jax.Array):
            a = np.ascontiguousarray(v)
            sha.update(f"array{a.shape}{a.dtype.str}".encode())
            sha.update(a.reshape(-1).view(np.uint8))
        elif isinstance(v, dict):
            for k in sorted(v):
                sha.update(f"key{k!r}".encode())
                add(v[k])
        elif isinstance(v, list | tuple):
            sha.update(f"seq{len(v)}".encode())
            for item in v:
                add(item)
        elif isinstance(v, SupernetState):
            add((v.blocks, v.shared, v.optimizer))
        else:
            sha.update(f"{type(v).__name__}:{v!r}".encode())

    add(value)
    return sha.hexdigest()[:32]


def _arguments_of_every_rank(
    layout: StageModel, subnets: Sequence[Sequence[int]], lr_batches: np.ndarray,
    hr_batches: np.ndarray, options: TrainOptions,
) -> dict[str, str]:
    """Digests of what every rank must pass alike, by the name the error gives it: the
    supernet's sizes, the subnets, the batches and each setting (a default counts as passed;
    ``on_tick`` may differ)."""
    defaults = inspect.signature(train_supernet).parameters
    settings = {name: options.get(name, defaults[name].default)
                for name in TrainOptions.__annotations__ if name != "on_tick"}
    sizes = [getattr(layout, a) for a in ("num_layers", "num_choices", "block_size",
                                          "shared_size", "stem_size")]
    return {
        "the supernet": _digest([type(layout).__name__, *sizes]),
        "the subnets": _digest([[int(c) if isinstance(c, int | np.integer) else repr(c)
                                 for c in subnet] for subnet in subnets]),
        "the LR batches": _digest(np.asarray(lr_batches)),
        "the HR batches": _digest(np.asarray(hr_batches)),
        **{f"setting {name}": _digest(value) for name, value in settings.items()},
    }


def _check_ranks_agree(comm: Any, digests: dict[str, str]) -> None:
    """Raise the same `ValueError` on every rank unless every rank passed the same
    ``digests`` (collective): the error names what differs and the first rank it differs on.
    Ranks that trained on different subnets or settings would run different tick programs and
    wait for each other's messages forever."""
    every = comm.allgather(digests)
    differ = [part for part in every[0] if any(d.get(part) != every[0][part] for d in every)]
    if not differ:
        return
    rank = next(r for r, d in enumerate(every) if any(d.get(p) != every[0][p] for p in differ))
    parts = [p for p in differ if not p.startswith("setting ")]
    settings = [p.removeprefix("setting ") for p in differ if p.startswith("setting ")]
    if settings:
        parts.append(f"the settings ({', '.join(settings)})")
    what = parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    raise ValueError(
        f"ranks disagree on {what}: rank {rank}'s differ from rank 0's; pass the same subnets, "
        "batches and settings on every rank (e.g. drawn from the same seed)")


def check_ranks_pass_the_same(
    comm: Any, layout: StageModel, subnets: Sequence[Sequence[int]], lr_batches: np.ndarray,
    hr_batches: np.ndarray, options: TrainOptions,
) -> None:
    """Collective: raise the same `ValueError` on every rank unless every rank of ``comm``
    passes the same supernet sizes, subnets, batches (shapes, dtypes and contents) and
    `train_supernet` settings (``options``, starting weights or state included; ``on_tick``
    may differ). Every MPI pipeline runs it before it trains: `train_supernet_mpi`, and the
    supernet experiment's ``--mpi`` (`search_spaces.supernet_nas.train_for_nas`), whose
    ranks each draw their own patches and subnets (and take rank 0's warm-up)."""
    with failures_end_every_rank(comm):
        digests = _arguments_of_every_rank(layout, subnets, lr_batches, hr_batches, options)
    _check_ranks_agree(comm, digests)


def train_supernet_mpi(
    layout: StageModel,
    subnets: Sequence[Sequence[int]],
    lr_batches: np.ndarray,
    hr_batches: np.ndarray,
    *,
    comm: Any = None,
    **options: Unpack[TrainOptions],
) -> TrainResult:
    """`scamp_jax.pipeline.trainer.train_supernet` with one stage per MPI rank (collective).

    Every rank calls it with the same arguments (the same subnets and batches, e.g. drawn from
    the same seed). ``options`` are `train_supernet`'s keywords (`TrainOptions`: ``schedule``,
    ``num_stages``, ``seed``, ``offload``, ...) with its defaults, except that ``num_stages``
    defaults to the communicator's size (and must equal it). ``comm`` is the mpi4py
    communicator (default ``MPI.COMM_WORLD``). Before anything trains, the ranks compare
    digests of their arguments (the supernet's sizes, the subnets, the batches' shapes, dtypes
    and contents, and every setting except ``on_tick``): where they differ, every rank raises the
    same `ValueError` naming what differs (ranks running different schedules would wait for
    each other forever). Returns the same `TrainResult` on every rank, bit-identical in
    ``losses`` and ``params_sha256`` to ``train_supernet(..., num_stages=size)`` in one
    process; on CPU, when every process's XLA worker pool has the same
    size (`scamp_jax.pipeline.use_fixed_cpu_threads`, and no more CPU devices than it): XLA's
    CPU convolutions split their work by that size, which follows the cores a process may use
    (Open MPI's ``mpirun`` binds ranks to cores or sockets), and another split rounds
    differently.
    """
    mpi = import_mpi4py()
    comm = mpi.COMM_WORLD if comm is None else comm
    options.setdefault("num_stages", comm.Get_size())
    check_ranks_pass_the_same(comm, layout, subnets, lr_batches, hr_batches, options)
    with failures_end_every_rank(comm, stopped="this call saves nothing; its training is lost"):
        return train_supernet(
            layout, subnets, lr_batches, hr_batches,
            executor=functools.partial(MPIPipelineExecutor, comm=comm), **options,
        )
