"""A fused group's data: the members' streams drawn into one stacked batch, at once or in turn."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from scamp_jax import FunctionTask
from scamp_jax.hpo import member_streams
from scamp_jax.hpo.member_streams import StackedStreams, parallel_streams


def _stream(seed: int, batch: int = 5, threads: set[str] | None = None) -> Iterator[tuple]:
    rng = np.random.default_rng(seed)
    while True:
        if threads is not None:
            threads.add(threading.current_thread().name)
        x = rng.normal(size=(batch, 3)).astype(np.float32)
        yield x, {"label": rng.integers(0, 10, size=batch).astype(np.int32)}


#: draws made in turn before a group's streams may be drawn at once
WARM = 1 + member_streams.TIMED_DRAWS


def _in_turn(streams: list[Iterator[tuple]]) -> tuple:
    batches = [next(s) for s in streams]
    return (np.stack([b[0] for b in batches]),
            {"label": np.stack([b[1]["label"] for b in batches])})


@pytest.mark.parametrize("parallel", [True, False])
def test_each_member_gets_its_own_streams_batches_in_order(parallel: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Stacked draws, at once or in turn, are each member's stream in step order, also after
    the group re-forms without a member."""
    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0)  # these draws are tiny
    threads: set[str] = set()
    stacked = StackedStreams([_stream(s, threads=threads) for s in (3, 1, 4, 1)], parallel)
    reference = [_stream(s) for s in (3, 1, 4, 1)]
    for step in range(WARM + 3):
        if step == WARM + 1:
            stacked.keep([2, 0])
            reference = [reference[2], reference[0]]
        got, want = stacked.draw(), _in_turn(reference)
        assert got[0].shape == (len(reference), 5, 3) and got[1]["label"].dtype == np.int32
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1]["label"], want[1]["label"])
    # at once: after WARM draws (in turn: the first starts the streams, the others are timed)
    assert stacked.at_once == parallel
    assert any(t.startswith("member-data") for t in threads) == parallel


def test_draws_too_quick_to_hand_to_threads_stay_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """At `PARALLEL_MIN_SECONDS` and above a member's draw goes to the data threads; below it
    the hand-off would cost more than the draw."""
    with monkeypatch.context() as patch:
        patch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 60.0)  # no draw here is that slow
        stacked = StackedStreams([_stream(s) for s in range(3)], parallel=True)
        for _ in range(WARM + 1):
            stacked.draw()
        assert not stacked.at_once

    def slow(seed: int) -> Iterator[np.ndarray]:
        for x in _stream(seed):
            time.sleep(member_streams.PARALLEL_MIN_SECONDS)
            yield x

    stacked = StackedStreams([slow(s) for s in range(3)], parallel=True)
    for _ in range(WARM):
        stacked.draw()
    assert stacked.at_once


def test_a_member_whose_batches_change_shape_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0)

    def changing(seed: int) -> Iterator[np.ndarray]:
        yield from (np.zeros((4, 2), np.float32) for _ in range(WARM))
        yield np.zeros((3, 2), np.float32)

    stacked = StackedStreams([changing(0), changing(1)], parallel=True)
    for _ in range(WARM):
        stacked.draw()
    stacked.draw()
    failed = stacked.take_failed()
    assert sorted(failed) == [0, 1]
    with pytest.raises(ValueError, match=r"member 0's stream gave a batch of \[\(\(3, 2\), "):
        raise failed[0]


def test_tasks_say_whether_their_streams_may_be_drawn_at_once() -> None:
    from search_spaces.sr_task import SRTask
    from search_spaces.vit import SyntheticClassificationTask

    assert SRTask.parallel_streams and SyntheticClassificationTask.parallel_streams
    kw = dict(metric="m", direction="minimize", loss_fn=lambda m, b: 0.0,
              batches=lambda b, s: _stream(s, b), evaluate=lambda m: {"m": 0.0})
    assert not parallel_streams(FunctionTask(**kw))  # unless the task says so
    assert parallel_streams(FunctionTask(**kw, parallel_streams=True))
    assert not parallel_streams(object())


