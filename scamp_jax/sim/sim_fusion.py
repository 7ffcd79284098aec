"""Cost model of a fused group for the cluster simulator: step time and throughput vs width.

A fused group's step (`scamp_jax.planning.fusion`) is one program whose FLOPs and memory traffic
grow with the number of members ``K`` while the number of kernels it launches does not (vmap widens
each kernel instead of repeating it). Under the simulator's per-step model
(`scamp_jax.sim.simulator`:
roofline busy time + collectives + kernel launches), a group of ``K`` therefore trains ``K``
trials in less than ``K`` solo steps whenever launches or an underused device dominate a solo
step, which is the case for the small candidates of an HPO study.

`measure_fused_costs` compiles the fused step at a few widths (the planner's compiles: same step,
shardings and options) and reads XLA's ``cost_analysis()`` and the kernels of the compiled
program; `FusedCostModel` fits them as affine in ``K`` and gives a group's `TrialProfile`, so a
simulated study can schedule a group as one trial and credit it ``K`` finished trials.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optax
from flax import nnx

from scamp_jax.planning.fusion import FusedStepCompiler, stack_abstract
from scamp_jax.planning.planner import Plan
from scamp_jax.planning.train_step import LossFn
from scamp_jax.scheduling.booking import group_bytes
from scamp_jax.sim.simulator import ClusterModel, TrialProfile, step_seconds

#: HLO instructions of an entry computation that launch no kernel.
_NOT_KERNELS = frozenset({
    "parameter", "constant", "tuple", "get-tuple-element", "bitcast", "opt-barrier",
    "after-all", "partition-id", "replica-id",
})
_OP = re.compile(r"\s([a-z][a-z0-9\-]*)\(")


#: What tells kernels of one instruction kind apart: a fusion's kind, a custom call's target.
_DETAIL = re.compile(r'custom_call_target="([^"]+)"|kind=(k\w+)')


def entry_kernels(hlo_text: str) -> int:
    """Kernels launched by the entry computation of compiled HLO text (one per instruction
    that is not a parameter, constant, tuple access or bitcast)."""
    return sum(entry_kernel_kinds(hlo_text).values())


def entry_kernel_kinds(hlo_text: str) -> dict[str, int]:
    """`entry_kernels` by kind, most first: the instruction's opcode, with a fusion's kind or
    a custom call's target after a colon (``fusion:kLoop``, ``custom-call:__cudnn$convForward``)."""
    start = hlo_text.find("ENTRY")
    if start < 0:
        raise ValueError("the HLO text has no ENTRY computation; pass compiled.as_text()")
    entry = hlo_text[start:]
    end = entry.find("\n}")
    kinds: Counter[str] = Counter()
    for line in entry[: end if end >= 0 else len(entry)].splitlines()[1:]:
        if "=" not in line:
            continue
        match = _OP.search(line.split("=", 1)[1])
        if match is None or match.group(1) in _NOT_KERNELS:
            continue
        kind = match.group(1)
        detail = _DETAIL.search(line) if kind in ("fusion", "custom-call") else None
        kinds[kind if detail is None else f"{kind}:{detail.group(1) or detail.group(2)}"] += 1
    return dict(kinds.most_common())


