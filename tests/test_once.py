"""`scamp_jax._once.OncePerKey`: the one cache of plans, programs and executables that planner
and trial threads share."""

from __future__ import annotations

import threading
import time

import pytest

from scamp_jax._once import OncePerKey


def test_threads_asking_for_one_key_wait_for_one_value_and_other_keys_do_not_wait():
    cache: OncePerKey[int] = OncePerKey()
    calls: list[str] = []
    started = threading.Event()

    def slow() -> int:
        calls.append("a")
        started.set()
        time.sleep(0.3)
        return 1

    results: list[tuple[int, bool]] = []
    threads = [threading.Thread(target=lambda: results.append(cache.get("a", slow)))
               for _ in range(3)]
    for t in threads:
        t.start()
    started.wait()
    begin = time.perf_counter()
    assert cache.get("b", lambda: 2) == (2, True)  # not held up by "a"
    assert time.perf_counter() - begin < 0.2
    for t in threads:
        t.join()
    assert calls == ["a"] and sorted(results) == [(1, False), (1, False), (1, True)]
    assert "a" in cache and len(cache) == 2 and sorted(cache.items()) == [("a", 1), ("b", 2)]


def test_a_make_that_raises_stores_nothing_and_the_next_asker_makes_it():
    cache: OncePerKey[int] = OncePerKey()

    def fail() -> int:
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        cache.get("k", fail)
    assert "k" not in cache
    assert cache.get("k", lambda: 5) == (5, True)
    cache.set("k", 6)
    assert cache.get("k", lambda: 7) == (6, False)
