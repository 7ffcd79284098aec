"""Printing the benchmarks' tables: aligned plain text, or Markdown for BENCHMARKS.md."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]],
                markdown: bool) -> None:
    """Print ``title`` then the table (strings per cell), as Markdown when ``markdown``."""
    print(f"\n{title}")
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths, strict=True)))


def emit_report(report: dict[str, Any], *, print_json: bool, out: Path | None) -> None:
    """A benchmark's JSON report: printed when ``print_json`` (``--json``), written to ``out``
    (``--out``, its folder made) when given."""
    text = json.dumps(report, indent=2)
    if print_json:
        print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to b (b = 0 counts as 1e-30)."""
    return abs(a - b) / max(abs(b), 1e-30)


def pct_text(value: float, reference: float) -> str:
    """``value`` against ``reference`` as a signed percentage with one decimal, e.g. ``+3.0%``."""
    return f"{100.0 * (value - reference) / reference:+.1f}%"
