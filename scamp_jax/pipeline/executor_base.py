"""What every pipeline executor shares, wherever its stages live.

`StageExecutor` holds the stage split, the buffer sizes and the layout of the pipeline state, and
runs a `TickProgram` tick by tick. Its subclasses only decide where stages live and how one tick
moves data between them:

- `scamp_jax.pipeline.executor.PipelineExecutor`: every stage in this process, one device each,
  the state stacked over a leading stage axis S;
- `scamp_jax.distributed.pipeline.MPIPipelineExecutor`: one stage per MPI rank, the state of this
  rank's stage only (no stage axis).

The defaults below are those of the single-process case (all stages local); a subclass whose
stages live elsewhere overrides `_local`, `_gather_stages`, `_sum_over_stages` and
`_last_stage_losses` with the matching collectives.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Required, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Sharding

from scamp_jax.pipeline.model import StageModel, check_stage_model
from scamp_jax.pipeline.program import BWD, COL, TickProgram
from scamp_jax.pipeline.stage import OptimizerSpec, StageSpec, State

HOST_KIND = "pinned_host"
DEVICE_KIND = "device"


def memory_stats(compiled: Any) -> dict[str, int]:
    """Bytes of a compiled program's ``memory_analysis`` (per device): ``argument``, ``output``,
    ``temp``, ``alias``, their ``host_*`` counterparts (0 where the backend has none) and
    ``device_bytes`` = argument + output - alias + temp."""
    stats = compiled.memory_analysis()
    out = {}
    for name in ("argument", "output", "temp", "alias"):
        out[name] = int(getattr(stats, f"{name}_size_in_bytes"))
        out[f"host_{name}"] = int(getattr(stats, f"host_{name}_size_in_bytes", 0))
    out["device_bytes"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


class StageSizes(TypedDict, total=False):
    """The keyword arguments every executor takes: `StageExecutor`'s (see its Args)."""

    num_stages: Required[int]
    microbatch_size: Required[int]
    lr_side: Required[int]
    window_slots: Required[int]
    act_slots: Required[int]
    grad_slots: Required[int]
    num_microbatches: int
    train_shared: bool
    offload: bool
    optimizer: OptimizerSpec | None
    max_in_flight: int
    guard_idle: bool


