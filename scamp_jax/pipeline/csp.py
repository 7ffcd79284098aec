"""Causal synchronous parallel (CSP) scheduling of subnets in a supernet pipeline.

The rule (NASPipe, ASPLOS 2022), applied per stage: subnet ``b`` may start its forward on stage
``s`` only when no earlier subnet ``w < b`` that has not yet finished its backward on ``s`` uses a
trainable parameter of ``s`` that ``b`` also uses. A stage applies a subnet's update right after
that subnet's backward on it. Every parameter therefore sees reads and updates in sequence-id
order, and the trained supernet equals the one trained by running the subnets one after another.

Everything here is pure Python over small integers: the whole schedule is computed ahead of time,
so the executor can also use it to prefetch the chosen blocks of upcoming subnets.
"""

from __future__ import annotations

from collections.abc import Sequence

from scamp_jax.pipeline.schedules import BACKWARD, FORWARD, Op, Schedule, sorted_ops

#: Parameter key of the shared (non-choice) parameters of a stage: the stem lives on the first
#: stage, the head on the last.
SHARED = "shared"

ParamKey = tuple[int, int] | str


def check_lengths(subnets: Sequence[Sequence[int]], bounds: Sequence[tuple[int, int]]) -> None:
    """Raise `ValueError` unless every subnet has one choice per layer the stages ``bounds``
    hold (the last stage's stop)."""
    if not bounds:
        raise ValueError("no stages' bounds: pass split_layers(num_layers, num_stages)")
    layers = bounds[-1][1]
    for i, subnet in enumerate(subnets):
        if len(subnet) != layers:
            raise ValueError(f"subnet {i} has {len(subnet)} choices for the {layers} layers of "
                             "the stages' bounds; give one candidate index per layer")


