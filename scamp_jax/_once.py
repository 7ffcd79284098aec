"""Values made once per key by whichever thread asks first (the caches of plans, programs and
executables that planner and trial threads share)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class OncePerKey(Generic[V]):
    """A thread-safe map whose value for a key is made once: threads asking for a key being
    made wait for that value; threads asking for other keys do not wait (each key has its own
    lock while its value is made). A ``make`` that raises stores nothing: the next asker makes
    the value again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[Hashable, V] = {}
        self._making: dict[Hashable, threading.Lock] = {}

    def get(self, key: Hashable, make: Callable[[], V]) -> tuple[V, bool]:
        """The value of ``key``, and whether this call made it with ``make``."""
        with self._lock:
            if key in self._values:
                return self._values[key], False
            key_lock = self._making.setdefault(key, threading.Lock())
        with key_lock:
            with self._lock:
                if key in self._values:
                    return self._values[key], False
            value = make()
            with self._lock:
                self._values[key] = value
        return value, True

    def set(self, key: Hashable, value: V) -> None:
        """Store ``value`` under ``key`` (replacing what was there)."""
        with self._lock:
            self._values[key] = value

    def items(self) -> list[tuple[Any, V]]:
        """A snapshot of the keys and values made so far."""
        with self._lock:
            return list(self._values.items())

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._values

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)
