"""What autodiff keeps for the backward pass, as ``jax.ad_checkpoint.print_saved_residuals``
prints it (JAX's public form of it), parsed: ``[(shape, note), ...]``."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Callable
from typing import Any

from jax.ad_checkpoint import print_saved_residuals

_LINE = re.compile(r"^\w+\[([\d,]*)\] (.*)$")


def saved_residuals(fn: Callable[..., Any], *args: Any) -> list[tuple[tuple[int, ...], str]]:
    """The residuals of ``jax.vjp(fn, *args)``: each one's shape and where it comes from
    (e.g. ``output of exp from ...``)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    rows = []
    for line in out.getvalue().splitlines():
        match = _LINE.match(line.strip())
        if match:
            dims = match.group(1)
            rows.append((tuple(int(d) for d in dims.split(",")) if dims else (), match.group(2)))
    return rows