@pytest.mark.parametrize("at_once", [True, False], ids=["at once", "in turn"])
def test_a_failing_member_is_out_and_the_others_draw_on(at_once: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of one member's stream is that member's (`take_failed`, once): its slot holds
    zeros from then on and its stream is never drawn again, while every other member's draw
    of that step is kept, so each goes on with its solo run's batches; once the group is
    re-formed without it, the others' slots move up."""
    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0 if at_once else 60.0)
    drawn = [0, 0]

    def stream(slot: int) -> Iterator[np.ndarray]:
        for step in range(WARM + 10):
            if slot == 0 and step == WARM:
                raise RuntimeError("member 0's data is broken")
            if slot == 1 and step == WARM:
                time.sleep(0.2)
            drawn[slot] += 1
            yield np.full((2,), step, np.float32)

    stacked = StackedStreams([stream(0), stream(1)], parallel=True)
    for _ in range(WARM):
        stacked.draw()
    assert stacked.take_failed() == {}
    np.testing.assert_array_equal(stacked.draw(), [[0.0, 0.0], [WARM, WARM]])
    assert drawn == [WARM, WARM + 1]  # member 1's draw had ended when `draw` returned
    failed = stacked.take_failed()
    assert list(failed) == [0] and "member 0's data is broken" in str(failed[0])
    assert stacked.take_failed() == {}  # said once
    np.testing.assert_array_equal(stacked.draw(), [[0.0, 0.0], [WARM + 1, WARM + 1]])
    assert drawn == [WARM, WARM + 2] and stacked.take_failed() == {}
    stacked.keep([1])
    np.testing.assert_array_equal(stacked.draw(), [[WARM + 2.0, WARM + 2.0]])
    assert drawn == [WARM, WARM + 3]


def test_a_failed_members_slot_holds_zeros_in_every_later_draw() -> None:
    """A later draw is made in fresh memory (the arrays of consumed draws are free again):
    the slot of a member whose stream failed is zeros in it, never what that memory held."""
    def stream(slot: int) -> Iterator[np.ndarray]:
        step = 0
        while True:
            step += 1
            if slot == 0 and step == 3:
                raise RuntimeError("member 0's data is broken")
            yield np.full((4, 3), step, np.float32)

    stacked = StackedStreams([stream(0), stream(1)], parallel=False)
    held = [stacked.draw(), stacked.draw()]  # steps 1 and 2: no slot holds zeros
    held.append(stacked.draw())  # member 0 fails at step 3
    assert list(stacked.take_failed()) == [0]
    for step in range(4, 10):
        held.pop(0)  # a step consumed it: its memory is free for the next draw
        later = stacked.draw()
        np.testing.assert_array_equal(later[0], np.zeros((4, 3), np.float32))
        np.testing.assert_array_equal(later[1], np.full((4, 3), step, np.float32))
        held.append(later)


def test_a_member_whose_first_draw_fails_is_out_and_no_batch_at_all_raises() -> None:
    """The first draw sets the group's shapes from the first batch that comes; a member that
    has none is out from the start. Where no member has one, the group cannot start: the
    first member's error is raised, naming the others'."""
    def stream(slot: int, fails: bool) -> Iterator[np.ndarray]:
        if fails:
            raise OSError(f"member {slot}'s files are missing")
        yield from (np.full((2,), 10 * slot + step, np.float32) for step in range(9))

    stacked = StackedStreams([stream(0, True), stream(1, False), stream(2, False)],
                             parallel=False)
    np.testing.assert_array_equal(stacked.draw(), [[0, 0], [10, 10], [20, 20]])
    assert list(stacked.take_failed()) == [0]
    np.testing.assert_array_equal(stacked.draw(), [[0, 0], [11, 11], [21, 21]])

    # a member whose batches are of another shape than the others' is the one out, whatever
    # its slot
    def shaped(rows: int) -> Iterator[np.ndarray]:
        while True:
            yield np.ones((rows, 2), np.float32)

    stacked = StackedStreams([shaped(3), shaped(2), shaped(2)], parallel=False)
    assert stacked.draw().shape == (3, 2, 2)
    assert list(stacked.take_failed()) == [0]

    stacked = StackedStreams([stream(0, True), stream(1, True)], parallel=False)
    with pytest.raises(OSError, match="member 0's files are missing") as caught:
        stacked.draw()
    assert [n.split(":")[0] for n in getattr(caught.value, "__notes__", [])] == [
        "member 1's first draw failed too"]


