"""Tail elasticity: which running trials restart on idle devices, and on how many."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scamp_jax.scheduling.elastic import (
    Resize,
    RunningTrial,
    TailTrial,
    place_steps,
    resizes,
    tail_plan,
)
from scamp_jax.scheduling.placement import (
    DeviceOption,
    FixedPolicy,
    Placement,
    ScampPolicy,
    TrialRequest,
)
from scamp_jax.scheduling.pool import DevicePool

GIB = 2**30


def _pool(n: int, running: dict[int, tuple[tuple[int, ...], int]]) -> DevicePool:
    pool = DevicePool((8 * GIB,) * n)
    for key, (ids, nbytes) in running.items():
        pool.allocate(Placement(key, ids), TrialRequest(key, len(ids), nbytes, key))
    return pool


def _tail(policy: object, pool: DevicePool, running: list[RunningTrial]) -> tuple[Resize, ...]:
    return resizes(policy, pool.snapshot(), running, queue_empty=True, arrivals_pending=False)


def test_idle_devices_go_to_the_trial_that_would_end_last_one_step_at_a_time() -> None:
    # 8 devices, trials on 0-1 (100 s left) and 2 (60 s left); 5 devices idle.
    pool = _pool(8, {0: ((0, 1), 4 * GIB), 1: ((2,), 4 * GIB)})
    long = RunningTrial(0, (0, 1), 4 * GIB, 100.0, (
        DeviceOption(4, 2 * GIB, 55.0), DeviceOption(8, GIB, 35.0)))
    short = RunningTrial(1, (2,), 4 * GIB, 60.0, (
        DeviceOption(2, 2 * GIB, 35.0), DeviceOption(3, 2 * GIB, 25.0)))
    out = _tail(ScampPolicy(), pool, [long, short])
    # Step 1: trial 0 (100 s) -> 4 devices (55 s), 3 idle left. Step 2: trial 1 (60 s) -> 2
    # devices (35 s), 2 left. Step 3: trial 0 (55 s) cannot take 4 more; trial 1 (35 s) -> 3.
    assert out == (
        Resize(0, (0, 1, 3, 4), DeviceOption(4, 2 * GIB, 55.0)),
        Resize(1, (2, 5, 6), DeviceOption(3, 2 * GIB, 25.0)),
    )
    for r in out:  # applying them in order fits the pool
        pool.release(r.key)
        pool.allocate(Placement(r.key, r.device_ids),
                      TrialRequest(r.key, len(r.device_ids), r.option.bytes_per_device, 0))


def test_only_in_the_tail_and_only_for_an_elastic_scamp_policy() -> None:
    pool = _pool(4, {0: ((0,), GIB)})
    trial = RunningTrial(0, (0,), GIB, 100.0, (DeviceOption(4, GIB, 30.0),))
    snapshot = pool.snapshot()
    assert resizes(ScampPolicy(), snapshot, [trial], queue_empty=False,
                   arrivals_pending=False) == ()
    assert resizes(ScampPolicy(), snapshot, [trial], queue_empty=True,
                   arrivals_pending=True) == ()
    for policy in (FixedPolicy(1), ScampPolicy(elastic=False), ScampPolicy(resize_running=False)):
        assert _tail(policy, pool, [trial]) == ()
    assert [r.device_ids for r in _tail(ScampPolicy(), pool, [trial])] == [(0, 1, 2, 3)]


def test_a_restart_must_save_enough_of_the_remaining_time() -> None:
    pool = _pool(2, {0: ((0,), GIB)})

    def trial(seconds: float) -> RunningTrial:
        return RunningTrial(0, (0,), GIB, 100.0, (DeviceOption(2, GIB, seconds),))

    assert _tail(ScampPolicy(), pool, [trial(95.0)]) == ()  # saves 5% < 10%
    assert len(_tail(ScampPolicy(), pool, [trial(85.0)])) == 1
    assert _tail(ScampPolicy(min_resize_gain=0.2), pool, [trial(85.0)]) == ()
    assert _tail(ScampPolicy(), pool, [trial(120.0)]) == ()  # slower: the restart costs more


def test_the_new_plan_must_fit_its_own_devices_and_the_idle_ones() -> None:
    # Trial 1 shares device 0 with trial 0 and leaves 1 GiB free there.
    pool = _pool(3, {0: ((0,), 3 * GIB), 1: ((0,), 4 * GIB)})
    bigger = RunningTrial(0, (0,), 3 * GIB, 100.0, (DeviceOption(2, 5 * GIB, 50.0),))
    assert _tail(ScampPolicy(), pool, [bigger]) == ()  # 3 + 1 GiB free < 5 GiB
    fits = RunningTrial(0, (0,), 3 * GIB, 100.0, (DeviceOption(2, 4 * GIB, 50.0),))
    assert _tail(ScampPolicy(), pool, [fits]) == (
        Resize(0, (0, 1), DeviceOption(2, 4 * GIB, 50.0)),)
    huge = RunningTrial(0, (0,), 3 * GIB, 100.0, (DeviceOption(2, 9 * GIB, 50.0),))
    assert _tail(ScampPolicy(), pool, [huge]) == ()  # no idle device holds 9 GiB


def test_running_trial_validation() -> None:
    with pytest.raises(ValueError, match="must each have more than its 2 current devices"):
        RunningTrial(0, (0, 1), GIB, 10.0, (DeviceOption(2, GIB, 5.0),))
    with pytest.raises(ValueError, match="distinct and non-empty"):
        RunningTrial(0, (0, 0), GIB, 10.0)
    with pytest.raises(ValueError, match="must be >= 0"):
        RunningTrial(0, (0,), GIB, -1.0)
    with pytest.raises(ValueError, match="min_resize_gain=1.0 must be in"):
        ScampPolicy(min_resize_gain=1.0)


def test_moves_that_would_be_dropped_do_not_take_the_idle_devices() -> None:
    pool = _pool(3, {0: ((0,), GIB), 1: ((1,), GIB)})
    worthless = RunningTrial(0, (0,), GIB, 100.0, (DeviceOption(2, GIB, 99.0),))  # saves 1%
    useful = RunningTrial(1, (1,), GIB, 90.0, (DeviceOption(2, GIB, 50.0),))
    assert _tail(ScampPolicy(), pool, [worthless, useful]) == (
        Resize(1, (1, 2), DeviceOption(2, GIB, 50.0)),)
    too_big = RunningTrial(0, (0,), GIB, 100.0, (DeviceOption(2, 9 * GIB, 40.0),))
    assert _tail(ScampPolicy(), pool, [too_big, useful]) == (
        Resize(1, (1, 2), DeviceOption(2, GIB, 50.0)),)


def test_a_step_that_does_not_fit_leaves_the_one_before_it() -> None:
    # 1 -> 2 devices fits; 2 -> 4 would need 9 GiB per device, more than any holds.
    pool = _pool(4, {0: ((0,), GIB)})
    trial = RunningTrial(0, (0,), GIB, 100.0, (DeviceOption(2, GIB, 55.0),
                                                 DeviceOption(4, 9 * GIB, 30.0)))
    assert _tail(ScampPolicy(), pool, [trial]) == (
        Resize(0, (0, 1), DeviceOption(2, GIB, 55.0)),)


def test_a_trial_waits_for_devices_about_to_free_when_that_ends_it_sooner() -> None:
    # 16 devices: trial 0 on device 0 (500 s left; a restart costs 60 s), trials 1-6 on two
    # devices each ending in 80 s, 3 devices idle.
    def options(rest: float) -> tuple[DeviceOption, ...]:
        return tuple(DeviceOption(n, GIB, rest / n + 60.0) for n in range(2, 9))

    soon = [RunningTrial(k, (2 * k - 1, 2 * k), GIB, 80.0) for k in range(1, 7)]
    pool = _pool(16, {0: ((0,), GIB), **{r.key: (r.device_ids, GIB) for r in soon}})
    long = RunningTrial(0, (0,), GIB, 500.0, options(500.0), restart_seconds=60.0)
    # Now: 4 devices, ending in 185 s. Waiting 80 s for 12 more: at best 8 devices, ending in
    # 80 + 420 / 8 + 60 = 192.5 s, later: it restarts now.
    now = _tail(ScampPolicy(), pool, [long, *soon])
    assert [(r.key, r.option.devices) for r in now] == [(0, 4)]
    # With 1 device idle it could restart on 2 now (310 s); waiting 80 s for 8 ends it in 80 +
    # 420 / 8 + 60 = 192.5 s: it waits.
    pool = _pool(16, {0: ((0,), GIB), 7: ((13, 14), GIB),
                      **{r.key: (r.device_ids, GIB) for r in soon}})
    busy = [*soon, RunningTrial(7, (13, 14), GIB, 900.0)]
    assert _tail(ScampPolicy(), pool, [long, *busy]) == ()
    # Without trials about to end it restarts on 2.
    pool = _pool(3, {0: ((0,), GIB), 7: ((2,), GIB)})
    alone = [long, RunningTrial(7, (2,), GIB, 900.0)]
    assert [(r.key, r.option.devices) for r in _tail(ScampPolicy(), pool, alone)] == [(0, 2)]


def _resizes_by_brute_force(policy: ScampPolicy, pool: DevicePool,
                            running: list[RunningTrial]) -> tuple[Resize, ...]:
    """`resizes` as stated: while a trial can move, the one with the longest time (as resized
    so far; ties to the earlier) takes its next worthwhile option that finishes sooner within
    the surplus; then, longest remaining first, each restarts as the last of its steps that its
    devices and the idle ones left still hold."""
    snap = pool.snapshot()
    idle = [d for d in range(len(snap.capacity)) if snap.is_empty(d)]
    free = snap.free

    def worth(r: RunningTrial, o: DeviceOption) -> bool:
        return (o.seconds <= (1 - policy.min_resize_gain) * r.remaining_seconds
                and all(free[d] + r.bytes_per_device >= o.bytes_per_device for d in r.device_ids)
                and sum(snap.capacity[d] >= o.bytes_per_device for d in idle)
                >= o.devices - len(r.device_ids))

    def greedy(waiting: set[int]) -> tuple[dict[int, list[DeviceOption]], int]:
        at = {r.key: (len(r.device_ids), r.remaining_seconds) for r in running}
        steps: dict[int, list[DeviceOption]] = {}
        surplus = len(idle)
        while True:
            moves = []
            for n, r in enumerate(running):
                if r.key in waiting:
                    continue
                devices, seconds = at[r.key]
                ahead = sorted((o for o in r.options if worth(r, o) and o.devices > devices
                                and o.devices - devices <= surplus), key=lambda o: o.devices)
                sooner = [o for o in ahead if o.seconds < seconds]
                if sooner:
                    moves.append((-seconds, n, r.key, sooner[0]))
            if not moves:
                return steps, surplus
            _, _, key, o = min(moves)
            surplus -= o.devices - at[key][0]
            at[key] = (o.devices, o.seconds)
            steps.setdefault(key, []).append(o)

    # Rule 4: devices of the trials staying put come free at the latest end among the trials
    # on each, if nothing else is on them, shared among the trials moving; a trial waits when a
    # larger option then ends sooner, and the others move again without it.
    waiting: set[int] = set()
    while True:
        steps, surplus = greedy(waiting)
        staying = [r for r in running if r.key not in steps]
        freeing = []
        for d in range(len(snap.capacity)):
            on = [r for r in running if d in r.device_ids]
            if (on and all(r in staying for r in on)
                    and sum(r.bytes_per_device for r in on) == snap.capacity[d] - free[d]):
                freeing.append(max(r.remaining_seconds for r in on))
        freeing.sort()

        def waits(r: RunningTrial, o: DeviceOption, freeing: list[float], surplus: int,
                  sharing: int) -> bool:
            rest, restart = r.remaining_seconds, r.restart_seconds
            for count, w in enumerate(freeing, start=1):
                reach = o.devices + surplus + count // sharing
                if w < rest and any(
                        o.devices < p.devices <= reach
                        and w + (p.seconds - restart) * (rest - w) / rest + restart < o.seconds
                        for p in r.options):
                    return True
            return False

        wait = {r.key for r in running if r.key in steps
                and waits(r, steps[r.key][-1], freeing, surplus, len(steps))}
        if not wait:
            break
        waiting |= wait

    # Assigning devices to the chosen steps is `place_steps`, shared with `resizes` (its unit
    # tests above check it); this oracle checks which steps the rules choose.
    idle.sort(key=lambda d: (snap.capacity[d], d))
    order = sorted((r for r in running if r.key in steps),
                   key=lambda r: (-r.remaining_seconds, r.key))
    return place_steps(snap.capacity, idle, free, [(r, steps[r.key]) for r in order])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2), st.integers(1, 6), st.integers(1, 40),
                          st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6),
                                             st.integers(1, 40)), max_size=4)),
                min_size=1, max_size=5),
       st.sampled_from([0.0, 0.1, 0.3]))
def test_resizes_follow_the_rule_longest_first_and_ask_options_lazily(trials, gain) -> None:
    """The heap-driven greedy (options asked for only when a trial's turn comes) decides what
    the rule stated over every trial at once decides."""
    policy = ScampPolicy(min_resize_gain=gain)
    pool = DevicePool((8 * GIB,) * 12)
    running, device = [], 0
    for key, (size, gib, left, options) in enumerate(trials):
        ids = tuple(range(device, device + size))
        device += size
        pool.allocate(Placement(key, ids), TrialRequest(key, size, gib * GIB, key))
        running.append(RunningTrial(key, ids, gib * GIB, float(left), tuple(
            {size + extra: DeviceOption(size + extra, g * GIB, float(s))
             for extra, g, s in options}.values())))
    expected = _resizes_by_brute_force(policy, pool, running)
    asked: list[int] = []

    def options_of(view: RunningTrial) -> tuple[DeviceOption, ...]:
        asked.append(view.key)
        return running[view.key].options

    bare = [RunningTrial(r.key, r.device_ids, r.bytes_per_device, r.remaining_seconds,
                         restart_seconds=r.restart_seconds) for r in running]
    eager = _tail(policy, pool, running)
    lazy = resizes(policy, pool.snapshot(), bare, queue_empty=True, arrivals_pending=False,
                   options_of=options_of)
    assert eager == lazy == expected
    assert len(asked) == len(set(asked))  # each trial's options asked for once at most


def test_the_tail_plan_weighs_queued_degrees_and_restarts_together_by_hand() -> None:
    # Two idle devices; a queued trial of 10 s on 1 device or 6 s on 2; a running trial with
    # 20 s left, fully busy, that may restart (1 s) on 2 or 3 devices. Queued on 1 and the
    # running one on 2 at once: it ends at 1 + 20 / 2 = 11 s. Growing the queued trial first
    # (the one-step rules) leaves the running one to restart on 3 devices at 6 s: 6 + 1 + 14 / 3.
    queued = [(7, ((1, 10.0), (2, 6.0)))]
    mover = TailTrial(3, devices=1, remaining=20.0, restart=1.0, busy=1.0, plan_devices=1,
                      counts=(2, 3))
    plan = tail_plan(2, queued, [mover], [])
    assert plan is not None
    assert (plan.degrees, plan.restarts) == ({7: 1}, {3: (0.0, 2)})
    assert plan.makespan == pytest.approx(11.0)
    assert plan.ends == {7: 10.0, 3: pytest.approx(11.0)}
    # A restart must save half its remaining time: 11 s of 20 does not, 6 + 1 + 14 / 3 of 14
    # left at 6 s does.
    plan = tail_plan(2, queued, [mover], [], min_gain=0.5)
    assert (plan.degrees, plan.restarts) == ({7: 2}, {3: (6.0, 3)})
    assert plan.makespan == pytest.approx(7 + 14 / 3)
    # No idle device, no queued trial: the devices another trial frees at 4 s serve it.
    plan = tail_plan(0, [], [mover], [(4.0, 2)])
    assert plan.restarts == {3: (4.0, 3)} and plan.makespan == pytest.approx(5 + 16 / 3)
    # Too many choices to weigh: None, the one-step rules decide.
    many = [(k, ((1, 10.0), (2, 6.0), (4, 4.0))) for k in range(10)]
    assert tail_plan(40, many, [mover], [], max_combinations=10) is None


def test_the_tail_plan_ends_a_long_queued_trial_early_to_restart_the_longest_ones() -> None:
    # The shape of the paper setting's last wave at overlap 0 (seconds from its start): 13 idle
    # devices, seven queued trials of 264.2 s on 1 device (154.8 on 2, 100.2 on 4, 72.8 on 8),
    # a pair of trials 591.2 s from their end (busy 0.91) and a trio 412.3 s (busy 0.85), 2
    # devices freed at 68.4 s, 4 at 216.5 s, 9 at 264.2 s. One queued trial on 4 devices ends
    # at 100.2 s, so that its devices and the 2 kept idle since 68.4 s restart the pair on 4
    # each; the trio restarts on 2 each at once; the study then ends about 316 s from now.
    pair = [TailTrial(k, 1, 591.2, 60.0, 0.91, 1, (2, 4, 5, 8)) for k in (54, 60)]
    trio = [TailTrial(k, 1, 412.3, 60.0, 0.85, 1, (2, 3, 4, 6, 8)) for k in (55, 57, 58)]
    queued = [(k, ((1, 264.2), (2, 154.8), (4, 100.2), (8, 72.8))) for k in range(7)]
    plan = tail_plan(13, queued, pair + trio, [(68.4, 2), (216.5, 4), (264.2, 9)])
    assert plan is not None
    assert sorted(plan.degrees.values()) == [1, 1, 1, 1, 1, 1, 4]
    assert plan.restarts == {54: (100.2, 4), 60: (100.2, 4), 55: (0.0, 2), 57: (0.0, 2),
                             58: (0.0, 2)}
    assert plan.makespan == pytest.approx(max(m.end(*plan.restarts[m.key])
                                              for m in pair + trio))
    assert plan.makespan < 320


def test_trials_sharing_a_device_do_not_both_grow_past_its_memory():
    from scamp_jax.scheduling.elastic import Resize, RunningTrial, place_steps, resizes
    from scamp_jax.scheduling.placement import DeviceOption, Placement, ScampPolicy, TrialRequest

    pool = DevicePool([8 * GIB] * 3)
    for key in (0, 1):
        pool.allocate(Placement(key, (0,)), TrialRequest(key, 1, 3 * GIB, key))
    a = RunningTrial(0, (0,), 3 * GIB, 100.0, (DeviceOption(2, 5 * GIB, 50.0),))
    b = RunningTrial(1, (0,), 3 * GIB, 90.0, (DeviceOption(2, 5 * GIB, 45.0),))
    out = resizes(ScampPolicy(), pool.snapshot(), [a, b], queue_empty=True,
                  arrivals_pending=False)
    assert out == (Resize(0, (0, 1), DeviceOption(2, 5 * GIB, 50.0)),)
    for r in out:  # applying them in order fits the pool
        pool.release(r.key)
        pool.allocate(Placement(r.key, r.device_ids),
                      TrialRequest(r.key, len(r.device_ids), r.option.bytes_per_device, 0))
    # place_steps alone: the second trial's own device no longer holds its new plan.
    steps = [(a, [a.options[0]]), (b, [b.options[0]])]
    assert [r.key for r in place_steps((8 * GIB,) * 3, [1, 2], [2 * GIB, 8 * GIB, 8 * GIB],
                                       steps)] == [0]


def test_an_idle_device_that_holds_exactly_the_new_plan_counts() -> None:
    # The new plan needs all 8 GiB of a device: trial 0's own device holds it once it frees its
    # 1 GiB, and the idle device holds exactly that much.
    pool = _pool(2, {0: ((0,), GIB)})
    trial = RunningTrial(0, (0,), GIB, 100.0, (DeviceOption(2, 8 * GIB, 50.0),))
    assert _tail(ScampPolicy(), pool, [trial]) == (
        Resize(0, (0, 1), DeviceOption(2, 8 * GIB, 50.0)),)


def test_a_device_frees_only_when_the_last_trial_on_it_ends() -> None:
    # As in the waiting test: trial 0 (500 s left, 60 s restart) could restart on 2 devices
    # now (310 s), or wait 80 s for 12 devices and restart on 8 (192.5 s). But devices 1-12
    # also hold another trial: they do not come free when trials 1-6 end, so it restarts now.
    def options(rest: float) -> tuple[DeviceOption, ...]:
        return tuple(DeviceOption(n, GIB, rest / n + 60.0) for n in range(2, 9))

    soon = [RunningTrial(k, (2 * k - 1, 2 * k), GIB, 80.0) for k in range(1, 7)]
    long = RunningTrial(0, (0,), GIB, 500.0, options(500.0), restart_seconds=60.0)
    busy = RunningTrial(7, (13, 14), GIB, 900.0)
    below = {0: ((0,), GIB), 7: ((13, 14), GIB), **{r.key: (r.device_ids, GIB) for r in soon}}
    # Nothing else on devices 1-12: it waits for them (the waiting test's case).
    assert _tail(ScampPolicy(), _pool(16, below), [long, *soon, busy]) == ()
    # A measured trial on devices 1-12 ending after trial 0: they free at its end, too late.
    sharer = RunningTrial(8, tuple(range(1, 13)), GIB, 900.0)
    pool = _pool(16, {**below, 8: (sharer.device_ids, GIB)})
    assert [(r.key, r.option.devices) for r in _tail(ScampPolicy(), pool,
                                                     [long, *soon, busy, sharer])] == [(0, 2)]
    # A trial not measured (not among ``running``) on devices 1-12: they never count as freed.
    assert [(r.key, r.option.devices) for r in _tail(ScampPolicy(), pool,
                                                     [long, *soon, busy])] == [(0, 2)]


def test_the_tail_plan_restarts_a_mover_on_the_devices_another_mover_frees() -> None:
    # No idle device: trial 1 (100 s left) restarts on 2 devices when trial 2 (20 s left, the
    # shorter mover, decided after it) ends and frees its device: 20 + 80 / 2 = 60 s.
    first = TailTrial(1, devices=1, remaining=100.0, restart=0.0, busy=1.0, plan_devices=1,
                      counts=(2,))
    second = TailTrial(2, devices=1, remaining=20.0, restart=0.0, busy=1.0, plan_devices=1,
                       counts=(2,))
    plan = tail_plan(0, [], [first, second], [])
    assert plan is not None
    assert plan.restarts == {1: (20.0, 2)} and plan.makespan == pytest.approx(60.0)


def test_the_tail_movers_are_the_longest_that_fit_the_room() -> None:
    from scamp_jax.scheduling.elastic import longest_movers

    def mover(remaining: float, key: int) -> TailTrial:
        return TailTrial(key, 1, remaining, 0.0, 1.0, 1, (2,))

    measured = [(30.0, 3), (20.0, 1), (20.0, 2), (10.0, 4)]
    assert [m.key for m in longest_movers(measured, mover, 3)] == [3, 1, 2]
    # Trials of equal remaining time go together or not at all.
    assert [m.key for m in longest_movers(measured, mover, 2)] == [3]
    assert [m.key for m in longest_movers(measured, mover, 4)] == [3, 1, 2, 4]


def test_a_trial_that_never_ends_frees_no_device() -> None:
    from scamp_jax.scheduling.elastic import freed_devices

    assert freed_devices([((0, 1), float("inf")), ((2,), 5.0), ((1, 3), 7.0)]) == [
        (5.0, 1), (7.0, 1)]


def test_a_trial_waits_when_the_surplus_it_leaves_and_devices_freed_soon_reach_a_larger_option(
) -> None:
    # Trial 0 on device 0 (500 s left, 60 s restart) may restart on 2 devices (310 s) or 4
    # (185 s); devices 2-3 idle. Now it reaches 2, leaving one idle device that 4 cannot use.
    # Trial 1 frees device 1 in 80 s: with the idle device left that makes 4, restarting at
    # 80 s ends in 80 + 125 * 420 / 500 + 60 = 245 s < 310 s: it waits.
    long = RunningTrial(0, (0,), GIB, 500.0, (DeviceOption(2, GIB, 310.0),
                                               DeviceOption(4, GIB, 185.0)),
                        restart_seconds=60.0)
    soon = RunningTrial(1, (1,), GIB, 80.0)
    pool = _pool(4, {0: ((0,), GIB), 1: ((1,), GIB)})
    assert _tail(ScampPolicy(), pool, [long, soon]) == ()
    # A later end too (trial 2 at 400 s, restarting then would end at 485 s) does not hide the
    # sooner one.
    later = RunningTrial(2, (4,), GIB, 400.0)
    pool = _pool(5, {0: ((0,), GIB), 1: ((1,), GIB), 2: ((4,), GIB)})
    assert _tail(ScampPolicy(), pool, [long, soon, later]) == ()
    # Without trial 1 nothing frees soon enough: it restarts on 2 now.
    pool = _pool(4, {0: ((0,), GIB), 2: ((1,), GIB)})
    assert [(r.key, r.option.devices) for r in _tail(
        ScampPolicy(), pool, [long, RunningTrial(2, (1,), GIB, 400.0)])] == [(0, 2)]


def test_devices_of_a_trial_that_restarts_now_do_not_count_as_freed_soon() -> None:
    # Trial 0 (as in the waiting test above: 2 devices now, 310 s; 4 devices, 185 s) and trial
    # 1 on devices 1-4 (80 s left; 60 s on 5) both restart now on the two idle devices. Trial
    # 1's devices do not come free at 80 s, since it restarts on them: trial 0 does not wait.
    long = RunningTrial(0, (0,), GIB, 500.0, (DeviceOption(2, GIB, 310.0),
                                               DeviceOption(4, GIB, 185.0)),
                        restart_seconds=60.0)
    soon = RunningTrial(1, (1, 2, 3, 4), GIB, 80.0, (DeviceOption(5, GIB, 60.0),))
    pool = _pool(7, {0: ((0,), GIB), 1: ((1, 2, 3, 4), GIB)})
    assert [(r.key, r.device_ids) for r in _tail(ScampPolicy(), pool, [long, soon])] == [
        (0, (0, 5)), (1, (1, 2, 3, 4, 6))]