@dataclass(frozen=True)
class FusedCostModel:
    """Per-device cost of a fused step as affine functions of the width ``K``.

    Measured at a fixed per-member batch ``batch_size`` on one member plan's mesh.

    Attributes:
      batch_size: samples per member per step.
      widths: the widths compiled, increasing.
      flops, bytes_accessed, kernels: measured per-device FLOPs, memory traffic (bytes) and
        kernels of the compiled fused step at each of ``widths``.
      peak_bytes: compiled peak per device of the fused step at each of ``widths`` (the
        planner's figure, `scamp_jax.planning.fusion.FusedStepCompiler.estimate`), bytes; empty: not
        measured (a group then books ``width`` times a member's peak).
      state_bytes: parameters, optimizer state and the rest of all members per device at each of
        ``widths`` (the same estimates), bytes; empty: 0.
      member_prefetch, member_batch, eval_peak: the member plan's prefetched batch (bytes per
        device at ``member_batch`` samples) and evaluation peak (bytes per device; 0: not
        planned). With ``peak_bytes`` these give what a group books, by the engine's rule
        (`scamp_jax.scheduling.booking.group_bytes`, as `scamp_jax.planning.fusion.plan_fusion`).
    """

    batch_size: int
    widths: tuple[int, ...]
    flops: tuple[float, ...]
    bytes_accessed: tuple[float, ...]
    kernels: tuple[int, ...]
    peak_bytes: tuple[int, ...] = ()
    state_bytes: tuple[int, ...] = ()
    member_prefetch: int = 0
    member_batch: int = 0
    eval_peak: int = 0

    def __post_init__(self) -> None:
        n = len(self.widths)
        if n < 2 or sorted(set(self.widths)) != list(self.widths):
            raise ValueError(f"widths={self.widths} must be at least two increasing widths")
        if not len(self.flops) == len(self.bytes_accessed) == len(self.kernels) == n:
            raise ValueError("flops, bytes_accessed and kernels need one value per width")
        if self.peak_bytes and len(self.peak_bytes) != n:
            raise ValueError("peak_bytes needs one value per width (or none)")
        if self.state_bytes and len(self.state_bytes) != n:
            raise ValueError("state_bytes needs one value per width (or none)")

    def group_bytes(self, solo: TrialProfile, width: int) -> int:
        """Bytes per device a group of ``width`` members like ``solo`` books: the engine's rule
        (`scamp_jax.scheduling.booking.group_bytes`) on the fused step's peak and the stacked
        state (measured at ``widths``, affine between them); without measured peaks, ``width``
        times the member's booking (an upper bound)."""
        if not self.peak_bytes:
            return solo.bytes_per_device * width
        state = round(self._fit(self.state_bytes, width)) if self.state_bytes else 0
        return group_bytes(round(self._fit(self.peak_bytes, width)), state,
                           member_prefetch=self.member_prefetch, width=width,
                           batch=self.batch_size, member_batch=self.member_batch or self.batch_size,
                           eval_peak=self.eval_peak)

    def _fit(self, values: Sequence[float], width: int) -> float:
        """Affine through the two measured widths nearest ``width`` (never below zero)."""
        ws = self.widths
        i = max(0, min(len(ws) - 2, sum(w <= width for w in ws) - 1))
        (w0, w1), (y0, y1) = ws[i : i + 2], values[i : i + 2]
        slope = (y1 - y0) / (w1 - w0)
        return max(0.0, y0 + slope * (width - w0))

    def group_profile(self, solo: TrialProfile, width: int,
                      bytes_per_device: int | None = None) -> TrialProfile:
        """The `TrialProfile` of ``width`` fused trials like ``solo`` (same devices, batch, steps).

        FLOPs, traffic and kernels come from the fit; collectives scale with the members'
        stacked gradients (``width`` times the solo bytes); memory is ``bytes_per_device`` (a
        `scamp_jax.planning.fusion.FusionPlan`'s peak) or, when not given, `group_bytes`.
        """
        if width < 1:
            raise ValueError(f"{width=} must be at least 1")
        if solo.batch_size != self.batch_size:
            raise ValueError(
                f"the solo trial trains batch {solo.batch_size}, the cost model was measured at "
                f"{self.batch_size} per member; measure it at the trial's batch"
            )
        peak = (bytes_per_device if bytes_per_device is not None
                else self.group_bytes(solo, width))
        return TrialProfile(
            key=solo.key, devices=solo.devices, bytes_per_device=peak,
            batch_size=solo.batch_size, flops_per_step=self._fit(self.flops, width),
            bytes_accessed_per_step=self._fit(self.bytes_accessed, width),
            comm_bytes_per_step=solo.comm_bytes_per_step * width, steps=solo.steps,
            kernels_per_step=round(self._fit(self.kernels, width)),
            setup_seconds=solo.setup_seconds, architecture=solo.architecture, trials=width,
        )

    def throughput_gain(self, solo: TrialProfile, cluster: ClusterModel, width: int) -> float:
        """Trials per second of a group of ``width`` over one member alone, on ``cluster``:
        ``width * step_seconds(group of 1) / step_seconds(group of width)`` (both from the
        fit, so the solo and fused costs come from the same compiles)."""
        one = self.group_profile(solo, 1)
        return width * step_seconds(one, cluster) / step_seconds(
            self.group_profile(solo, width), cluster)