def test_every_failing_member_is_out_and_an_interruption_waits_for_the_draws(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every member failing in one draw: each is out with its own error. Ctrl-C while the
    members draw comes out once the draws running have ended, and no member's draw starts
    after it (the group's streams rest; a resumed run makes new ones from its checkpoint's
    step)."""
    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0)

    def stream(slot: int) -> Iterator[np.ndarray]:
        for step in range(WARM + 1):
            yield np.full((2,), step, np.float32)
        raise ValueError(f"member {slot} ran dry")

    stacked = StackedStreams([stream(0), stream(1), stream(2)], parallel=True)
    for _ in range(WARM + 1):
        stacked.draw()
    np.testing.assert_array_equal(stacked.draw(), np.zeros((3, 2)))
    failed = stacked.take_failed()
    assert {slot: str(err) for slot, err in failed.items()} == {
        slot: f"member {slot} ran dry" for slot in range(3)}

    # A real Ctrl-C: member 0's data thread sends SIGINT to the process while the members
    # draw; Python raises it in the main thread, which is waiting for them.
    ended: list[int] = []

    def slow(slot: int) -> Iterator[np.ndarray]:
        for step in range(WARM + 5):
            if step == WARM:
                if slot == 0:
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                time.sleep(0.3)
                ended.append(slot)
            yield np.full((2,), step, np.float32)

    stacked = StackedStreams([slow(0), slow(1)], parallel=True)
    for _ in range(WARM):
        stacked.draw()
    with pytest.raises(KeyboardInterrupt):
        stacked.draw()
    when_raised = list(ended)
    time.sleep(0.6)
    # member 0's draw had ended when the interruption came out, and no draw ran after it
    assert 0 in when_raised and ended == when_raised


def test_a_member_whose_batches_change_dtype_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """At once, a batch is copied into the stacked batch of the first draws' dtype: a member
    whose dtype changes is refused, not cast (in turn, ``np.stack`` would promote it)."""
    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0)

    def changing(seed: int) -> Iterator[np.ndarray]:
        yield from (np.zeros(3, np.float32) for _ in range(WARM))
        yield np.full(3, 0.1, np.float64)

    stacked = StackedStreams([changing(0), changing(1)], parallel=True)
    for _ in range(WARM):
        stacked.draw()
    assert stacked.draw().dtype == np.float32
    failed = stacked.take_failed()
    assert sorted(failed) == [0, 1]
    with pytest.raises(ValueError, match="float64.*float32"):
        raise failed[1]


def test_patch_copies_inside_the_data_threads_finish_with_one_thread_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A fused group of SR samplers drawing 256 patches or more (their copies go to a pool of
    their own, `search_spaces.sr_data`) at once on the data threads: with one thread in each
    pool nothing waits on itself, and each member gets its solo stream's patches."""
    from scamp_jax.scheduling import host
    from search_spaces import sr_data

    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0)
    monkeypatch.setattr(host, "host_cores", lambda: 1)
    monkeypatch.setattr(member_streams, "host_cores", lambda: 1)
    monkeypatch.setattr(member_streams, "_POOL", None)
    monkeypatch.setattr(sr_data, "_POOL", None)
    n = sr_data._PATCHES_ON_THREADS
    rng = np.random.default_rng(6)
    images = [rng.uniform(size=(40, 52, 3)).astype(np.float32) for _ in range(2)]

    def patches(seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        sampler = sr_data.PatchSampler(images, scale=2, hr_patch=16, seed=seed)
        while True:
            yield sampler.batch(n)

    before = {t.ident for t in threading.enumerate()}
    stacked = StackedStreams([patches(s) for s in (1, 2, 3)], parallel=True)
    reference = [patches(s) for s in (1, 2, 3)]
    try:
        for _ in range(WARM + 2):
            got, want = stacked.draw(), [next(r) for r in reference]
            for k, (lr, hr) in enumerate(want):
                np.testing.assert_array_equal(got[0][k], lr)
                np.testing.assert_array_equal(got[1][k], hr)
        assert stacked.at_once
        started = [t for t in threading.enumerate() if t.ident not in before
                   and t.name.startswith(("member-data", "patch-copies"))]
        assert sorted(t.name.split("_")[0] for t in started) == ["member-data", "patch-copies"]
    finally:
        for module in (member_streams, sr_data):
            if module._POOL is not None:
                module._POOL.shutdown()


@pytest.mark.parametrize("parallel", [True, False], ids=["at once", "in turn"])
def test_an_interruption_raised_by_a_members_stream_stops_the_draw_at_once_as_in_turn(
        parallel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that raises an interruption (``KeyboardInterrupt``, not an ``Exception``)
    stops the draw, on a data thread as on the calling one: the member is not taken for one
    whose data failed, and the others are not told to draw on without it."""
    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0)

    def stream(slot: int) -> Iterator[np.ndarray]:
        for step in range(WARM):
            yield np.full((2,), step, np.float32)
        if slot == 1:
            raise KeyboardInterrupt
        yield np.full((2,), WARM, np.float32)

    stacked = StackedStreams([stream(0), stream(1)], parallel=parallel)
    for _ in range(WARM):
        stacked.draw()
    assert stacked.at_once == parallel
    with pytest.raises(KeyboardInterrupt):
        stacked.draw()
    assert stacked.take_failed() == {}


def test_a_kept_failed_slot_moves_with_its_member_and_so_does_its_untold_failure() -> None:
    """`StackedStreams.keep` renumbers the slots: a failed member kept in the group (in
    another place) still holds zeros and is never drawn again, its failure not yet told is
    told under its new slot, and the member that moved into its old place draws on."""
    def stream(slot: int) -> Iterator[np.ndarray]:
        for step in range(1, 10):
            if slot == 0 and step == 2:
                raise RuntimeError("member 0's data is broken")
            yield np.full((2,), 10 * slot + step, np.float32)

    stacked = StackedStreams([stream(0), stream(1), stream(2)], parallel=False)
    np.testing.assert_array_equal(stacked.draw(), [[1, 1], [11, 11], [21, 21]])
    np.testing.assert_array_equal(stacked.draw(), [[0, 0], [12, 12], [22, 22]])
    stacked.keep([2, 0])  # member 2 moves to slot 0, failed member 0 to slot 1
    failed = stacked.take_failed()
    assert list(failed) == [1] and "member 0's data is broken" in str(failed[1])
    np.testing.assert_array_equal(stacked.draw(), [[23, 23], [0, 0]])
    assert stacked.take_failed() == {}


def test_a_members_draw_still_queued_when_ctrl_c_comes_never_starts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With one data thread, member 1's draw waits behind member 0's; a Ctrl-C during member
    0's draw ends the draw, and member 1's stream is never advanced after it (its job, run
    later by the thread, does nothing)."""
    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0)
    monkeypatch.setattr(member_streams, "host_cores", lambda: 1)
    monkeypatch.setattr(member_streams, "_POOL", None)
    started: list[int] = []

    def stream(slot: int) -> Iterator[np.ndarray]:
        for step in range(WARM + 5):
            if step == WARM:
                started.append(slot)
                if slot == 0:  # once member 1's draw is queued too
                    time.sleep(0.2)
                    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                    time.sleep(0.3)
            yield np.full((2,), step, np.float32)

    stacked = StackedStreams([stream(0), stream(1)], parallel=True)
    try:
        for _ in range(WARM):
            stacked.draw()
        assert stacked.at_once
        with pytest.raises(KeyboardInterrupt):
            stacked.draw()
    finally:
        if member_streams._POOL is not None:
            member_streams._POOL.shutdown(wait=True)  # runs every job still queued
    assert started == [0]
