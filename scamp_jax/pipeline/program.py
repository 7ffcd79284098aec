"""Turn a `Schedule` into per-tick instructions for the executor (pure numpy, no devices).

For every tick and stage it decides which buffer slots an operation reads and writes:

- *window slots* hold the chosen blocks (weights and optimizer state) of one in-flight subnet on
  one stage; a block is prefetched from the host store into a slot up to ``prefetch_ahead`` ticks
  before its first forward, never before the previous user of any of its blocks has written that
  block back, and written back after the subnet's update;
- *activation slots* hold a stage's input for a (subnet, microbatch) from its arrival until the
  backward reuses it (backwards recompute the stage's forward from the saved input);
- *gradient slots* hold the gradient arriving from the next stage until the backward uses it.

Slots are assigned greedily (lowest free index), so buffer sizes follow from the schedule.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from scamp_jax.pipeline.schedules import BACKWARD, FORWARD, Schedule

IDLE, FWD, BWD = 0, 1, 2

#: Column names of the per-(tick, stage) integer instruction table, then ``choices`` (n layers)
#: and ``prefetch_choices`` (n layers).
FIELDS = (
    "kind",  # IDLE / FWD / BWD
    "subnet",  # sequence id of the op's subnet (-1 when idle)
    "microbatch",
    "window_slot",  # window slot holding the subnet's blocks on this stage
    "act_slot",  # activation slot read (stage input)
    "grad_slot",  # gradient slot read by a backward (not on the last stage)
    "apply",  # 1: this backward applies the subnet's update and writes the blocks back
    "recv_act",  # slot that stores the activation arriving at the end of the tick (-1: none)
    "recv_grad",  # slot that stores the gradient arriving at the end of the tick (-1: none)
    "prefetch_slot",  # window slot to fill from the host store at the start of the tick (-1)
)
NUM_FIELDS = len(FIELDS)
COL = {name: i for i, name in enumerate(FIELDS)}


@dataclass(frozen=True)
class TickProgram:
    """Per-tick executor instructions.

    Attributes:
      table: int32 (T, S, NUM_FIELDS + 2 n): `FIELDS`, then the op's choice per stage layer,
        then the choice per stage layer of the prefetched subnet.
      layers_per_stage: n.
      window_slots, act_slots, grad_slots: buffer sizes (slots) the program needs per stage.
      prefetch_ahead: ticks a prefetch may run ahead of its first forward.
    """

    table: np.ndarray
    layers_per_stage: int
    window_slots: int
    act_slots: int
    grad_slots: int
    prefetch_ahead: int

    @property
    def ticks(self) -> int:
        """Number of ticks T."""
        return int(self.table.shape[0])

    def column(self, name: str) -> np.ndarray:
        """One field for all ticks and stages: (T, S)."""
        return self.table[:, :, COL[name]]


class _Slots:
    """Greedy interval allocation: a slot is free again once its occupant's release tick passed."""

    def __init__(self) -> None:
        self.release: list[int] = []

    def take(self, start: int, release: int, strict: bool) -> int:
        for i, r in enumerate(self.release):
            if r < start or (not strict and r == start):
                self.release[i] = release
                return i
        self.release.append(release)
        return len(self.release) - 1


