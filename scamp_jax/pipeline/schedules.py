"""Pipeline schedules as plain data: which subnet runs forward or backward on which stage, when.

A schedule is decided entirely on the host before anything runs. Time is counted in *ticks*: in one
tick every stage performs at most one operation (the forward or the backward of one microbatch of
one subnet) and then sends its output to its neighbour, which can use it from the next tick on.

Three generators share this representation:

- `sequential_schedule`: one subnet at a time through the stages (the reference order).
- `gpipe_schedule`: one subnet at a time, its batch split into microbatches that are pipelined,
  with a flush (all updates applied) before the next subnet starts.
- `csp_schedule` (in `scamp_jax.pipeline.csp`): several subnets in flight under the causal
  synchronous parallel rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Op:
    """One stage operation.

    Attributes:
      tick: when it runs (0-based).
      stage: which pipeline stage runs it.
      subnet: sequence id of the subnet (index into the schedule's subnet list).
      kind: `FORWARD` or `BACKWARD`.
      microbatch: index of the microbatch of the subnet's batch (0 unless microbatched).
      apply: for a backward, whether the stage applies the subnet's accumulated update right after
        it (true for the last microbatch's backward on that stage).
    """

    tick: int
    stage: int
    subnet: int
    kind: str
    microbatch: int = 0
    apply: bool = False


@dataclass(frozen=True)
class Schedule:
    """A complete pipeline schedule.

    Attributes:
      name: ``"sequential"``, ``"gpipe"``, ``"csp"`` or ``"ideal"``.
      num_stages: pipeline depth S.
      num_subnets: N subnets, with sequence ids 0..N-1.
      num_microbatches: M microbatches per subnet batch (1 except for GPipe).
      ops: every operation, sorted by (tick, stage).
    """

    name: str
    num_stages: int
    num_subnets: int
    num_microbatches: int
    ops: tuple[Op, ...]

    @property
    def ticks(self) -> int:
        """Length of the schedule in ticks (last tick used + 1)."""
        return 1 + max(op.tick for op in self.ops) if self.ops else 0

    @property
    def busy_stage_ticks(self) -> int:
        """Number of (stage, tick) pairs that run an operation."""
        return len(self.ops)

    @property
    def utilization(self) -> float:
        """Busy stage-ticks / (stages x ticks), in [0, 1]."""
        total = self.num_stages * self.ticks
        return self.busy_stage_ticks / total if total else 0.0

    def samples_per_tick(self, batch_size: int) -> float:
        """Training samples per tick, for subnets of ``batch_size`` samples each."""
        return self.num_subnets * batch_size / self.ticks if self.ticks else 0.0

    def op_ticks(self) -> dict[tuple[int, int, str, int], int]:
        """Map ``(subnet, stage, kind, microbatch) -> tick``."""
        return {(o.subnet, o.stage, o.kind, o.microbatch): o.tick for o in self.ops}


def sorted_ops(ops: Sequence[Op]) -> tuple[Op, ...]:
    """Ops sorted by (tick, stage), the order the executor consumes them."""
    return tuple(sorted(ops, key=lambda o: (o.tick, o.stage)))


def _check_sizes(num_subnets: int, num_stages: int, num_microbatches: int = 1) -> None:
    if num_subnets < 1:
        raise ValueError(f"{num_subnets=} must be at least 1; pass the subnets to train")
    if num_stages < 1:
        raise ValueError(f"{num_stages=} must be at least 1 (one stage per device)")
    if num_microbatches < 1:
        raise ValueError(f"{num_microbatches=} must be at least 1; use 1 for no microbatching")


def gpipe_schedule(num_subnets: int, num_stages: int, num_microbatches: int) -> Schedule:
    """GPipe: each subnet's batch split into ``num_microbatches`` pipelined microbatches.

    All forwards of a subnet run first (microbatch m on stage s at tick ``base + m + s``), then all
    backwards in the same microbatch order, then the pipeline flushes: each stage applies the
    subnet's update with its last backward, and the next subnet starts only after that. One
    subnet takes ``2 * (M + S - 1)`` ticks.

    Args:
      num_subnets: N, subnets trained in sequence-id order.
      num_stages: S.
      num_microbatches: M (1 gives `sequential_schedule`).
    Returns:
      the `Schedule` (``N * 2 * (M + S - 1)`` ticks).
    """
    _check_sizes(num_subnets, num_stages, num_microbatches)
    m_count, s_count = num_microbatches, num_stages
    span = 2 * (m_count + s_count - 1)
    ops: list[Op] = []
    for b in range(num_subnets):
        base = b * span
        for m in range(m_count):
            for s in range(s_count):
                ops.append(Op(base + m + s, s, b, FORWARD, m))
                back = base + m_count + s_count - 1 + m + (s_count - 1 - s)
                ops.append(Op(back, s, b, BACKWARD, m, apply=m == m_count - 1))
    name = "sequential" if m_count == 1 else "gpipe"
    return Schedule(name, s_count, num_subnets, m_count, sorted_ops(ops))


def sequential_schedule(num_subnets: int, num_stages: int) -> Schedule:
    """One subnet at a time: forward through stages 0..S-1, backward S-1..0, update, next.

    This is the order (and the float computation) of training the subnets one after another;
    `csp_schedule` must reproduce its result bit for bit. ``2 * S`` ticks per subnet.
    """
    return gpipe_schedule(num_subnets, num_stages, 1)


def validate_schedule(schedule: Schedule) -> None:
    """Check the structural invariants every executable schedule must satisfy.

    Every (subnet, microbatch) runs forward and backward exactly once on every stage; forwards
    go through the stages in order and backwards in reverse order, each at least one tick after
    its predecessor (outputs travel between ticks); a backward on a stage follows that stage's
    forward; one op per stage per tick; exactly one applying backward per (subnet, stage), after
    all of that subnet's backwards on the stage.

    Raises:
      ValueError: naming the first violated rule.
    """
    seen: dict[tuple[int, int, str, int], int] = {}
    per_slot: set[tuple[int, int]] = set()
    for op in schedule.ops:
        key = (op.subnet, op.stage, op.kind, op.microbatch)
        if key in seen:
            raise ValueError(f"{key} appears twice in schedule {schedule.name!r}")
        seen[key] = op.tick
        if (op.tick, op.stage) in per_slot:
            raise ValueError(f"stage {op.stage} runs two ops at tick {op.tick}")
        per_slot.add((op.tick, op.stage))
    n, s_count, m_count = schedule.num_subnets, schedule.num_stages, schedule.num_microbatches
    applies: dict[tuple[int, int], Op] = {}
    for o in schedule.ops:
        if o.kind == BACKWARD and o.apply:
            if (o.subnet, o.stage) in applies:
                raise ValueError(f"subnet {o.subnet} applies its update twice on stage {o.stage}")
            applies[(o.subnet, o.stage)] = o
    for b in range(n):
        for m in range(m_count):
            for s in range(s_count):
                for kind in (FORWARD, BACKWARD):
                    if (b, s, kind, m) not in seen:
                        raise ValueError(f"subnet {b} microbatch {m} lacks {kind} on stage {s}")
                f, bk = seen[(b, s, FORWARD, m)], seen[(b, s, BACKWARD, m)]
                if s > 0 and f <= seen[(b, s - 1, FORWARD, m)]:
                    raise ValueError(f"forward of subnet {b} on stage {s} precedes stage {s - 1}")
                if bk <= f:
                    raise ValueError(f"backward of subnet {b} on stage {s} precedes its forward")
                if s < s_count - 1 and bk <= seen[(b, s + 1, BACKWARD, m)]:
                    raise ValueError(f"backward of subnet {b} on stage {s} precedes stage {s + 1}")
        for s in range(s_count):
            applying = applies.get((b, s))
            if applying is None:
                raise ValueError(f"subnet {b} never applies its update on stage {s}")
            last = max(seen[(b, s, BACKWARD, m)] for m in range(m_count))
            if applying.tick != last:
                raise ValueError(f"subnet {b} applies on stage {s} before its last backward")
