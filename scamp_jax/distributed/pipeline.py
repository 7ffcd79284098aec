"""The supernet pipeline across MPI ranks: one stage per rank, activations moved by mpi4jax.

`MPIPipelineExecutor` is a drop-in for `scamp_jax.pipeline.executor.PipelineExecutor` (same
``init_state`` / ``run`` / ``export`` / ``resident_bytes``), so ``train_supernet(...,
executor=MPIPipelineExecutor(...))`` trains through a pipeline whose stages live in different
processes, typically on different hosts:

- rank ``s`` owns stage ``s`` on its first local device (one process per host or per GPU);
- every tick each rank runs the very same per-stage function as the single-process executor
  (`scamp_jax.pipeline.stage.stage_tick`, the stage index a traced value in both), then sends its
  activation to rank ``s + 1`` and its input gradient to rank ``s - 1`` with ``mpi4jax`` in a
  second jitted program, where the single-process executor uses ``lax.ppermute``;
- losses live on the last rank and are broadcast; `export` gathers every stage's weights, so
  every rank returns the same `TrainResult` (same ``params_sha256`` as the single-process run).

A rank that dies makes ``mpirun`` abort every other rank (Open MPI's default for a process that
exits without ``MPI_Finalize``), so a broken pipeline stops instead of hanging in a receive.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from scamp_jax.distributed.mpi import import_mpi4jax, import_mpi4py
from scamp_jax.pipeline.csp import split_layers
from scamp_jax.pipeline.executor import DEVICE_KIND, HOST_KIND
from scamp_jax.pipeline.program import BWD, COL, TickProgram, build_program
from scamp_jax.pipeline.stage import OptimizerSpec, StageSpec, State, receive, stage_tick
from scamp_jax.pipeline.trainer import TrainResult, make_schedule, train_supernet
from search_spaces.supernet import SupernetLayout

# Message tags of the two shifts of a tick, so an activation can never be taken for a gradient.
_ACT_TAG, _GRAD_TAG = 11, 12


class MPIPipelineExecutor:
    """One pipeline stage per MPI rank; the same tick program as `PipelineExecutor`.

    Args:
      layout: the supernet's flat-weight layout (identical on every rank).
      num_stages: S; must equal the communicator's size (rank = stage).
      microbatch_size, lr_side, window_slots, act_slots, grad_slots, num_microbatches,
        train_shared, offload, optimizer: as for `PipelineExecutor`.
      comm: mpi4py communicator of the pipeline (default ``MPI.COMM_WORLD``).
      device: this rank's device (default its first local device).
    """

    def __init__(
        self,
        layout: SupernetLayout,
        *,
        num_stages: int,
        microbatch_size: int,
        lr_side: int,
        window_slots: int,
        act_slots: int,
        grad_slots: int,
        num_microbatches: int = 1,
        train_shared: bool = False,
        offload: bool = False,
        optimizer: OptimizerSpec | None = None,
        comm: Any = None,
        device: Any = None,
    ):
        mpi = import_mpi4py()
        comm = mpi.COMM_WORLD if comm is None else comm
        if comm.Get_size() != num_stages:
            raise ValueError(
                f"{num_stages=} but the communicator has {comm.Get_size()} ranks; the MPI "
                f"pipeline puts one stage on each rank: launch with mpirun -n {num_stages}"
            )
        cfg = layout.config
        if cfg.num_layers % num_stages:
            raise ValueError(
                f"num_layers={cfg.num_layers} is not a multiple of {num_stages=}; every stage "
                "must hold the same number of layers"
            )
        layout.check_patch(lr_side)
        self._mpi4jax = import_mpi4jax()
        self.comm = comm
        # mpi4jax's messages travel on their own communicator so that host-side collectives of
        # this class (loss broadcast, export) can never match one of them.
        self._jax_comm = comm.Clone()
        self.rank = comm.Get_rank()
        self.device = jax.local_devices()[0] if device is None else device
        self.layout = layout
        self.spec = StageSpec(
            num_stages=num_stages,
            layers_per_stage=cfg.num_layers // num_stages,
            num_choices=cfg.num_choices,
            num_microbatches=num_microbatches,
            train_shared=train_shared,
            offload=offload,
            optimizer=optimizer or OptimizerSpec(),
        )
        self.microbatch_size = microbatch_size
        self.lr_side = lr_side
        self.slots = (window_slots, act_slots, grad_slots)
        self._tick = self._compile()

    # -- state (this rank's stage only) -------------------------------------------------------
    def _sharding(self, kind: str = DEVICE_KIND) -> SingleDeviceSharding:
        return SingleDeviceSharding(self.device, memory_kind=kind)

    def state_shapes(self) -> State:
        """Shapes and dtypes of this rank's stage state (the single-process state without S)."""
        spec, lay = self.spec, self.layout
        n, c, p = spec.layers_per_stage, spec.num_choices, lay.block_size
        w, k, g = self.slots
        mb, side, width = self.microbatch_size, self.lr_side, lay.config.width
        f32, i32 = jnp.float32, jnp.int32

        def sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype)

        fields = spec.optimizer.fields
        store = {f: sds((n, c + 1, p), f32) for f in fields} | {"t": sds((n, c + 1), i32)}
        window = {f: sds((w, n, p), f32) for f in fields} | {"t": sds((w, n), i32)}
        shared = {f: sds((lay.shared_size,), f32) for f in fields} | {"t": sds((), i32)}
        if spec.num_microbatches > 1:
            window["acc"] = sds((w, n, p), f32)
            shared["acc"] = sds((lay.shared_size,), f32)
        act = sds((k, mb, side, side, width), f32)
        grad = sds((g, mb, side, side, width), f32)
        return {"store": store, "window": window, "shared": shared, "act": act, "grad": grad}

    def state_shardings(self) -> State:
        """Placement of every state leaf on this rank's device; the store on the host if
        offloading (memory kind ``pinned_host``)."""
        store_kind = HOST_KIND if self.spec.offload else DEVICE_KIND
        shapes = self.state_shapes()
        out = jax.tree.map(lambda _: self._sharding(), shapes)
        out["store"] = jax.tree.map(lambda _: self._sharding(store_kind), shapes["store"])
        return out

    def init_state(self, blocks: np.ndarray, shared: np.ndarray) -> State:
        """This rank's stage state holding its layers of ``blocks`` (L, C, P) and ``shared``.

        Every rank passes the whole supernet (all ranks initialise it from the same seed).
        """
        spec, shapes = self.spec, self.state_shapes()
        n, c = spec.layers_per_stage, spec.num_choices
        expected = (self.layout.config.num_layers, c, self.layout.block_size)
        if blocks.shape != expected or shared.shape != (self.layout.shared_size,):
            raise ValueError(
                f"weights of shape {blocks.shape} / {shared.shape} do not match the layout "
                f"{expected} / {(self.layout.shared_size,)}; build them with layout.init(seed)"
            )
        host = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)
        host["store"]["p"][:, :c] = blocks[self.rank * n : (self.rank + 1) * n]
        host["shared"]["p"][:] = shared
        return jax.tree.map(jax.device_put, host, self.state_shardings())

    def export(self, state: State) -> dict[str, np.ndarray]:
        """The whole supernet's weights and optimizer state, gathered from every rank.

        Collective: every rank must call it. Returns the same dict as
        `PipelineExecutor.export` (``blocks`` (L, C, P), ``shared``, ``blocks_<field>``,
        ``block_steps`` (L, C)) on every rank.
        """
        spec, lay = self.spec, self.layout
        c, stem, layers = spec.num_choices, lay.stem.size, lay.config.num_layers
        local = {k: np.asarray(v) for k, v in state["store"].items()}
        local["shared_p"] = np.asarray(state["shared"]["p"])
        stages = self.comm.allgather(local)
        store = {k: np.stack([s[k] for s in stages]) for k in state["store"]}
        out = {
            "blocks": store["p"][:, :, :c].reshape(layers, c, -1),
            "shared": np.concatenate([stages[0]["shared_p"][:stem], stages[-1]["shared_p"][stem:]]),
            "block_steps": store["t"][:, :, :c].reshape(layers, c),
        }
        for f in spec.optimizer.fields[1:]:
            out[f"blocks_{f}"] = store[f][:, :, :c].reshape(layers, c, -1)
        return out

    def resident_bytes(self, state: State) -> dict[str, int]:
        """Bytes of the state by memory kind, summed over all ranks (collective).

        Returns ``{"device_param_bytes", "host_param_bytes", "activation_bytes"}`` as
        `PipelineExecutor.resident_bytes` does for the single-process pipeline.
        """
        out = {"device_param_bytes": 0, "host_param_bytes": 0}
        for part in ("store", "window", "shared"):
            for leaf in jax.tree.leaves(state[part]):
                kind = leaf.sharding.memory_kind
                key = "host_param_bytes" if kind == HOST_KIND else "device_param_bytes"
                out[key] += int(leaf.nbytes)
        out["activation_bytes"] = int(state["act"].nbytes + state["grad"].nbytes)
        return {k: int(self.comm.allreduce(v)) for k, v in out.items()}

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

    def _compile(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
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
        state, act_out, grad_out, loss = compute(
            state, ins, jax.device_put(lr, sh), jax.device_put(hr, sh),
            jax.device_put(np.int32(self.rank), sh),
        )
        buffers = exchange({"act": state["act"], "grad": state["grad"]}, ins, act_out, grad_out)
        return {**state, **buffers}, loss

    def run(
        self,
        state: State,
        program: TickProgram,
        lr_data: np.ndarray,
        hr_data: np.ndarray,
        on_tick: Callable[[int, int], None] | None = None,
    ) -> tuple[State, np.ndarray]:
        """Run every tick of ``program`` on this rank's stage (collective).

        Args:
          state: this stage's initial state (donated).
          program: the per-tick instructions of all stages (identical on every rank).
          lr_data: (N, M, mb, h, w, 3) LR microbatches per subnet (every rank passes them all;
            each uses the rows its stage needs).
          hr_data: (N, M, mb, r h, r w, 3) HR targets.
          on_tick: called as ``on_tick(tick, total_ticks)`` after each dispatched tick.
        Returns:
          ``(state, losses)``: this stage's final state and the (N,) loss per subnet (mean over
          its microbatches), the same on every rank.
        """
        self._check_program(program, lr_data)
        losses = []
        for t in range(program.ticks):
            row = program.table[t, self.rank]
            sub, mbi = max(int(row[COL["subnet"]]), 0), int(row[COL["microbatch"]])
            state, loss = self.tick(state, row, lr_data[sub, mbi], hr_data[sub, mbi])
            losses.append(loss)
            if on_tick is not None:
                on_tick(t, program.ticks)
        last_rank = self.spec.num_stages - 1
        mine = np.asarray(jnp.stack(losses)) if self.rank == last_rank else None
        per_tick = self.comm.bcast(mine, root=last_rank)
        last = program.table[:, -1]
        per_subnet = np.zeros(lr_data.shape[0], np.float64)
        for done in np.nonzero(last[:, COL["kind"]] == BWD)[0]:
            per_subnet[last[done, COL["subnet"]]] += per_tick[done]
        return state, (per_subnet / self.spec.num_microbatches).astype(np.float32)

    def _check_program(self, program: TickProgram, lr_data: np.ndarray) -> None:
        need = (program.window_slots, program.act_slots, program.grad_slots)
        if any(n > have for n, have in zip(need, self.slots, strict=True)):
            raise ValueError(
                f"program needs (window, act, grad) slots {need} but the executor has "
                f"{self.slots}; build the executor with at least the program's sizes"
            )
        if program.table.shape[1] != self.spec.num_stages:
            raise ValueError(
                f"program has {program.table.shape[1]} stages, the MPI pipeline "
                f"{self.spec.num_stages} ranks; build the program with num_stages = ranks"
            )
        want = (self.spec.num_microbatches, self.microbatch_size, self.lr_side, self.lr_side, 3)
        if tuple(lr_data.shape[1:]) != want:
            raise ValueError(
                f"lr_data of shape {lr_data.shape} does not match (N, M, mb, h, w, 3) = "
                f"(N, *{want}); split batches with split_microbatches()"
            )


def train_supernet_mpi(
    layout: SupernetLayout,
    subnets: Sequence[Sequence[int]],
    lr_batches: np.ndarray,
    hr_batches: np.ndarray,
    *,
    schedule: str = "csp",
    seed: int = 0,
    offload: bool = True,
    train_shared: bool = False,
    num_microbatches: int = 4,
    optimizer: OptimizerSpec | None = None,
    max_inflight: int | None = None,
    prefetch_ahead: int = 1,
    comm: Any = None,
    on_tick: Callable[[int, int], None] | None = None,
) -> TrainResult:
    """`scamp_jax.pipeline.trainer.train_supernet` with one stage per MPI rank (collective).

    Every rank calls it with the same arguments (the same subnets and batches, e.g. drawn from
    the same seed); the number of stages is the communicator's size. Returns the same
    `TrainResult` on every rank, bit-identical in ``losses`` and ``params_sha256`` to
    ``train_supernet(..., num_stages=size)`` in one process.
    """
    mpi = import_mpi4py()
    comm = mpi.COMM_WORLD if comm is None else comm
    num_stages = comm.Get_size()
    bounds = split_layers(layout.config.num_layers, num_stages)
    m_count = num_microbatches if schedule == "gpipe" else 1
    # The program sizes the executor's buffers; train_supernet rebuilds the same program.
    sched = make_schedule(
        schedule, subnets, bounds, train_shared=train_shared, num_microbatches=m_count,
        max_inflight=max_inflight,
    )
    program = build_program(sched, subnets, bounds, prefetch_ahead=prefetch_ahead)
    executor = MPIPipelineExecutor(
        layout,
        num_stages=num_stages,
        microbatch_size=lr_batches.shape[1] // m_count,
        lr_side=lr_batches.shape[2],
        window_slots=program.window_slots,
        act_slots=program.act_slots,
        grad_slots=program.grad_slots,
        num_microbatches=m_count,
        train_shared=train_shared,
        offload=offload,
        optimizer=optimizer,
        comm=comm,
    )
    return train_supernet(
        layout, subnets, lr_batches, hr_batches, schedule=schedule, num_stages=num_stages,
        seed=seed, offload=offload, train_shared=train_shared, num_microbatches=num_microbatches,
        optimizer=optimizer, max_inflight=max_inflight, prefetch_ahead=prefetch_ahead,
        executor=executor,  # type: ignore[arg-type]
        on_tick=on_tick,
    )
