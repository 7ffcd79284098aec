"""How an error is worded for the person who reads it: one place for the library's default
(``TypeName: message``) and for a command line's own (its flags instead of the library's
keywords), which an entry point installs around its run (`worded_by`); a failing MPI rank says
its error this way before the job aborts, as the entry point would have said it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar


def _library_wording(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


_WORDING: ContextVar[Callable[[BaseException], str]] = ContextVar(
    "scamp_jax_error_wording", default=_library_wording)


def worded(err: BaseException) -> str:
    """``err`` as the current entry point words it (default ``TypeName: message``)."""
    return _WORDING.get()(err)


@contextlib.contextmanager
def worded_by(wording: Callable[[BaseException], str]) -> Iterator[None]:
    """Word errors with ``wording`` while the block runs (in this thread and context)."""
    token = _WORDING.set(wording)
    try:
        yield
    finally:
        _WORDING.reset(token)