def build_program(
    schedule: Schedule,
    subnets: Sequence[Sequence[int]],
    bounds: Sequence[tuple[int, int]],
    *,
    prefetch_ahead: int = 1,
) -> TickProgram:
    """Assign buffer slots and prefetch ticks for every operation of ``schedule``.

    Args:
      schedule: a validated schedule over ``len(subnets)`` subnets.
      subnets: choice vectors (L,) per sequence id.
      bounds: equal ``(start, stop)`` layer ranges per stage.
      prefetch_ahead: how many ticks before its first forward a subnet's blocks may be fetched
        (0: in the tick of the forward itself).
    Returns:
      the `TickProgram`.
    """
    if prefetch_ahead < 0:
        raise ValueError(f"{prefetch_ahead=} must be >= 0 ticks")
    s_count, n_layers = schedule.num_stages, bounds[0][1] - bounds[0][0]
    ticks = schedule.op_ticks()
    m_count = schedule.num_microbatches
    table = np.zeros((schedule.ticks, s_count, NUM_FIELDS + 2 * n_layers), np.int32)
    table[:, :, COL["subnet"]] = -1
    for name in ("recv_act", "recv_grad", "prefetch_slot"):
        table[:, :, COL[name]] = -1
    choice_col, pf_col = NUM_FIELDS, NUM_FIELDS + n_layers

    def stage_choices(b: int, s: int) -> list[int]:
        start, stop = bounds[s]
        return [int(c) for c in subnets[b][start:stop]]

    # Window slots and prefetch ticks, per stage, in order of first forward.
    window_slot: dict[tuple[int, int], int] = {}
    n_window = 0
    for s in range(s_count):
        spans = []
        for b in range(schedule.num_subnets):
            first = min(ticks[(b, s, FORWARD, m)] for m in range(m_count))
            last = max(ticks[(b, s, BACKWARD, m)] for m in range(m_count))
            spans.append((first, last, b))
        spans.sort()
        # Subnets resident at once without prefetching ahead; each tick of look-ahead can add
        # one more (one prefetch per tick), which bounds the window.
        # (At each span's first tick: spans begun by then less spans ended before it.)
        begins, ends = [f for f, _, _ in spans], sorted(last for _, last, _ in spans)
        overlap = max(bisect.bisect_right(begins, first) - bisect.bisect_left(ends, first)
                      for first, _, _ in spans)
        capacity = overlap + prefetch_ahead
        slots = _Slots()
        written: dict[tuple[int, int], int] = {}  # block (local layer, choice) -> write-back tick
        prefetch_busy: set[int] = set()
        for first, last, b in spans:
            blocks = list(enumerate(stage_choices(b, s)))
            ready = max((written.get(k, -1) + 1 for k in blocks), default=0)
            if ready > first:
                raise ValueError(
                    f"subnet {b} starts on stage {s} at tick {first} before an earlier subnet "
                    f"writes back a shared block (tick {ready - 1}); only causal schedules "
                    "(sequential, gpipe, csp) can run"
                )
            tick = max(first - prefetch_ahead, ready, 0)
            # Earliest tick with a free (or still unallocated) slot; one fetch per tick.
            while tick < first and (
                tick in prefetch_busy
                or (len(slots.release) >= capacity and not any(r < tick for r in slots.release))
            ):
                tick += 1
            slot = slots.take(tick, last, strict=True)
            prefetch_busy.add(tick)
            window_slot[(b, s)] = slot
            table[tick, s, COL["prefetch_slot"]] = slot
            table[tick, s, pf_col : pf_col + n_layers] = stage_choices(b, s)
            for k in blocks:
                written[k] = last
        n_window = max(n_window, len(slots.release))

    # Activation slots (stage s > 0) and gradient slots (stage s < S-1) per (subnet, microbatch).
    act_slot: dict[tuple[int, int, int], int] = {}
    grad_slot: dict[tuple[int, int, int], int] = {}
    n_act = n_grad = 1
    for s in range(s_count):
        acts, grads = _Slots(), _Slots()
        arrivals = []
        for b in range(schedule.num_subnets):
            for m in range(m_count):
                use = ticks[(b, s, BACKWARD, m)]
                if s > 0:
                    arrivals.append((ticks[(b, s - 1, FORWARD, m)], use, "act", b, m))
                if s < s_count - 1:
                    arrivals.append((ticks[(b, s + 1, BACKWARD, m)], use, "grad", b, m))
        for arrive, use, what, b, m in sorted(arrivals):
            # The slot is read during tick `use` and may be refilled at the end of that tick.
            if what == "act":
                act_slot[(b, m, s)] = acts.take(arrive, use, strict=False)
                table[arrive, s, COL["recv_act"]] = act_slot[(b, m, s)]
            else:
                grad_slot[(b, m, s)] = grads.take(arrive, use, strict=False)
                table[arrive, s, COL["recv_grad"]] = grad_slot[(b, m, s)]
        n_act, n_grad = max(n_act, len(acts.release)), max(n_grad, len(grads.release))

    for op in schedule.ops:
        row = table[op.tick, op.stage]
        row[COL["kind"]] = FWD if op.kind == FORWARD else BWD
        row[COL["subnet"]] = op.subnet
        row[COL["microbatch"]] = op.microbatch
        row[COL["window_slot"]] = window_slot[(op.subnet, op.stage)]
        row[COL["act_slot"]] = act_slot.get((op.subnet, op.microbatch, op.stage), 0)
        row[COL["grad_slot"]] = grad_slot.get((op.subnet, op.microbatch, op.stage), 0)
        row[COL["apply"]] = int(op.kind == BACKWARD and op.apply)
        row[choice_col : choice_col + n_layers] = stage_choices(op.subnet, op.stage)
    return TickProgram(table, n_layers, max(1, n_window), n_act, n_grad, prefetch_ahead)
