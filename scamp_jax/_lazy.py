"""Public names that load their module on first use, so ``import scamp_jax`` stays light.

A package lists its public names with the module each lives in; `exports` gives it the
module-level ``__getattr__`` and ``__dir__`` (PEP 562) that import that module when the name is
first read. ``import scamp_jax`` then imports neither JAX nor Optuna nor orbax; ``from scamp_jax
import run_study`` imports what `run_study` needs.
"""

from __future__ import annotations

import importlib
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def exports(package: str, names: Mapping[str, str]
            ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public ``names`` map to their modules.

    A name that maps to ``f"{package}.{name}"`` is that subpackage itself.
    """

    def __getattr__(name: str) -> Any:
        try:
            where = names[name]
        except KeyError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        module = importlib.import_module(where)
        value = module if where == f"{package}.{name}" else getattr(module, name)
        setattr(sys.modules[package], name, value)  # later reads skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(names) | set(vars(sys.modules[package])))

    return __getattr__, __dir__


def warm(modules: Iterable[str]) -> threading.Thread | None:
    """Import ``modules`` in a background thread (those not imported yet) and return it (None:
    nothing to import).

    For modules a run needs only later (orbax at a trial's first checkpoint, matplotlib for the
    report): imported while the run waits for its first compile, they are not on its path
    later. A module that fails to import here is left alone: its user imports it again and gets
    the error.
    """
    missing = [m for m in modules if m not in sys.modules]
    if not missing:
        return None

    def load() -> None:
        for name in missing:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the module's user imports it and sees the error
                pass

    thread = threading.Thread(target=load, name="warm-imports", daemon=True)
    thread.start()
    return thread