def split_layers(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Contiguous, equal ranges of choice layers per stage: ``((start, stop), ...)``, S entries.

    Raises:
      ValueError: if ``num_layers`` is not a positive multiple of ``num_stages`` (every stage
        holds the same number of layers so one compiled stage program serves all stages).
    """
    if num_stages < 1:
        raise ValueError(f"{num_stages=} must be at least 1")
    if num_layers < num_stages or num_layers % num_stages:
        raise ValueError(
            f"{num_layers=} is not a positive multiple of {num_stages=}; use "
            f"{max(1, num_layers // num_stages) * num_stages} layers or a stage count that "
            "divides the layers"
        )
    per = num_layers // num_stages
    return tuple((s * per, (s + 1) * per) for s in range(num_stages))


def stage_param_keys(
    choices: Sequence[int],
    bounds: Sequence[tuple[int, int]],
    stage: int,
    train_shared: bool,
) -> frozenset[ParamKey]:
    """Trainable parameters of ``stage`` that a subnet with ``choices`` reads and updates.

    Returns ``{(layer, choice), ...}`` for the stage's layers, plus `SHARED` on the first and
    last stage when the stem and head are trained (``train_shared``).
    """
    start, stop = bounds[stage]
    keys: set[ParamKey] = {(layer, int(choices[layer])) for layer in range(start, stop)}
    if train_shared and stage in (0, len(bounds) - 1):
        keys.add(SHARED)
    return frozenset(keys)


def csp_schedule(
    subnets: Sequence[Sequence[int]],
    bounds: Sequence[tuple[int, int]],
    *,
    train_shared: bool = False,
    max_inflight: int | None = None,
    enforce_dependencies: bool = True,
) -> Schedule:
    """Greedy tick-by-tick CSP schedule of ``subnets`` (in sequence-id order) over the stages.

    At every tick each stage runs at most one op. A backward whose input gradient has arrived is
    preferred (it frees memory and unblocks later subnets), lowest sequence id first; otherwise a
    forward whose input has arrived and that the CSP rule allows, lowest sequence id first. A
    subnet may overtake an earlier blocked one only where they share no trainable parameter.

    Args:
      subnets: N choice vectors, one int per choice layer; index = sequence id.
      bounds: the stages' ``(start, stop)`` layer ranges (see `split_layers`).
      train_shared: the stem and head are trained, so every pair of subnets conflicts on the
        first and last stage (False: they are frozen, as in the NASPipe artifact).
      max_inflight: most subnets between their first forward and their last backward on stage 0
        (default S, enough to keep every stage busy). The lowest unfinished subnet is always
        admitted, so the schedule cannot deadlock.
      enforce_dependencies: False drops the CSP rule, giving the no-dependency ideal pipeline
        (its result is *not* that of sequential training; it is the utilisation bound).
    Returns:
      the `Schedule` named ``"csp"`` (``"ideal"`` without dependencies).
    """
    n, s_count = len(subnets), len(bounds)
    if n < 1:
        raise ValueError(f"{n=} subnets; pass at least one choice vector")
    check_lengths(subnets, bounds)
    inflight_cap = s_count if max_inflight is None else max_inflight
    if inflight_cap < 1:
        raise ValueError(f"{max_inflight=} must be at least 1 (1 gives sequential order)")
    uses = [
        [stage_param_keys(c, bounds, s, train_shared) for s in range(s_count)] for c in subnets
    ]
    fwd: list[list[int | None]] = [[None] * s_count for _ in range(n)]
    bwd: list[list[int | None]] = [[None] * s_count for _ in range(n)]
    # Lowest subnet not yet finished on each stage: everything below it is done there.
    low = [0] * s_count
    inflight: list[int] = []  # started on stage 0, backward on stage 0 not done; ascending
    next_new = 0  # lowest subnet not yet started on stage 0 (subnets start in any order)
    started = [False] * n
    ops: list[Op] = []

    def allowed(b: int, s: int) -> bool:
        if not enforce_dependencies:
            return True
        mine = uses[b][s]
        return all(bwd[w][s] is not None or not (mine & uses[w][s]) for w in range(low[s], b))

    t = 0
    done = 0
    idle = 0
    while done < 2 * n * s_count:
        progressed = False
        for s in range(s_count):
            choice: Op | None = None
            for b in inflight:
                f_here = fwd[b][s]
                if f_here is None or f_here >= t or bwd[b][s] is not None:
                    continue
                after = bwd[b][s + 1] if s + 1 < s_count else f_here
                if after is not None and after < t:
                    choice = Op(t, s, b, BACKWARD, 0, apply=True)
                    break
            if choice is None and s > 0:
                for b in inflight:
                    prev = fwd[b][s - 1]
                    if fwd[b][s] is None and prev is not None and prev < t and allowed(b, s):
                        choice = Op(t, s, b, FORWARD)
                        break
            if choice is None and s == 0:
                lowest_open = min(low)
                for b in range(next_new, min(n, next_new + inflight_cap)):
                    if started[b]:
                        continue
                    room = len(inflight) < inflight_cap or b == lowest_open
                    if room and allowed(b, 0):
                        choice = Op(t, 0, b, FORWARD)
                        break
            if choice is None:
                continue
            ops.append(choice)
            done += 1
            progressed = True
            b = choice.subnet
            if choice.kind == FORWARD:
                fwd[b][s] = t
                if s == 0:
                    started[b] = True
                    inflight.append(b)
                    inflight.sort()
                    while next_new < n and started[next_new]:
                        next_new += 1
            else:
                bwd[b][s] = t
                while low[s] < n and bwd[low[s]][s] is not None:
                    low[s] += 1
                if s == 0:
                    inflight.remove(b)
        idle = 0 if progressed else idle + 1
        if idle > 2:
            # Outputs take one tick to arrive, so two idle ticks in a row mean nothing can move.
            raise RuntimeError(f"CSP scheduler made no progress at tick {t}")
        t += 1
    name = "csp" if enforce_dependencies else "ideal"
    return Schedule(name, s_count, n, 1, sorted_ops(ops))


def ideal_schedule(
    subnets: Sequence[Sequence[int]],
    bounds: Sequence[tuple[int, int]],
    *,
    max_inflight: int | None = None,
) -> Schedule:
    """The same pipeline without any CSP stall: the utilisation bound for `csp_schedule`."""
    return csp_schedule(subnets, bounds, max_inflight=max_inflight, enforce_dependencies=False)


def check_causality(
    schedule: Schedule,
    subnets: Sequence[Sequence[int]],
    bounds: Sequence[tuple[int, int]],
    train_shared: bool,
) -> None:
    """Verify that every parameter is read and updated in sequence-id order.

    For every stage and every pair ``w < b`` sharing a trainable parameter of that stage, ``b``'s
    first forward there must come after ``w``'s applying backward there (update applied at the end
    of that tick). This is what makes a pipelined run equal to the sequential one.

    Raises:
      ValueError: naming the first pair of subnets that would see updates out of order.
    """
    check_lengths(subnets, bounds)
    ticks = schedule.op_ticks()
    m_count = schedule.num_microbatches
    for s in range(schedule.num_stages):
        users: dict[ParamKey, int] = {}  # parameter -> last subnet (so far) that used it
        for b in range(schedule.num_subnets):
            first_f = min(ticks[(b, s, FORWARD, m)] for m in range(m_count))
            for key in stage_param_keys(subnets[b], bounds, s, train_shared):
                w = users.get(key)
                if w is not None:
                    w_done = max(ticks[(w, s, BACKWARD, m)] for m in range(m_count))
                    if first_f <= w_done:
                        raise ValueError(
                            f"subnet {b} reads {key} on stage {s} at tick {first_f} before "
                            f"subnet {w} updates it at tick {w_done}"
                        )
                users[key] = b
