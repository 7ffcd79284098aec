"""What a trial or a fused group books on each of its devices: one byte rule for all.

A trial holds more than its training step's compiled peak: the next batch is prefetched onto its
devices while the current step runs, and evaluation runs a forward pass while the optimizer state
and that prefetched batch stay resident. The pool must book the most of these at any time, or
packed trials run out of memory. The planner (`scamp_jax.planning.planner.Plan`), the fused
planner (`scamp_jax.planning.fusion.plan_fusion`), the HPO engine and the cluster simulator
(`scamp_jax.sim`) all take their figure from the functions here, so a simulated trial books
exactly what the engine books for the same plan. Plain integers in, integers out (bytes per
device); no JAX.
"""

from __future__ import annotations

from typing import Any


def solo_bytes(step_peak: int, prefetch: int, *, eval_peak: int = 0, opt_state: int = 0,
               allowance: int = 0) -> int:
    """Bytes per device a lone trial books.

    Args:
      step_peak: the compiled training step's peak per device, bytes.
      prefetch: one training batch per device (the next batch, placed while a step runs), bytes.
      eval_peak: the compiled evaluation forward's peak per device at its planned chunk, bytes
        (0: evaluation not planned).
      opt_state: optimizer state per device, bytes (resident while evaluating).
      allowance: bytes per device for memory XLA's figures do not include (CUDA context,
        cuBLAS/cuDNN workspaces; `scamp_jax.planning.plan_cache.resolve_allowance`; 0 on CPU).

    Returns:
      ``max(step_peak + prefetch, eval_peak + opt_state + prefetch) + allowance`` (the second
      term only when evaluation is planned).
    """
    train = int(step_peak) + int(prefetch)
    evaluate = int(eval_peak) + int(opt_state) + int(prefetch) if eval_peak else 0
    return max(train, evaluate) + int(allowance)


def group_bytes(fused_step_peak: int, stacked_state: int, *, member_prefetch: int, width: int,
                batch: int, member_batch: int, eval_peak: int = 0, allowance: int = 0) -> int:
    """Bytes per device a fused group of ``width`` members books.

    Args:
      fused_step_peak: the compiled fused step's peak per device at ``(width, batch)``, bytes.
      stacked_state: parameters, optimizer state and the rest of all ``width`` members per
        device, bytes (resident while one member evaluates).
      member_prefetch: one member's prefetched batch per device at ``member_batch``, bytes.
      width: members in the group.
      batch: samples per member per step.
      member_batch: the batch ``member_prefetch`` was measured at (the member plan's).
      eval_peak: a member's evaluation peak per device (its plan's), bytes; 0: not planned.
      allowance: the member plan's allowance for memory XLA does not see, once per group (the
        group is one program in one process).

    Returns:
      Training (fused step + every member's prefetched batch) or evaluating one member (its
      forward + the stacked state + the prefetched batches), whichever is larger. One member's
      parameters count twice while it evaluates, which errs large.
    """
    if width < 1:
        raise ValueError(f"{width=} must be at least 1")
    prefetch = width * int(member_prefetch) * int(batch) // max(int(member_batch), 1)
    train = int(fused_step_peak) + prefetch
    evaluate = int(eval_peak) + int(stacked_state) + prefetch if eval_peak else 0
    return max(train, evaluate) + int(allowance)


def booked_bytes(plan: Any, *, step_extra: int = 0) -> int:
    """Bytes per device the pool books for ``plan``: a `scamp_jax.planning.planner.Plan` (a lone
    trial, `solo_bytes`) or a `scamp_jax.planning.fusion.FusionPlan` (a fused group,
    `group_bytes`). Figures a plan lacks (a plan built by hand) count as 0.

    ``step_extra``: bytes per device the step that runs holds beyond the plan's compiled step
    (a trial spanning MPI ranks: the cross-rank reduction's buffers,
    `scamp_jax.distributed.data_parallel.mpi_mean_bytes`), added to a lone trial's step peak.
    """
    if hasattr(plan, "width") and hasattr(plan, "plan"):
        member, e = plan.plan, plan.estimate
        return group_bytes(
            plan.peak_bytes_per_device, e.params + e.opt_state + e.rest,
            member_prefetch=int(getattr(member, "prefetch_bytes", 0)), width=plan.width,
            batch=plan.batch_size, member_batch=int(getattr(member, "batch_size", plan.batch_size)),
            eval_peak=int(getattr(member, "eval_peak_bytes", 0)),
            allowance=int(getattr(member, "allowance_bytes", 0)))
    estimate = getattr(plan, "estimate", None)
    return solo_bytes(
        int(plan.peak_bytes_per_device) + int(step_extra), int(getattr(plan, "prefetch_bytes", 0)),
        eval_peak=int(getattr(plan, "eval_peak_bytes", 0)) if getattr(plan, "eval_chunk", 0)
        else 0,
        opt_state=int(getattr(estimate, "opt_state", 0)),
        allowance=int(getattr(plan, "allowance_bytes", 0)))
