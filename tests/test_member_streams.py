"""A fused group's data: the members' streams drawn into one stacked batch, at once or in turn."""

from __future__ import annotations

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
    for step in range(6):
        if step == 3:
            stacked.keep([2, 0])
            reference = [reference[2], reference[0]]
        got, want = stacked.draw(), _in_turn(reference)
        assert got[0].shape == (len(reference), 5, 3) and got[1]["label"].dtype == np.int32
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1]["label"], want[1]["label"])
    # at once: from the third draw (the first two, in turn, start the streams and time them)
    assert stacked.at_once == parallel
    assert any(t.startswith("member-data") for t in threads) == parallel


def test_draws_too_quick_to_hand_to_threads_stay_in_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """At `PARALLEL_MIN_SECONDS` and above a member's draw goes to the data threads; below it
    the hand-off would cost more than the draw."""
    with monkeypatch.context() as patch:
        patch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 60.0)  # no draw here is that slow
        stacked = StackedStreams([_stream(s) for s in range(3)], parallel=True)
        for _ in range(4):
            stacked.draw()
        assert not stacked.at_once

    def slow(seed: int) -> Iterator[np.ndarray]:
        for x in _stream(seed):
            time.sleep(member_streams.PARALLEL_MIN_SECONDS)
            yield x

    stacked = StackedStreams([slow(s) for s in range(3)], parallel=True)
    for _ in range(3):
        stacked.draw()
    assert stacked.at_once


def test_a_member_whose_batches_change_shape_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0)

    def changing(seed: int) -> Iterator[np.ndarray]:
        yield from (np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32))
        yield np.zeros((3, 2), np.float32)

    stacked = StackedStreams([changing(0), changing(1)], parallel=True)
    stacked.draw()
    stacked.draw()
    with pytest.raises(ValueError, match=r"member 0's stream gave a batch of \[\(\(3, 2\), "):
        stacked.draw()


def test_tasks_say_whether_their_streams_may_be_drawn_at_once() -> None:
    from search_spaces.sr_task import SRTask
    from search_spaces.vit import SyntheticClassificationTask

    assert SRTask.parallel_streams and SyntheticClassificationTask.parallel_streams
    kw = dict(metric="m", direction="minimize", loss_fn=lambda m, b: 0.0,
              batches=lambda b, s: _stream(s, b), evaluate=lambda m: {"m": 0.0})
    assert not parallel_streams(FunctionTask(**kw))  # unless the task says so
    assert parallel_streams(FunctionTask(**kw, parallel_streams=True))
    assert not parallel_streams(object())


def test_a_failing_member_leaves_no_stream_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error of one member's stream is raised once every other member's draw has ended, so
    no stream is advanced after `draw` has given up (the group ends, or draws again)."""
    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0)
    drawn = [0, 0]

    def stream(slot: int) -> Iterator[np.ndarray]:
        for step in range(10):
            if slot == 0 and step == 2:
                raise RuntimeError("member 0's data is broken")
            if slot == 1 and step == 2:
                time.sleep(0.2)
            drawn[slot] += 1
            yield np.full((2,), step, np.float32)

    stacked = StackedStreams([stream(0), stream(1)], parallel=True)
    stacked.draw()
    stacked.draw()
    with pytest.raises(RuntimeError, match="member 0's data is broken"):
        stacked.draw()
    assert drawn == [2, 3]  # member 1's third draw had ended when the error came out
    stacked.keep([1])
    np.testing.assert_array_equal(stacked.draw(), [[3.0, 3.0]])
    assert drawn == [2, 4]


def test_a_member_whose_batches_change_dtype_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """At once, a batch is copied into the stacked batch of the first draws' dtype: a member
    whose dtype changes is refused, not cast (in turn, ``np.stack`` would promote it)."""
    monkeypatch.setattr(member_streams, "PARALLEL_MIN_SECONDS", 0.0)

    def changing(seed: int) -> Iterator[np.ndarray]:
        yield from (np.zeros(3, np.float32), np.zeros(3, np.float32))
        yield np.full(3, 0.1, np.float64)

    stacked = StackedStreams([changing(0), changing(1)], parallel=True)
    stacked.draw()
    stacked.draw()
    with pytest.raises(ValueError, match="float64.*float32"):
        stacked.draw()