def measure_fused_costs(
    model: nnx.Module,
    sample_batch: Any,
    plan: Plan,
    *,
    batch_size: int,
    widths: Sequence[int] = (1, 2, 4),
    optimizer: optax.GradientTransformation | None = None,
    loss_fn: LossFn | None = None,
) -> FusedCostModel:
    """Compile the fused step of ``model`` at ``widths`` on ``plan``'s mesh and read its costs.

    Args:
      model: abstract Flax NNX module (``nnx.eval_shape``).
      sample_batch: one member's batch shapes ``(B, ...)``.
      plan: a member plan (`scamp_jax.planning.planner.plan_mesh`); its mesh and shardings are used.
      batch_size: samples per member.
      widths: at least two increasing widths to compile.
      optimizer, loss_fn: what the members train with.

    Returns:
      A `FusedCostModel` with per-device FLOPs, bytes accessed and kernels per width.
    """
    import jax
    import jax.numpy as jnp

    compiler = FusedStepCompiler(model, sample_batch, plan, optimizer, loss_fn)
    flops, traffic, kernels, peaks, states = [], [], [], [], []
    for width in widths:
        # memory as the planner sees it, and the compile
        estimate = compiler.estimate(width, batch_size)
        peaks.append(estimate.peak)
        states.append(estimate.params + estimate.opt_state + estimate.rest)
        batch = jax.tree.map(
            lambda x, w=width: jax.ShapeDtypeStruct((w, batch_size, *x.shape[1:]), x.dtype),
            sample_batch)
        # The same lowering and options as the estimate, so JAX reuses its executable.
        compiled = compiler._step.lower(
            stack_abstract(compiler.params, width), stack_abstract(compiler.opt_state, width),
            stack_abstract(compiler.rest, width), batch,
            jax.ShapeDtypeStruct((width,), jnp.bool_),
        ).compile(compiler.compiler_options)
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        text = compiled.as_text()
        if not cost or text is None:
            raise RuntimeError(
                f"XLA on {plan.devices[0].platform} gives no cost analysis or HLO text for the "
                "compiled step; measure fused costs on a backend that does (CPU, GPU, TPU)")
        flops.append(float(cost.get("flops", 0.0)))
        traffic.append(float(cost.get("bytes accessed", 0.0)))
        kernels.append(entry_kernels(text))
    return FusedCostModel(batch_size=batch_size, widths=tuple(widths), flops=tuple(flops),
                          bytes_accessed=tuple(traffic), kernels=tuple(kernels),
                          peak_bytes=tuple(peaks), state_bytes=tuple(states),
                          member_prefetch=int(plan.prefetch_bytes),
                          member_batch=int(plan.batch_size),
                          eval_peak=int(plan.eval_peak_bytes) if plan.eval_chunk else 0)


def group_width(solo: TrialProfile, cap: int, usable_bytes: int,
                model: FusedCostModel | None = None) -> int:
    """Widest group of up to ``cap`` members like ``solo`` whose memory fits ``usable_bytes``
    per device (``model.group_bytes``; without a model, ``width`` times the solo peak); at
    least 1 (a trial that runs alone)."""
    if cap < 1:
        raise ValueError(f"{cap=} must be at least 1")
    for width in range(cap, 1, -1):
        held = (model.group_bytes(solo, width) if model is not None
                else solo.bytes_per_device * width)
        if held <= usable_bytes:
            return width
    return 1


def fused_profiles(
    profiles: Sequence[TrialProfile],
    signatures: Sequence[Any],
    families: Sequence[int],
    models: Mapping[Any, FusedCostModel],
    *,
    cap: int,
    usable_bytes: int,
) -> tuple[list[TrialProfile], dict[int, tuple[int, ...]]]:
    """The study's trials as the engine with fusion schedules them: groups and lone trials.

    ``profiles[i]`` is trial ``i``'s solo profile (its key), ``signatures[i]`` its
    architecture, ``families[i]`` the proposed trial it arrived with (a proposal and the
    siblings enqueued for it arrive together and are grouped together, as the engine's
    forming buffer holds a proposal until its siblings are planned). Groups come from
    `scamp_jax.scheduling.grouping.form_groups`, the engine's rule, within each family; a group
    of two or more becomes one profile (``models[signature].group_profile``, key: its first
    member's key, memory `FusedCostModel.group_bytes`), a group of one stays the trial's own
    profile.

    Returns ``(profiles in arrival order of their first member, {profile key: member keys})``.
    """
    from scamp_jax.scheduling.grouping import FusionCandidate, form_groups

    if not len(profiles) == len(signatures) == len(families):
        raise ValueError("profiles, signatures and families need one entry per trial")
    by_family: dict[int, list[int]] = {}
    for i, family in enumerate(families):
        by_family.setdefault(family, []).append(i)
    out: list[tuple[int, TrialProfile]] = []
    members: dict[int, tuple[int, ...]] = {}
    for indices in by_family.values():
        candidates = [FusionCandidate(i, signatures[i], i,
                                      group_width(profiles[i], cap, usable_bytes,
                                                  models.get(signatures[i])))
                      for i in indices]
        for group in form_groups(candidates):
            first = profiles[group[0]]
            keys = tuple(profiles[i].key for i in group)
            if len(group) == 1:
                out.append((group[0], first))
            else:
                out.append((group[0], models[signatures[group[0]]].group_profile(
                    first, len(group))))
            members[first.key] = keys
    out.sort(key=lambda pair: pair[0])
    return [p for _, p in out], members
