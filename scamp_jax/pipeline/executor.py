"""Run a precomputed pipeline program on a ``'stage'`` mesh axis.

One jitted tick function serves every subnet and every schedule of the same buffer sizes: stages
run `scamp_jax.pipeline.stage.stage_tick` under ``shard_map``, activations travel forward and
gradients backward with ``lax.ppermute``, and the candidate op of every layer is picked with
``lax.switch`` from the instruction row. Because sequential and CSP runs execute the very same
compiled program on the same inputs per (subnet, stage), their results agree bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from scamp_jax.pipeline.program import BWD, COL, TickProgram
from scamp_jax.pipeline.stage import OptimizerSpec, StageSpec, State, receive, stage_tick
from search_spaces.supernet import SupernetLayout

HOST_KIND = "pinned_host"
DEVICE_KIND = "device"


class PipelineExecutor:
    """Owns the stage mesh, the compiled tick function and the layout of the pipeline state.

    Args:
      layout: the supernet's flat-weight layout.
      num_stages: S, one device per stage (the first S devices unless ``devices`` is given).
      microbatch_size: samples per forward/backward op (the batch size over ``num_microbatches``).
      lr_side: side of the LR input patches (pixels); must suit the attention window.
      window_slots, act_slots, grad_slots: buffer sizes per stage; take the maximum over the
        programs to run so that all of them share one compiled executable.
      num_microbatches: M (1 except GPipe).
      train_shared: train the stem and head (else they stay frozen).
      offload: keep all candidate weights and optimizer state in host memory.
      optimizer: per-block optimizer.
      devices: devices for the stages (default ``jax.devices()[:num_stages]``).
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
        devices: list[Any] | None = None,
    ):
        cfg = layout.config
        if cfg.num_layers % num_stages:
            raise ValueError(
                f"num_layers={cfg.num_layers} is not a multiple of {num_stages=}; every stage "
                "must hold the same number of layers"
            )
        layout.check_patch(lr_side)
        devices = list(jax.devices()[:num_stages]) if devices is None else list(devices)
        if len(devices) != num_stages:
            raise ValueError(
                f"{num_stages=} stages need as many devices, got {len(devices)}; on CPU call "
                f"scamp_jax.devices.configure_cpu_devices({num_stages}) before JAX starts"
            )
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
        self.mesh = jax.make_mesh(
            (num_stages,), ("stage",), axis_types=(AxisType.Explicit,), devices=devices
        )
        self._tick = self._compile()

    # -- state ------------------------------------------------------------------------------
    def _sharding(self, kind: str = DEVICE_KIND) -> NamedSharding:
        return NamedSharding(self.mesh, P("stage"), memory_kind=kind)

    def state_shapes(self) -> State:
        """Global shapes and dtypes of the pipeline state (``jax.ShapeDtypeStruct`` leaves)."""
        spec, lay = self.spec, self.layout
        s, n, c, p = spec.num_stages, spec.layers_per_stage, spec.num_choices, lay.block_size
        w, k, g = self.slots
        mb, side, width = self.microbatch_size, self.lr_side, lay.config.width
        f32, i32 = jnp.float32, jnp.int32

        def sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype)

        fields = spec.optimizer.fields
        store = {f: sds((s, n, c + 1, p), f32) for f in fields} | {"t": sds((s, n, c + 1), i32)}
        window = {f: sds((s, w, n, p), f32) for f in fields} | {"t": sds((s, w, n), i32)}
        shared = {f: sds((s, lay.shared_size), f32) for f in fields} | {"t": sds((s,), i32)}
        if spec.num_microbatches > 1:
            window["acc"] = sds((s, w, n, p), f32)
            shared["acc"] = sds((s, lay.shared_size), f32)
        act = sds((s, k, mb, side, side, width), f32)
        grad = sds((s, g, mb, side, side, width), f32)
        return {"store": store, "window": window, "shared": shared, "act": act, "grad": grad}

    def state_shardings(self) -> State:
        """Sharding of every state leaf: stage-sharded; the store in host memory if offloading."""
        store_kind = HOST_KIND if self.spec.offload else DEVICE_KIND
        shapes = self.state_shapes()
        out = jax.tree.map(lambda _: self._sharding(), shapes)
        out["store"] = jax.tree.map(lambda _: self._sharding(store_kind), shapes["store"])
        return out

    def init_state(self, blocks: np.ndarray, shared: np.ndarray) -> State:
        """Pipeline state holding supernet weights ``blocks`` (L, C, P) and ``shared`` (P_shared,).

        Optimizer moments and step counts start at zero; the window and buffers are empty.
        """
        spec, shapes = self.spec, self.state_shapes()
        s, n, c = spec.num_stages, spec.layers_per_stage, spec.num_choices
        expected = (self.layout.config.num_layers, c, self.layout.block_size)
        if blocks.shape != expected or shared.shape != (self.layout.shared_size,):
            raise ValueError(
                f"weights of shape {blocks.shape} / {shared.shape} do not match the layout "
                f"{expected} / {(self.layout.shared_size,)}; build them with layout.init(seed)"
            )
        host = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), shapes)
        host["store"]["p"][:, :, :c] = blocks.reshape(s, n, c, -1)
        host["shared"]["p"][:] = shared[None]
        return jax.tree.map(jax.device_put, host, self.state_shardings())

    def export(self, state: State) -> dict[str, np.ndarray]:
        """Supernet weights and optimizer state as numpy arrays in the layout's shapes.

        Returns ``{"blocks": (L, C, P), "shared": (P_shared,), "blocks_<field>": ...,
        "block_steps": (L, C)}``; the stem comes from stage 0 and the head from the last stage.
        """
        spec, lay = self.spec, self.layout
        c, stem = spec.num_choices, lay.stem.size
        store = jax.tree.map(np.asarray, state["store"])
        shared_p = np.asarray(state["shared"]["p"])
        out = {
            "blocks": store["p"][:, :, :c].reshape(lay.config.num_layers, c, -1),
            "shared": np.concatenate([shared_p[0, :stem], shared_p[-1, stem:]]),
            "block_steps": store["t"][:, :, :c].reshape(lay.config.num_layers, c),
        }
        for f in spec.optimizer.fields[1:]:
            out[f"blocks_{f}"] = store[f][:, :, :c].reshape(lay.config.num_layers, c, -1)
        return out

    def planned_bytes(self) -> dict[str, int]:
        """`resident_bytes` of a state of this executor, from shapes alone (nothing allocated)."""
        shapes, shardings = self.state_shapes(), self.state_shardings()
        out = {"device_param_bytes": 0, "host_param_bytes": 0}
        for part in ("store", "window", "shared"):
            leaves = zip(
                jax.tree.leaves(shapes[part]), jax.tree.leaves(shardings[part]), strict=True
            )
            for leaf, sharding in leaves:
                size = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
                host = sharding.memory_kind == HOST_KIND
                out["host_param_bytes" if host else "device_param_bytes"] += size
        out["activation_bytes"] = sum(
            int(np.prod(shapes[k].shape)) * np.dtype(shapes[k].dtype).itemsize
            for k in ("act", "grad")
        )
        return out

    def resident_bytes(self, state: State) -> dict[str, int]:
        """Bytes of the state by memory kind, summed over all stages.

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
        return out

    # -- compiled tick ----------------------------------------------------------------------
    def _compile(self) -> Callable[..., tuple[State, jax.Array]]:
        spec, layout = self.spec, self.layout
        s_count = spec.num_stages
        forward_perm = [(i, i + 1) for i in range(s_count - 1)]
        backward_perm = [(i + 1, i) for i in range(s_count - 1)]

        def body(state: State, ins: jax.Array, lr: jax.Array, hr: jax.Array):
            local = jax.tree.map(lambda a: a[0], state)
            ins, lr, hr = ins[0], lr[0], hr[0]
            stage = lax.axis_index("stage")
            local, act_out, grad_out, loss = stage_tick(layout, spec, stage, local, ins, lr, hr)
            act_in = lax.ppermute(act_out, "stage", forward_perm)
            grad_in = lax.ppermute(grad_out, "stage", backward_perm)
            local = receive(local, ins, act_in, grad_in)
            return jax.tree.map(lambda a: a[None], local), loss[None]

        stage_spec = P("stage")
        mapped = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(stage_spec, stage_spec, stage_spec, stage_spec),
            out_specs=(stage_spec, stage_spec),
            check_vma=False,
        )
        return jax.jit(
            mapped,
            out_shardings=(self.state_shardings(), self._sharding()),
            donate_argnums=(0,),
        )

    def tick(
        self, state: State, rows: np.ndarray, lr: np.ndarray, hr: np.ndarray
    ) -> tuple[State, jax.Array]:
        """One tick on all stages.

        Args:
          state: the pipeline state (donated: do not reuse it).
          rows: (S, fields) int32 instruction rows of this tick.
          lr: (S, mb, h, w, 3) each stage's LR microbatch; hr: (S, mb, r h, r w, 3) targets.
        Returns:
          ``(state, loss)`` with ``loss`` (S,): the microbatch loss on the last stage's backward.
        """
        sh = self._sharding()
        return self._tick(
            state,
            jax.device_put(rows.astype(np.int32), sh),
            jax.device_put(lr, sh),
            jax.device_put(hr, sh),
        )

    def run(
        self,
        state: State,
        program: TickProgram,
        lr_data: np.ndarray,
        hr_data: np.ndarray,
        on_tick: Callable[[int, int], None] | None = None,
    ) -> tuple[State, np.ndarray]:
        """Run every tick of ``program``.

        Args:
          state: initial pipeline state (donated).
          program: the per-tick instructions (buffer sizes must fit this executor's).
          lr_data: (N, M, mb, h, w, 3) LR microbatches per subnet sequence id.
          hr_data: (N, M, mb, r h, r w, 3) HR targets.
          on_tick: called as ``on_tick(tick, total_ticks)`` after each dispatched tick.
        Returns:
          ``(state, losses)``: final state and (N,) training loss per subnet (mean over its
          microbatches), in sequence-id order.
        """
        self._check_program(program, lr_data)
        losses = []
        for t in range(program.ticks):
            rows = program.table[t]
            sub = np.maximum(rows[:, COL["subnet"]], 0)
            mbi = rows[:, COL["microbatch"]]
            state, loss = self.tick(state, rows, lr_data[sub, mbi], hr_data[sub, mbi])
            losses.append(loss)
            if on_tick is not None:
                on_tick(t, program.ticks)
        per_tick = np.asarray(jnp.stack(losses))[:, -1]
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
        if program.layers_per_stage != self.spec.layers_per_stage:
            raise ValueError(
                f"program has {program.layers_per_stage} layers per stage, executor "
                f"{self.spec.layers_per_stage}; use the same stage split"
            )
        want = (self.spec.num_microbatches, self.microbatch_size, self.lr_side, self.lr_side, 3)
        if tuple(lr_data.shape[1:]) != want:
            raise ValueError(
                f"lr_data of shape {lr_data.shape} does not match (N, M, mb, h, w, 3) = "
                f"(N, *{want}); split batches with split_microbatches()"
            )