class StageExecutor(abc.ABC):
    """Stage split, state layout and tick loop of a supernet pipeline (see the module docstring).

    Args:
      layout: the supernet (a `scamp_jax.pipeline.StageModel`).
      num_stages: S pipeline stages; ``num_layers`` must be a multiple of S.
      microbatch_size: samples per forward/backward op (the batch size over ``num_microbatches``).
      lr_side: side of the LR input patches (pixels); must suit the attention window.
      window_slots, act_slots, grad_slots: buffer sizes per stage; take the maximum over the
        programs to run so that all of them share one compiled executable.
      num_microbatches: M (1 except GPipe).
      train_shared: train the stem and head (else they stay frozen).
      offload: keep all candidate weights and optimizer state in host memory.
      optimizer: per-block optimizer (default Adam, learning rate 1e-3).
      max_in_flight: ticks `run` lets the host dispatch ahead of the devices (0: no bound). JAX
        dispatch is asynchronous, so an unbounded loop queues every tick of a program at once;
        on the CPU backend (jaxlib 0.10.2) a deep queue of 8-device ticks can deadlock: some
        stage devices enter a tick's collective-permute while the threads that would launch
        another device's part of it all wait on input buffers or on the per-device limit of 32
        queued executions, and XLA aborts after its collective timeout. Waiting for the loss of
        the tick ``max_in_flight`` back keeps the queue short (with all stages local, each
        stage device holds a shard of it, so every device has finished that tick; with one
        stage per process, as `scamp_jax.distributed.MPIPipelineExecutor`, the local stage has);
        a few ticks suffice to keep devices fed.
      guard_idle: skip the host-to-device fetch and the write-back on ticks that fetch or
        update nothing (``lax.cond``; default). False runs both on every tick, masked, which
        gives the same bits and serves to measure what the guard saves.
    """

    def __init__(
        self,
        layout: StageModel,
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
        max_in_flight: int = 4,
        guard_idle: bool = True,
    ):
        layout = check_stage_model(layout)
        if max_in_flight < 0:
            raise ValueError(f"{max_in_flight=} must be >= 0 (0: no bound); pass e.g. 4")
        self.max_in_flight = max_in_flight
        if (isinstance(num_stages, bool) or not isinstance(num_stages, int | np.integer)
                or num_stages < 1):
            raise ValueError(f"{num_stages=} must be a positive int: one stage per device")
        num_stages = int(num_stages)
        if layout.num_layers % num_stages:
            raise ValueError(
                f"num_layers={layout.num_layers} is not a multiple of {num_stages=}; every stage "
                "must hold the same number of layers"
            )
        layout.check_input(lr_side)
        self.layout = layout
        self.spec = StageSpec(
            num_stages=num_stages,
            layers_per_stage=layout.num_layers // num_stages,
            num_choices=layout.num_choices,
            num_microbatches=num_microbatches,
            train_shared=train_shared,
            offload=offload,
            optimizer=optimizer or OptimizerSpec(),
            guard_idle=guard_idle,
        )
        self.microbatch_size = microbatch_size
        self.lr_side = lr_side
        self.slots = (window_slots, act_slots, grad_slots)
        # `compiled_memory` per (input shape, target shape): each is one tick compilation.
        self._memory: dict[tuple[tuple[int, ...], tuple[int, ...]], dict[str, int]] = {}

    # -- where the stages live (subclasses) ---------------------------------------------------
    @abc.abstractmethod
    def _sharding(self, kind: str = DEVICE_KIND) -> Sharding:
        """Placement of one state leaf in memory of kind ``kind`` (device or pinned host)."""

    @abc.abstractmethod
    def tick(
        self, state: State, rows: np.ndarray, lr: np.ndarray, hr: np.ndarray
    ) -> tuple[State, jax.Array]:
        """One tick of the local stages (collective across processes): ``rows`` are their
        instruction rows and ``lr`` / ``hr`` their microbatches, shaped as `_local` selects from
        (S, ...); returns the new state (``state`` is donated) and the local stages' losses."""

    @abc.abstractmethod
    def _compile_memory(
        self, input_shape: tuple[int, ...], target_shape: tuple[int, ...]
    ) -> dict[str, int]:
        """Compile the tick for microbatches of these shapes (keeping the executable for `tick`)
        and return `compiled_memory`'s figures."""

    def compiled_memory(
        self, input_shape: tuple[int, ...], target_shape: tuple[int, ...]
    ) -> dict[str, int]:
        """XLA's ``memory_analysis`` of the compiled tick, per stage device (bytes).

        The first call for a pair of shapes compiles the tick, and `tick` then runs that
        executable on arrays of these shapes (no second compilation); later calls return the
        same figures without compiling.

        Args:
          input_shape: one stage's microbatch of inputs, e.g. ``(mb, h, w, 3)``.
          target_shape: one stage's microbatch of targets, e.g. ``(mb, r h, r w, 3)``.
        Returns:
          ``argument``, ``output``, ``temp``, ``alias`` (donated state reused for the output)
          and their ``host_*`` counterparts (memory kind ``pinned_host``; backends without host
          memory spaces, such as XLA:CPU, count the store as device arguments), plus
          ``device_bytes``: what the tick holds in device memory at most (argument + output -
          alias + temp of a single program; see the subclass for ticks of several programs).
        """
        key = (tuple(input_shape), tuple(target_shape))
        if key not in self._memory:
            self._memory[key] = self._compile_memory(*key)
        return dict(self._memory[key])

    def is_compiled(self, input_shape: tuple[int, ...], target_shape: tuple[int, ...]) -> bool:
        """Whether `compiled_memory` already compiled the tick for these microbatch shapes."""
        return (tuple(input_shape), tuple(target_shape)) in self._memory

    def _abstract_state(self) -> State:
        """The state as ``jax.ShapeDtypeStruct`` leaves with their shardings (for lowering)."""
        return jax.tree.map(
            lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
            self.state_shapes(), self.state_shardings(),
        )

    @property
    def _stage_prefix(self) -> tuple[int, ...]:
        """Leading shape of every state leaf: ``(S,)`` while all stages are local."""
        return (self.spec.num_stages,)

    def _local(self, per_stage: np.ndarray) -> np.ndarray:
        """The local stages' part of a (S, ...) array (all of it while all stages are local)."""
        return per_stage

    def _gather_stages(self, local: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every stage's arrays stacked on a leading S axis, from this process's ``local`` ones."""
        return local

    def _sum_over_stages(self, counts: dict[str, int]) -> dict[str, int]:
        """Byte counts of the local stages summed over all stages."""
        return counts

    def _last_stage_losses(self, losses: list[jax.Array]) -> np.ndarray:
        """(T,) the last stage's loss per tick, from the local stages' (T,) tick outputs."""
        return np.asarray(jnp.stack(losses))[:, -1]

    # -- state ------------------------------------------------------------------------------
    def state_shapes(self) -> State:
        """Shapes and dtypes (``jax.ShapeDtypeStruct`` leaves) of the local stages' state.

        Every leaf starts with `_stage_prefix`: ``(S,)`` when all stages are in this process,
        nothing when it holds one stage.
        """
        spec, lay, pre = self.spec, self.layout, self._stage_prefix
        n, c, p = spec.layers_per_stage, spec.num_choices, lay.block_size
        w, k, g = self.slots
        feature = tuple(lay.feature_shape(self.microbatch_size, self.lr_side))
        f32, i32 = jnp.float32, jnp.int32

        def sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(pre + shape, dtype)

        fields = spec.optimizer.fields
        store = {f: sds((n, c + 1, p), f32) for f in fields} | {"t": sds((n, c + 1), i32)}
        window = {f: sds((w, n, p), f32) for f in fields} | {"t": sds((w, n), i32)}
        shared = {f: sds((lay.shared_size,), f32) for f in fields} | {"t": sds((), i32)}
        if spec.num_microbatches > 1:
            window["acc"] = sds((w, n, p), f32)
            shared["acc"] = sds((lay.shared_size,), f32)
        act = sds((k, *feature), f32)
        grad = sds((g, *feature), f32)
        return {"store": store, "window": window, "shared": shared, "act": act, "grad": grad}

    def state_shardings(self) -> State:
        """Placement of every state leaf; the store in host memory (``pinned_host``) when
        offloading, everything else on the device."""
        store_kind = HOST_KIND if self.spec.offload else DEVICE_KIND
        shapes = self.state_shapes()
        out = jax.tree.map(lambda _: self._sharding(), shapes)
        out["store"] = jax.tree.map(lambda _: self._sharding(store_kind), shapes["store"])
        return out

    def optimizer_keys(self) -> tuple[str, ...]:
        """The keys of the optimizer state `export` returns and `init_state` takes:
        ``blocks_<field>`` and ``shared_<field>`` per optimizer field besides the weights (Adam's
        ``m``, ``v``; none for SGD), ``block_steps`` and ``shared_step``."""
        fields = self.spec.optimizer.fields[1:]
        return (*(f"blocks_{f}" for f in fields), "block_steps",
                *(f"shared_{f}" for f in fields), "shared_step")

    def _check_optimizer_state(self, state: dict[str, np.ndarray]) -> None:
        lay, c = self.layout, self.spec.num_choices
        wanted = set(self.optimizer_keys())
        given = set(state) - {"blocks", "shared"}  # an `export` may be passed as it is
        if given != wanted:
            missing, extra = sorted(wanted - given), sorted(given - wanted)
            raise ValueError(
                f"the optimizer state does not fit this executor's {self.spec.optimizer.name} "
                f"optimizer: {'missing ' + ', '.join(missing) if missing else ''}"
                f"{'; ' if missing and extra else ''}"
                f"{'unexpected ' + ', '.join(extra) if extra else ''}; pass what export() (or "
                "TrainResult.optimizer) of an executor with the same optimizer returned")
        shapes = {"block_steps": (lay.num_layers, c), "shared_step": ()}
        for key in wanted - set(shapes):
            shapes[key] = ((lay.num_layers, c, lay.block_size) if key.startswith("blocks_")
                           else (lay.shared_size,))
        for key, shape in shapes.items():
            if np.shape(state[key]) != shape:
                raise ValueError(
                    f"optimizer state {key!r} of shape {np.shape(state[key])} does not match the "
                    f"layout's {shape}; pass the state export() returned for this supernet")

    def init_state(
        self, blocks: np.ndarray, shared: np.ndarray,
        optimizer_state: dict[str, np.ndarray] | None = None,
    ) -> State:
        """State of the local stages holding supernet weights ``blocks`` (L, C, P) and
        ``shared`` (P_shared,).

        Every process passes the whole supernet. ``optimizer_state``: the optimizer fields
        `export` returned (`optimizer_keys`; e.g. ``TrainResult.optimizer``), so that training
        continues where that state was exported exactly as if it had not stopped, on an
        executor of the same stage count (the weights depend on it: the order of some
        floating-point sums follows the stages; the state does not record it, so another count
        is not refused but does not reproduce the run that did not stop); default: optimizer
        moments and step counts start at zero. The window and buffers start empty.
        """
        spec, shapes = self.spec, self.state_shapes()
        s, n, c = spec.num_stages, spec.layers_per_stage, spec.num_choices
        expected = (self.layout.num_layers, c, self.layout.block_size)
        if blocks.shape != expected or shared.shape != (self.layout.shared_size,):
            raise ValueError(
                f"weights of shape {blocks.shape} / {shared.shape} do not match the layout "
                f"{expected} / {(self.layout.shared_size,)}; build them with layout.init(seed)"
            )
        if optimizer_state is not None:
            self._check_optimizer_state(optimizer_state)
        host = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)
        # Candidate c (the last) stays zero: it is the slot of layers a subnet leaves unused.
        host["store"]["p"][..., :c, :] = self._local(blocks.reshape(s, n, c, -1))
        host["shared"]["p"][...] = self._local(np.broadcast_to(shared, (s, shared.size)))
        if optimizer_state is not None:
            stem = self.layout.stem_size
            for f in spec.optimizer.fields[1:]:
                host["store"][f][..., :c, :] = self._local(
                    np.asarray(optimizer_state[f"blocks_{f}"], np.float32).reshape(s, n, c, -1))
                # As training leaves them: the stem's moments on the first stage, the head's on
                # the last, zero elsewhere (no other stage has a gradient for them).
                moments = np.asarray(optimizer_state[f"shared_{f}"], np.float32)
                per_stage = np.zeros((s, shared.size), np.float32)
                per_stage[0, :stem] = moments[:stem]
                per_stage[-1, stem:] = moments[stem:]
                host["shared"][f][...] = self._local(per_stage)
            host["store"]["t"][..., :c] = self._local(
                np.asarray(optimizer_state["block_steps"], np.int32).reshape(s, n, c))
            # Every stage counts the shared updates alike (zero-gradient ones included).
            host["shared"]["t"][...] = self._local(
                np.full(s, optimizer_state["shared_step"], np.int32))
        return jax.tree.map(jax.device_put, host, self.state_shardings())

    def export(self, state: State) -> dict[str, np.ndarray]:
        """The whole supernet's weights and optimizer state as numpy arrays in layout shapes.

        Collective when stages live in several processes (each must call it). Returns
        ``{"blocks": (L, C, P), "shared": (P_shared,), "blocks_<field>": (L, C, P),
        "block_steps": (L, C), "shared_<field>": (P_shared,), "shared_step": ()}`` (fields: the
        optimizer's besides the weights, `optimizer_keys`); the stem and its optimizer state
        come from stage 0, the head and its from the last stage. ``init_state(blocks, shared,
        optimizer_state=export(state))`` continues training from there.
        """
        spec, lay = self.spec, self.layout
        c, stem, layers = spec.num_choices, lay.stem_size, lay.num_layers
        local = {k: np.asarray(v) for k, v in state["store"].items()}
        for k in (*spec.optimizer.fields, "t"):
            local[f"shared_{k}"] = np.asarray(state["shared"][k])
        stages = self._gather_stages(local)
        shared_p = stages["shared_p"]
        out = {
            "blocks": stages["p"][:, :, :c].reshape(layers, c, -1),
            "shared": np.concatenate([shared_p[0, :stem], shared_p[-1, stem:]]),
            "block_steps": stages["t"][:, :, :c].reshape(layers, c),
            "shared_step": np.asarray(stages["shared_t"][0], np.int32),
        }
        for f in spec.optimizer.fields[1:]:
            out[f"blocks_{f}"] = stages[f][:, :, :c].reshape(layers, c, -1)
            field = stages[f"shared_{f}"]
            out[f"shared_{f}"] = np.concatenate([field[0, :stem], field[-1, stem:]])
        return out

    def planned_bytes(self) -> dict[str, int]:
        """`resident_bytes` of a state of this executor, from shapes alone (nothing allocated),
        all stages together."""
        shapes, shardings = self.state_shapes(), self.state_shardings()
        # Every stage's state has the same shapes, so remote stages count as the local ones.
        per_local = self.spec.num_stages // int(np.prod(self._stage_prefix))
        out = {"device_param_bytes": 0, "host_param_bytes": 0}
        for part in ("store", "window", "shared"):
            leaves = zip(
                jax.tree.leaves(shapes[part]), jax.tree.leaves(shardings[part]), strict=True
            )
            for leaf, sharding in leaves:
                size = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
                host = sharding.memory_kind == HOST_KIND
                out["host_param_bytes" if host else "device_param_bytes"] += size * per_local
        out["activation_bytes"] = per_local * sum(
            int(np.prod(shapes[k].shape)) * np.dtype(shapes[k].dtype).itemsize
            for k in ("act", "grad")
        )
        return out

    def resident_bytes(self, state: State) -> dict[str, int]:
        """Bytes of the state by memory kind, summed over all stages (collective across
        processes).

        Returns ``{"device_param_bytes", "host_param_bytes", "activation_bytes"}``: weights and
        optimizer state (store, window, shared) in device and in host memory, and the
        activation/gradient buffers (always on device).
        """
        out = {"device_param_bytes": 0, "host_param_bytes": 0}
        for part in ("store", "window", "shared"):
            for leaf in jax.tree.leaves(state[part]):
                kind = leaf.sharding.memory_kind
                key = "host_param_bytes" if kind == HOST_KIND else "device_param_bytes"
                out[key] += int(leaf.nbytes)
        out["activation_bytes"] = int(state["act"].nbytes + state["grad"].nbytes)
        return self._sum_over_stages(out)

    # -- running a program ------------------------------------------------------------------
    def run(
        self,
        state: State,
        program: TickProgram,
        lr_data: np.ndarray,
        hr_data: np.ndarray,
        on_tick: Callable[[int, int], None] | None = None,
    ) -> tuple[State, np.ndarray]:
        """Run every tick of ``program`` (collective when stages live in several processes).

        Args:
          state: initial state of the local stages (donated).
          program: the per-tick instructions of all stages (buffer sizes must fit this
            executor's; identical in every process).
          lr_data: (N, M, mb, h, w, 3) LR microbatches per subnet sequence id (every process
            passes them all; each stage uses the ones its rows name).
          hr_data: (N, M, mb, r h, r w, 3) HR targets.
          on_tick: called as ``on_tick(tick, total_ticks)`` after each dispatched tick.
        Returns:
          ``(state, losses)``: final state and (N,) training loss per subnet (mean over its
          microbatches), in sequence-id order, the same in every process.
        """
        self._check_program(program, lr_data)
        losses = []
        for t in range(program.ticks):
            rows = self._local(program.table[t])
            sub = np.maximum(rows[..., COL["subnet"]], 0)
            mbi = rows[..., COL["microbatch"]]
            state, loss = self.tick(state, rows, lr_data[sub, mbi], hr_data[sub, mbi])
            losses.append(loss)
            if self.max_in_flight and len(losses) > self.max_in_flight:
                losses[-1 - self.max_in_flight].block_until_ready()
            if on_tick is not None:
                on_tick(t, program.ticks)
        per_tick = self._last_stage_losses(losses)
        last = program.table[:, -1]
        per_subnet = np.zeros(lr_data.shape[0], np.float64)
        for done in np.nonzero(last[:, COL["kind"]] == BWD)[0]:
            per_subnet[last[done, COL["subnet"]]] += per_tick[done]
        return state, (per_subnet / self.spec.num_microbatches).astype(np.float32)

    def close(self) -> None:
        """Release what the executor holds besides its arrays (collective, as ``run``): an MPI
        executor's communicator. `scamp_jax.pipeline.trainer.train_supernet` closes an executor
        it built; one passed to it stays open for reuse. Nothing here."""
        return None

    def _check_program(self, program: TickProgram, lr_data: np.ndarray) -> None:
        need = (program.window_slots, program.act_slots, program.grad_slots)
        if any(n > have for n, have in zip(need, self.slots, strict=True)):
            raise ValueError(
                f"program needs (window, act, grad) slots {need} but the executor has "
                f"{self.slots}; build the executor with at least the program's sizes"
            )
        stages = program.table.shape[1]
        if stages != self.spec.num_stages or program.layers_per_stage != self.spec.layers_per_stage:
            raise ValueError(
                f"program has {stages} stages of {program.layers_per_stage} layers, the "
                f"executor {self.spec.num_stages} of {self.spec.layers_per_stage}; build the "
                f"program with split_layers(num_layers, {self.spec.num_stages})"
            )
        want = (self.spec.num_microbatches, self.microbatch_size, self.lr_side, self.lr_side)
        if tuple(lr_data.shape[1:5]) != want:
            raise ValueError(
                f"lr_data of shape {lr_data.shape} does not match (N, M, mb, h, w, ...) = "
                f"(N, *{want}, ...); split batches with split_microbatches()"
            )
