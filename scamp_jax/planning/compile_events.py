"""Count XLA backend compiles as they happen, by function name (`jax.monitoring` events).

JAX records ``/jax/core/compile/backend_compile_duration`` around every backend compile request
that its in-memory caches did not answer, with the jitted function's name; a request answered by
the persistent compilation cache records ``/jax/compilation_cache/cache_hits`` inside it. So a
real compile is a duration event without a cache hit. `CompileCounter` is how the project's tests
and benchmarks show that a plan or a run did (or did not) compile.
"""

from __future__ import annotations

import threading
from collections import Counter
from types import TracebackType

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Context manager counting backend compiles (and persistent-cache hits) by function name.

    ``with CompileCounter() as c: ...`` then ``c.compiles["step"]`` is the number of programs
    named ``step`` that XLA compiled inside the block, ``c.cache_hits["step"]`` those loaded from
    the persistent compilation cache instead, and ``c.total`` all compiles. Counts every thread
    of the process (listeners are global), so run it where nothing else compiles concurrently.
    """

    def __init__(self) -> None:
        self.compiles: Counter[str] = Counter()
        self.cache_hits: Counter[str] = Counter()
        self._hit = threading.local()
        self._active = False

    @property
    def total(self) -> int:
        """All backend compiles counted so far (cache hits excluded)."""
        return sum(self.compiles.values())

    def _on_event(self, event: str, **kwargs: str | int) -> None:
        if self._active and event == CACHE_HIT_EVENT:
            self._hit.value = True

    def _on_duration(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if not self._active or event != BACKEND_COMPILE_EVENT:
            return
        name = str(kwargs.get("fun_name", "?"))
        if getattr(self._hit, "value", False):
            self.cache_hits[name] += 1
        else:
            self.compiles[name] += 1
        self._hit.value = False

    def __enter__(self) -> CompileCounter:
        self._active = True
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._active = False
        jax.monitoring.unregister_event_listener(self._on_event)
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
