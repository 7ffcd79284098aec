"""Run a precomputed pipeline program on a ``'stage'`` mesh axis.

One jitted tick function serves every subnet and every schedule of the same buffer sizes: stages
run `scamp_jax.pipeline.stage.stage_tick` under ``shard_map``, activations travel forward and
gradients backward with ``lax.ppermute``, and the candidate op of every layer is picked with
``lax.switch`` from the instruction row. Because sequential and CSP runs execute the very same
compiled program on the same inputs per (subnet, stage), their results agree bit for bit.

The state layout, initialisation, export, byte counts and the tick loop are those of
`scamp_jax.pipeline.executor_base.StageExecutor`, shared with the MPI executor.
"""

from __future__ import annotations

from typing import Any, Unpack

import jax
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from scamp_jax.pipeline.executor_base import (
    DEVICE_KIND,
    HOST_KIND,
    StageExecutor,
    StageSizes,
    memory_stats,
)
from scamp_jax.pipeline.model import StageModel
from scamp_jax.pipeline.program import NUM_FIELDS
from scamp_jax.pipeline.stage import State, receive, stage_tick

__all__ = ["DEVICE_KIND", "HOST_KIND", "PipelineExecutor"]


class PipelineExecutor(StageExecutor):
    """Every stage in this process: owns the stage mesh and the compiled tick function.

    Args:
      layout: the supernet (a `scamp_jax.pipeline.StageModel`).
      devices: devices for the S stages, one each (default ``jax.devices()[:num_stages]``).
      **sizes: `StageSizes`, as for `StageExecutor`: ``num_stages`` (S), ``microbatch_size``,
        ``lr_side`` (pixels), ``window_slots``, ``act_slots``, ``grad_slots``,
        ``num_microbatches`` (M, default 1), ``train_shared``, ``offload`` (default False) and
        ``optimizer`` (default Adam).

    The state is stacked over a leading stage axis S (see `state_shapes`).
    """

    def __init__(
        self,
        layout: StageModel,
        *,
        devices: list[Any] | None = None,
        **sizes: Unpack[StageSizes],
    ):
        super().__init__(layout, **sizes)
        num_stages = self.spec.num_stages
        devices = list(jax.devices()[:num_stages]) if devices is None else list(devices)
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices {devices} name one device twice; each stage runs on a "
                             "device of its own")
        if len(devices) != num_stages:
            raise ValueError(
                f"{num_stages=} stages need as many devices, got {len(devices)}; on CPU call "
                f"scamp_jax.devices.configure_cpu_devices({num_stages}) before JAX starts"
            )
        self.mesh = jax.make_mesh(
            (num_stages,), ("stage",), axis_types=(AxisType.Explicit,), devices=devices
        )
        self._tick = self._compile()
        self._compiled: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}

    def _sharding(self, kind: str = DEVICE_KIND) -> NamedSharding:
        return NamedSharding(self.mesh, P("stage"), memory_kind=kind)

    # -- compiled tick ----------------------------------------------------------------------
    def _compile(self) -> jax.stages.Wrapped:
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

    def _compile_memory(
        self, input_shape: tuple[int, ...], target_shape: tuple[int, ...]
    ) -> dict[str, int]:
        s = self.spec.num_stages
        sh = self._sharding()

        def sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=sh)

        width = NUM_FIELDS + 2 * self.spec.layers_per_stage
        compiled = self._tick.lower(
            self._abstract_state(), sds((s, width), np.int32), sds((s, *input_shape), np.float32),
            sds((s, *target_shape), np.float32),
        ).compile()
        # Reused by `tick` for arrays of these shapes: no second compile of the same program.
        self._compiled[(tuple(input_shape), tuple(target_shape))] = compiled
        return memory_stats(compiled)

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
        run = self._tick
        if lr.dtype == hr.dtype == np.float32:
            run = self._compiled.get((tuple(lr.shape[1:]), tuple(hr.shape[1:])), self._tick)
        return run(
            state,
            jax.device_put(rows.astype(np.int32), sh),
            jax.device_put(lr, sh),
            jax.device_put(hr, sh),
        )
