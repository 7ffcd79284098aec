"""Placement decisions: packing, distinct devices, no over-commit, no starvation, FIFO baseline."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scamp_jax.scheduling.placement import (
    DeviceOption,
    FixedPolicy,
    Placement,
    PoolSnapshot,
    ScampPolicy,
    TrialRequest,
    check_feasible,
    make_policy,
)
from scamp_jax.scheduling.pool import DevicePool

GIB = 2**30


def _start(pool: DevicePool, policy, queue: list[TrialRequest]) -> tuple[Placement, ...]:
    """One scheduling round: decide, allocate, drop started trials from the queue."""
    placements = policy.decide(pool.snapshot(), queue)
    by_key = {r.key: r for r in queue}
    for p in placements:
        pool.allocate(p, by_key[p.key])
    started = {p.key for p in placements}
    queue[:] = [r for r in queue if r.key not in started]
    return placements


def test_pure_packing_puts_small_trials_on_one_device_best_fit() -> None:
    pool = DevicePool([10 * GIB] * 4)
    queue = [TrialRequest(k, 1, 3 * GIB, arrival=k) for k in range(4)]
    placements = _start(pool, ScampPolicy(spread=False), queue)
    devices = {p.key: p.device_ids for p in placements}
    assert devices[0] == devices[1] == devices[2] == (0,)
    assert devices[3] == (1,)  # 4 x 30% does not fit on one device
    assert pool.snapshot().used == (9 * GIB, 3 * GIB, 0, 0)


def test_spread_uses_idle_devices_first_then_packs_by_memory() -> None:
    pool = DevicePool([10 * GIB] * 3)
    queue = [TrialRequest(0, 1, 6 * GIB, arrival=0), TrialRequest(1, 1, 3 * GIB, arrival=1),
             TrialRequest(2, 1, 5 * GIB, arrival=2)]
    placements = _start(pool, ScampPolicy(), queue)
    assert [p.device_ids for p in placements] == [(0,), (1,), (2,)]
    # Every device is busy now: the next trials share, on the device with the least free memory
    # that still holds them (best fit), and a device with fewer trials comes first.
    queue = [TrialRequest(3, 1, 4 * GIB, arrival=3), TrialRequest(4, 1, 5 * GIB, arrival=4),
             TrialRequest(5, 1, 1 * GIB, arrival=5)]
    placements = _start(pool, ScampPolicy(), queue)
    assert placements == (Placement(3, (0,)), Placement(4, (2,)), Placement(5, (1,)))
    assert pool.snapshot().used == (10 * GIB, 4 * GIB, 10 * GIB)


def test_no_sharing_gives_each_trial_its_own_device() -> None:
    pool = DevicePool([10 * GIB] * 4)
    queue = [TrialRequest(k, 1, 3 * GIB, arrival=k) for k in range(6)]
    placements = _start(pool, ScampPolicy(share_devices=False, spread=False), queue)
    assert sorted(p.device_ids for p in placements) == [(0,), (1,), (2,), (3,)]
    assert [r.key for r in queue] == [4, 5]


def test_multi_device_trial_gets_k_distinct_devices_best_fit() -> None:
    pool = DevicePool([10 * GIB] * 6)
    pool.allocate(Placement(100, (0,)), TrialRequest(100, 1, 8 * GIB, arrival=0))
    pool.allocate(Placement(101, (1, 2)), TrialRequest(101, 2, 5 * GIB, arrival=0))
    snapshot = pool.snapshot()
    request = TrialRequest(1, 3, 4 * GIB, arrival=1)
    # Device 0 has 2 GiB free (too little); 1 and 2 have 5 GiB (best fit), then an empty one.
    (packed,) = ScampPolicy(spread=False).decide(snapshot, [request])
    assert packed.device_ids == (1, 2, 3)
    # Balanced: the three idle devices.
    (spread,) = ScampPolicy().decide(snapshot, [request])
    assert spread.device_ids == (3, 4, 5)
    pool.allocate(packed, request)
    assert pool.snapshot().used[1:4] == (9 * GIB, 9 * GIB, 4 * GIB)


def test_exclusive_trial_takes_only_empty_devices_and_keeps_them() -> None:
    pool = DevicePool([10 * GIB] * 3)
    pool.allocate(Placement(100, (0,)), TrialRequest(100, 1, 1 * GIB, arrival=0))
    queue = [
        TrialRequest(1, 2, 1 * GIB, arrival=1, exclusive=True),
        TrialRequest(2, 1, 1 * GIB, arrival=2),
    ]
    placements = _start(pool, ScampPolicy(), queue)
    devices = {p.key: p.device_ids for p in placements}
    assert devices[1] == (1, 2)
    assert devices[2] == (0,)  # may not join the exclusive trial
    with pytest.raises(ValueError, match="exclusive"):
        pool.allocate(Placement(3, (1,)), TrialRequest(3, 1, 1, arrival=3))


def test_pool_rejects_over_commit_and_double_allocation() -> None:
    pool = DevicePool([10 * GIB] * 2)
    pool.allocate(Placement(1, (0,)), TrialRequest(1, 1, 6 * GIB, arrival=0))
    with pytest.raises(ValueError, match="over-commit device 0"):
        pool.allocate(Placement(2, (0,)), TrialRequest(2, 1, 5 * GIB, arrival=1))
    with pytest.raises(ValueError, match="already running"):
        pool.allocate(Placement(1, (1,)), TrialRequest(1, 1, 1, arrival=0))
    with pytest.raises(ValueError, match="distinct"):
        pool.allocate(Placement(3, (1, 1)), TrialRequest(3, 2, 1, arrival=0))
    with pytest.raises(ValueError, match="not running"):
        pool.release(7)
    pool.release(1)
    assert pool.snapshot().used == (0, 0)
    assert pool.running == {}


def test_check_feasible_and_decide_reject_impossible_requests() -> None:
    capacity = (10 * GIB, 10 * GIB)
    check_feasible(TrialRequest(0, 2, 10 * GIB, arrival=0), capacity)
    with pytest.raises(ValueError, match="needs 3 devices but the pool has 2"):
        check_feasible(TrialRequest(0, 3, GIB, arrival=0), capacity)
    with pytest.raises(ValueError, match="only 0 device"):
        check_feasible(TrialRequest(0, 1, 11 * GIB, arrival=0), capacity)
    snapshot = DevicePool(capacity).snapshot()
    for policy in (ScampPolicy(), FixedPolicy(1)):
        with pytest.raises(ValueError, match="smaller batch"):
            policy.decide(snapshot, [TrialRequest(0, 1, 11 * GIB, arrival=0)])


def test_make_policy() -> None:
    assert make_policy("scamp") == ScampPolicy()
    assert make_policy("fixed", devices_per_trial=4) == FixedPolicy(4)
    with pytest.raises(ValueError, match="unknown policy 'x'; choose one of: scamp, fixed"):
        make_policy("x")


def test_fixed_policy_is_fifo_and_exclusive() -> None:
    pool = DevicePool([10 * GIB] * 4)
    policy = FixedPolicy(devices_per_trial=2)
    queue = [TrialRequest(k, 1, GIB, arrival=k) for k in range(4)]
    placements = _start(pool, policy, queue)
    assert [p.key for p in placements] == [0, 1]
    assert [p.device_ids for p in placements] == [(0, 1), (2, 3)]
    # Even tiny trials do not share, and nothing overtakes the oldest waiting trial.
    assert _start(pool, policy, queue) == ()
    pool.release(1)
    queue.append(TrialRequest(9, 1, GIB, arrival=-1))  # arrived first: goes first
    assert _start(pool, policy, queue) == (Placement(9, (2, 3)),)
    with pytest.raises(ValueError, match="raise devices_per_trial"):
        policy.decide(pool.snapshot(), [TrialRequest(5, 3, GIB, arrival=0)])


def test_fifo_head_blocks_fixed_but_scamp_backfills_without_delaying_it() -> None:
    # Device 0 is half full, device 1 holds an 8 GiB trial. The head needs 2 x 6 GiB.
    pool = DevicePool([10 * GIB] * 3)
    pool.allocate(Placement(100, (0,)), TrialRequest(100, 1, 5 * GIB, arrival=0))
    pool.allocate(Placement(101, (1,)), TrialRequest(101, 1, 8 * GIB, arrival=0))
    queue = [
        TrialRequest(1, 2, 6 * GIB, arrival=1),
        TrialRequest(2, 1, 5 * GIB, arrival=2),  # fits on device 0 or 2 but delays the head
        TrialRequest(3, 1, 2 * GIB, arrival=3),  # fits where the head's memory stays free
    ]
    snapshot = pool.snapshot()
    # Reserved for the head: device 2 (free) and device 0 (1 GiB short). Trial 3 may use device 2
    # since 6 GiB stay free there, or device 1 (packing).
    assert ScampPolicy().decide(snapshot, queue) == (Placement(3, (2,)),)
    assert ScampPolicy(spread=False).decide(snapshot, queue) == (Placement(3, (1,)),)
    greedy = ScampPolicy(reserve_for_head=False).decide(snapshot, queue)
    assert 2 in {p.key for p in greedy}


def _run_stream(policy: ScampPolicy, decisions: int) -> int | None:
    """Endless stream of 1-device trials (40% of a device, lasting 1-3 rounds, arriving faster
    than they finish) with one 4-device trial queued behind the first ones. Returns the round
    the big trial started in, or None if it never did."""
    pool = DevicePool([10 * GIB] * 4)
    queue: list[TrialRequest] = []
    ends: dict[int, int] = {}
    next_key = 0
    for round_ in range(decisions):
        for key in [k for k, end in ends.items() if end == round_]:
            pool.release(key)
            del ends[key]
        for _ in range(5):
            queue.append(TrialRequest(next_key, 1, 4 * GIB, arrival=next_key))
            next_key += 1
            if next_key == 5:
                queue.append(TrialRequest(-1, 4, 8 * GIB, arrival=next_key))
        for p in _start(pool, policy, queue):
            if p.key == -1:
                return round_
            ends[p.key] = round_ + 1 + p.key % 3  # staggered ends keep the devices busy
    return None


@pytest.mark.parametrize("spread", [True, False])
def test_large_trial_is_not_starved_by_a_stream_of_small_ones(spread: bool) -> None:
    started = _run_stream(ScampPolicy(spread=spread), decisions=200)
    assert started is not None and started <= 5
    # Without the reservation the stream keeps every device partly full forever.
    assert _run_stream(ScampPolicy(reserve_for_head=False), decisions=200) is None


@st.composite
def _events(draw):
    n_devices = draw(st.integers(1, 6))
    capacity = draw(st.lists(st.integers(1, 16), min_size=n_devices, max_size=n_devices))
    ops = draw(
        st.lists(
            st.tuples(
                st.integers(1, 3),  # devices
                st.integers(0, 16),  # bytes per device
                st.booleans(),  # exclusive
                st.integers(0, 3),  # trials to finish before deciding
            ),
            min_size=1,
            max_size=25,
        )
    )
    return capacity, ops


def _decide_and_check(policy, pool, queue, allowed, pending=True):
    """One decision on ``queue``: every placement has distinct devices, a device count in
    ``allowed(request)``, allocates without over-commit, and an idle pool is never left with a
    waiting trial (work-conserving). Returns the trials still waiting."""
    by_key = {r.key: r for r in queue}
    placements = policy.decide(pool.snapshot(), queue, arrivals_pending=pending)
    for p in placements:
        assert len(set(p.device_ids)) == len(p.device_ids)
        assert len(p.device_ids) in allowed(by_key[p.key])
        pool.allocate(p, by_key[p.key])  # raises on any over-commit
    started = {p.key for p in placements}
    queue = [r for r in queue if r.key not in started]
    snap = pool.snapshot()
    assert all(u <= c for u, c in zip(snap.used, snap.capacity, strict=True))
    # the books are the running trials' bytes, device by device (a release frees its own)
    booked = [0] * len(snap.capacity)
    for key, placement in pool.running.items():
        for d in placement.device_ids:
            booked[d] += pool.request_of(key).bytes_per_device
    assert list(snap.used) == booked
    if not pool.running and queue:
        pytest.fail(f"idle pool left {queue[0]} waiting")
    return queue


@settings(max_examples=60, deadline=None)
@given(_events(), st.booleans(), st.booleans())
def test_random_streams_never_over_commit(events, share, use_fixed) -> None:
    capacity, ops = events
    pool = DevicePool(capacity)
    policy = (
        FixedPolicy(len(capacity)) if use_fixed
        else ScampPolicy(share_devices=share, spread=bool(len(ops) % 2))
    )
    queue: list[TrialRequest] = []
    for key, (devices, nbytes, exclusive, finishes) in enumerate(ops):
        for running_key in sorted(pool.running)[:finishes]:
            pool.release(running_key)
        request = TrialRequest(key, devices, nbytes, arrival=key, exclusive=exclusive)
        try:
            check_feasible(request, capacity)
            given = policy.request_devices(devices)
            check_feasible(TrialRequest(key, given, nbytes, arrival=key), capacity)
        except ValueError:
            continue  # the engine rejects it up front
        queue.append(request)
        queue = _decide_and_check(policy, pool, queue,
                                  lambda r: {policy.request_devices(r.devices)})


def test_snapshot_validation() -> None:
    with pytest.raises(ValueError, match="disagree on the device count"):
        PoolSnapshot(capacity=(1, 2), used=(0,), exclusive=(False, False))


# ------------------------------------------------------------- longest first, elastic degrees


def _elastic(key: int, seconds: float, arrival: int | None = None, *, busy: float = 0.0,
             options: tuple[DeviceOption, ...] = ()) -> TrialRequest:
    return TrialRequest(key, 1, 4 * GIB, arrival=key if arrival is None else arrival,
                        seconds=seconds, busy_fraction=busy, options=options)


def test_longest_predicted_trial_starts_first_but_fixed_stays_fifo() -> None:
    queue = [_elastic(0, 10.0), _elastic(1, 30.0), _elastic(2, 20.0)]
    whole = DevicePool([4 * GIB] * 2).snapshot()  # one trial per device
    assert [p.key for p in ScampPolicy(overtake_window=3).decide(whole, queue)] == [1, 2]
    # By default only arrivals within one pool's worth of devices may overtake (here 2).
    assert [p.key for p in ScampPolicy().decide(whole, queue)] == [1, 0]
    assert [p.key for p in ScampPolicy(longest_first=False).decide(whole, queue)] == [0, 1]
    assert [p.key for p in FixedPolicy(1).decide(whole, queue)] == [0, 1]


def test_longest_first_cannot_starve_an_old_short_trial() -> None:
    """One device; a short trial waits while longer ones keep arriving. Only the trials that
    arrived within ``overtake_window`` of it may start before it."""

    def rounds_until_short_starts(policy: ScampPolicy) -> int | None:
        pool = DevicePool([4 * GIB])
        queue = [_elastic(0, 1.0), _elastic(1, 50.0)]
        for round_ in range(30):
            queue.append(_elastic(round_ + 2, 50.0 + round_))
            (placement,) = _start(pool, policy, queue)
            if placement.key == 0:
                return round_
            pool.release(placement.key)
        return None

    assert rounds_until_short_starts(ScampPolicy(overtake_window=3)) == 2
    assert rounds_until_short_starts(ScampPolicy(overtake_window=1)) == 0
    assert rounds_until_short_starts(ScampPolicy(overtake_window=1000)) is None


def test_last_wave_grows_the_longest_trials_onto_idle_devices() -> None:
    pool = DevicePool([10 * GIB] * 8)
    uncosted = (DeviceOption(2, 3 * GIB, None), DeviceOption(4, 2 * GIB, None))
    queue = [_elastic(0, 100.0, options=uncosted), _elastic(1, 40.0, options=uncosted)]
    snapshot = pool.snapshot()
    # Trials still to come: everyone keeps its plan.
    assert [len(p.device_ids) for p in ScampPolicy().decide(snapshot, queue)] == [1, 1]
    # Last wave, 6 idle devices to spare, one step at a time to the longest at a linear
    # speed-up: trial 0 to 2 (50 s), trial 0 to 4 (25 s), trial 1 to 2 (20 s), trial 1 to 4.
    placements = ScampPolicy().decide(snapshot, queue, arrivals_pending=False)
    assert [(p.key, len(p.device_ids)) for p in placements] == [(0, 4), (1, 4)]
    # With 2 devices fewer to spare, trial 1 stops at 2.
    short = (*queue, TrialRequest(5, 2, GIB, arrival=5))
    assert [(p.key, len(p.device_ids))
            for p in ScampPolicy().decide(snapshot, short, arrivals_pending=False)] == \
        [(0, 4), (1, 2), (5, 2)]
    assert ScampPolicy(elastic=False).decide(snapshot, queue, arrivals_pending=False) == \
        ScampPolicy().decide(snapshot, queue)
    # The pool books the option that was chosen, with its bytes.
    for p in placements:
        pool.allocate(p, queue[p.key])
    assert pool.request_of(0).devices == 4 and pool.request_of(0).bytes_per_device == 2 * GIB
    assert pool.snapshot().used == (2 * GIB,) * 8


def test_last_wave_growth_falls_back_when_devices_are_busy() -> None:
    pool = DevicePool([10 * GIB] * 3)
    pool.allocate(Placement(9, (0,)), TrialRequest(9, 1, 9 * GIB, arrival=0))
    queue = [_elastic(0, 100.0, options=(DeviceOption(4, GIB, None),)),
             _elastic(1, 100.0, options=(DeviceOption(2, GIB, None),))]
    # 2 idle devices for 2 trials: no surplus, both start on their own plan's device.
    placements = ScampPolicy().decide(pool.snapshot(), queue, arrivals_pending=False)
    assert sorted(len(p.device_ids) for p in placements) == [1, 1]


def test_costed_option_is_preferred_only_within_the_growth_tolerance() -> None:
    snapshot = DevicePool([10 * GIB] * 4).snapshot()
    cheap = _elastic(0, 100.0, options=(DeviceOption(2, 3 * GIB, 51.0),))  # +2% device-seconds
    dear = _elastic(1, 100.0, options=(DeviceOption(2, 3 * GIB, 60.0),))  # +20%
    placements = ScampPolicy().decide(snapshot, [cheap, dear])
    assert [(p.key, len(p.device_ids)) for p in placements] == [(0, 2), (1, 1)]
    strict = ScampPolicy(growth_tolerance=0.0).decide(snapshot, [cheap, dear])
    assert [len(p.device_ids) for p in strict] == [1, 1]
    with pytest.raises(ValueError, match="growth_tolerance"):
        ScampPolicy(growth_tolerance=-0.1)


def test_compute_aware_sharing_in_the_last_wave() -> None:
    pool = DevicePool([10 * GIB])
    pool.allocate(Placement(9, (0,)), _elastic(9, 100.0, busy=0.8))
    heavy, light = _elastic(0, 50.0, busy=0.5), _elastic(1, 50.0, busy=0.2)
    snapshot = pool.snapshot()
    assert snapshot.busy == (0.8,)
    # While trials keep arriving, memory decides (throughput); in the last wave only a trial
    # that fits the device's spare compute joins.
    assert [p.key for p in ScampPolicy().decide(snapshot, [heavy])] == [0]
    assert ScampPolicy().decide(snapshot, [heavy], arrivals_pending=False) == ()
    assert [p.key for p in ScampPolicy().decide(snapshot, [light],
                                                arrivals_pending=False)] == [1]
    # Behind a waiting head, the device's compute is reserved for the head as its memory is.
    assert ScampPolicy().decide(snapshot, [heavy, light], arrivals_pending=False) == ()
    lenient = ScampPolicy(compute_aware=False)
    assert [p.key for p in lenient.decide(snapshot, [heavy], arrivals_pending=False)] == [0]
    pool.release(9)
    assert pool.snapshot().busy == (0.0,)


def test_request_options_validation() -> None:
    with pytest.raises(ValueError, match="must be distinct and larger"):
        TrialRequest(0, 2, GIB, 0, options=(DeviceOption(2, GIB, 1.0),))
    with pytest.raises(ValueError, match="busy_fraction=1.5"):
        TrialRequest(0, 1, GIB, 0, busy_fraction=1.5)
    with pytest.raises(ValueError, match="needs devices >= 1"):
        DeviceOption(0, GIB, 1.0)
    request = TrialRequest(0, 1, 4 * GIB, 0, seconds=8.0,
                           options=(DeviceOption(4, GIB, 2.5), DeviceOption(2, 2 * GIB, 4.5)))
    assert [o.devices for o in request.choices()] == [1, 2, 4]
    assert request.placed_as(2) == TrialRequest(0, 2, 2 * GIB, 0, seconds=4.5)
    assert request.placed_as(3) is request


@settings(max_examples=60, deadline=None)
@given(_events(), st.booleans(), st.lists(st.floats(0, 1), min_size=25, max_size=25))
def test_random_elastic_streams_never_over_commit(events, pending, draws) -> None:
    capacity, ops = events
    pool = DevicePool(capacity)
    policy = ScampPolicy(overtake_window=3, growth_tolerance=0.2)
    queue: list[TrialRequest] = []
    for key, (devices, nbytes, exclusive, finishes) in enumerate(ops):
        for running_key in sorted(pool.running)[:finishes]:
            pool.release(running_key)
        u = draws[key]
        options = tuple(DeviceOption(devices * k, max(0, nbytes - k), 10 * u / k * (1 + u))
                        for k in (2, 4) if u > 0.3)
        request = TrialRequest(key, devices, nbytes, arrival=key, exclusive=exclusive,
                               seconds=10 * u, busy_fraction=u, options=options)
        try:
            check_feasible(request, capacity)
        except ValueError:
            continue
        queue.append(request)
        queue = _decide_and_check(policy, pool, queue,
                                  lambda r: {o.devices for o in r.choices()}, pending)


@st.composite
def _decision_rounds(draw: st.DrawFn):
    """A pool (uniform or mixed capacities, small or past the indexed reservation's cut-off),
    a policy's settings and a few rounds of arrivals and finishes."""
    n = draw(st.sampled_from([3, 6, 70]))
    uniform = draw(st.booleans())
    capacity = [100] * n if uniform else [draw(st.sampled_from([60, 100])) for _ in range(n)]
    settings_ = dict(
        share_devices=draw(st.booleans()), reserve_for_head=draw(st.booleans()),
        spread=draw(st.booleans()), longest_first=draw(st.booleans()),
        overtake_window=draw(st.sampled_from([None, 1, 3])),
        compute_aware=draw(st.booleans()))
    rounds = []
    for _ in range(draw(st.integers(1, 4))):
        arrivals = draw(st.lists(st.tuples(
            st.integers(1, 3),                    # devices
            st.integers(1, 60),                   # bytes per device
            st.integers(0, 30),                   # arrival (a re-planned trial keeps an old one)
            st.one_of(st.none(), st.integers(0, 5).map(float)),  # seconds
            st.booleans(),                        # exclusive
            st.sampled_from([0.0, 0.3, 0.7]),     # busy fraction
            st.booleans()), max_size=12))         # with a larger option
        rounds.append((arrivals, draw(st.booleans()), draw(st.integers(0, 3))))
    return capacity, settings_, rounds


@settings(max_examples=150, deadline=None)
@given(_decision_rounds())
def test_indexed_decisions_equal_the_brute_force_rule(case) -> None:
    """The indexed decision (`RequestQueue`, pool-kept levels, narrowed reservation, degrees
    and growth built only where they can matter) starts the same trials on the same devices as
    the rule stated by brute force (`_placement_oracle`: every device looked at, eligible ones
    sorted by the rule's key), round after round of arrivals, starts and finishes, for both
    policies and every setting, with options costed and not."""
    import _placement_oracle as oracle

    from scamp_jax.scheduling.placement import DeviceOption
    from scamp_jax.scheduling.request_queue import RequestQueue

    capacity, kwargs, rounds = case
    for policy in (ScampPolicy(**kwargs), FixedPolicy(3)):
        pool = DevicePool(capacity)
        queue = RequestQueue()
        key = 0
        for arrivals, pending, finishes in rounds:
            for devices, nbytes, arrival, seconds, exclusive, busy, grow in arrivals:
                # A larger option, uncosted (as the last wave offers it before its plan) or,
                # for every third trial of known cost, costed at half the time (step 1 takes it).
                costed = None if seconds is None or key % 3 else seconds * 0.5
                options = ((DeviceOption(devices + 1, max(1, nbytes - 5), costed, busy / 2),)
                           if grow else ())
                if isinstance(policy, FixedPolicy) or devices + grow > len(capacity):
                    options = ()
                queue.add(TrialRequest(key, devices, min(nbytes, min(capacity)), arrival,
                                       exclusive=exclusive, seconds=seconds, options=options,
                                       busy_fraction=busy))
                key += 1
            snapshot = pool.snapshot()
            if isinstance(policy, FixedPolicy):
                expected = oracle.fixed_decide(policy, snapshot, list(queue))
            else:
                expected = oracle.scamp_decide(policy, snapshot, list(queue), pending)
            for offered in (queue, list(queue)):
                decided = policy.decide(snapshot, offered, arrivals_pending=pending)
                assert [(p.key, p.device_ids) for p in decided] == [
                    (p.key, p.device_ids) for p in expected]
            for placement in decided:
                pool.allocate(placement, queue.remove(placement.key))
            for done in sorted(pool.running)[:finishes]:
                pool.release(done)


def test_release_frees_the_bytes_of_a_trial_that_shared_its_device():
    from scamp_jax.scheduling.placement import Placement, TrialRequest

    pool = DevicePool([10 * GIB] * 2)
    pool.allocate(Placement(1, (0,)), TrialRequest(1, 1, 6 * GIB, arrival=0))
    pool.allocate(Placement(2, (0,)), TrialRequest(2, 1, 3 * GIB, arrival=1))
    pool.release(1)
    snap = pool.snapshot()
    assert snap.used == (3 * GIB, 0)
    assert dict(snap.levels)[1] == ((7 * GIB, 0),)
    pool.allocate(Placement(3, (0,)), TrialRequest(3, 1, 7 * GIB, arrival=2))  # exactly fits
    assert pool.snapshot().used == (10 * GIB, 0)


def test_fixed_policy_head_blocks_on_a_pool_of_mixed_capacities():
    from scamp_jax.scheduling.placement import FixedPolicy, Placement, TrialRequest

    pool = DevicePool([60, 100])
    pool.allocate(Placement(100, (1,)), TrialRequest(100, 1, 10, arrival=-1, exclusive=True))
    queue = [TrialRequest(0, 1, 80, arrival=0), TrialRequest(1, 1, 50, arrival=1)]
    # The head needs the 100-byte device (busy); the 50-byte trial would fit device 0 but
    # must not overtake it (strict FIFO).
    assert FixedPolicy(1).decide(pool.snapshot(), queue) == ()


def test_a_device_of_exactly_the_trials_bytes_holds_it_on_a_pool_of_mixed_capacities():
    from scamp_jax.scheduling.placement import TrialRequest, check_feasible

    check_feasible(TrialRequest(0, 1, 100, arrival=0), [60, 100])  # fits device 1 exactly
    with pytest.raises(ValueError, match="only 1 device"):
        check_feasible(TrialRequest(0, 2, 100, arrival=0), [60, 100])


def test_only_the_head_gets_a_reservation_not_a_longer_trial_that_fails_before_it():
    from scamp_jax.scheduling.placement import Placement, TrialRequest

    # Both devices have 40 bytes free. The longer trial 1 (90 bytes) comes first in the order
    # but is not the head: it gets no reservation, so the head (30 bytes) takes the best fit,
    # device 0, as it would on its own.
    pool = DevicePool([100, 100])
    for key, device in ((10, 0), (11, 1)):
        pool.allocate(Placement(key, (device,)), TrialRequest(key, 1, 60, arrival=-1))
    queue = [TrialRequest(0, 1, 30, arrival=0, seconds=1.0),
             TrialRequest(1, 1, 90, arrival=1, seconds=10.0)]
    for pending in (False, True):  # compute-aware, and memory alone (the indexed walk)
        assert ScampPolicy().decide(pool.snapshot(), queue, arrivals_pending=pending) == (
            Placement(0, (0,)),)


def test_no_trial_backfills_onto_the_devices_reserved_for_an_exclusive_head():
    from scamp_jax.scheduling.placement import Placement, TrialRequest

    # The exclusive head (20 bytes) needs an empty device: device 0 is reserved for it (its
    # trial's 60 bytes drain first, ties to the lower id). Trial 1 (10 bytes) would fit
    # there best, but joining it would delay the head: it backfills onto device 1.
    pool = DevicePool([100, 100])
    for key, device in ((10, 0), (11, 1)):
        pool.allocate(Placement(key, (device,)), TrialRequest(key, 1, 60, arrival=-1))
    queue = [TrialRequest(0, 1, 20, arrival=0, exclusive=True),
             TrialRequest(1, 1, 10, arrival=1)]
    for pending in (False, True):  # compute-aware, and memory alone (the indexed walk)
        assert ScampPolicy().decide(pool.snapshot(), queue, arrivals_pending=pending) == (
            Placement(1, (1,)),)
