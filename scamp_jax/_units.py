"""Byte quantities: parse "2GiB"-style strings and format byte counts for people."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Return a byte count from an int, a float, or a string such as ``"2GiB"``, ``"512 MB"``.

    Binary units (KiB, MiB, GiB, TiB, and the bare K/M/G/T) are powers of 1024, decimal units
    (KB, MB, GB, TB) powers of 1000. Raises ``ValueError`` naming the value for anything else,
    for a count that is not positive, and for a fraction of a byte below 1 KiB (a size whose
    unit was left out: ``1.5`` is not 1 byte); a larger fraction is cut off.
    """
    if isinstance(value, bool):
        raise TypeError(f"memory size must be a byte count or a string like '2GiB', got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"memory size must be a finite byte count, got {value!r}")
    if isinstance(value, int | float):
        count = _whole_bytes(value, value)
    elif isinstance(value, str):
        match = _PATTERN.match(value)
        if match is None or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"cannot read memory size {value!r}: use a number of bytes or a number with a "
                "unit, e.g. '2GiB', '512MiB', '16GB'"
            )
        scaled = float(match.group(1)) * _UNITS[match.group(2).lower()]
        if not math.isfinite(scaled):
            raise ValueError(f"cannot read memory size {value!r}: it is beyond any memory; "
                             "use e.g. '2GiB', '512MiB', '16GB'")
        count = (_whole_bytes(scaled, value, match.group(1))
                 if _UNITS[match.group(2).lower()] == 1 else int(scaled))
    else:
        raise TypeError(f"memory size must be a byte count or a string like '2GiB', got {value!r}")
    if count <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return count


def names_a_unit(text: str) -> bool:
    """Whether ``text``, a size `parse_bytes` reads, names its unit (``"2GiB"``, ``"16B"``),
    not a bare number (``"16"``, ``"1e3"``)."""
    match = _PATTERN.match(text)
    return match is not None and bool(match.group(2))


def _whole_bytes(count: float, value: object, number: object = None) -> int:
    """``count`` bytes (given as ``value``, whose figure is ``number``; None: a number without
    a unit) as a whole number: a fraction is cut off, except below 1 KiB, where a size with a
    fraction of a byte is one whose unit was left out (``1.5``, meant as 1.5 GiB)."""
    if count != int(count) and count < 1024:
        advice = ("did you leave out its unit? e.g. "
                  f"'{value if number is None else number}GiB' or "
                  f"'{value if number is None else number}GB'"
                  if number is None or str(value).strip() == str(number) else
                  "give it in a larger unit, e.g. GiB")
        raise ValueError(f"memory size {value!r} is not a whole number of bytes; {advice}")
    return int(count)


def format_bytes(count: float) -> str:
    """Format a byte count with a binary unit, e.g. ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    sign = "-" if count < 0 else ""
    count = abs(float(count))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if count < 1024 or unit == "TiB":
            return f"{sign}{count:.0f} {unit}" if unit == "B" else f"{sign}{count:.2f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def format_share(fraction: float) -> str:
    """``fraction`` as a percentage with one decimal, or below 0.1% with two significant
    digits, so that a share that is not zero never reads as one (``"54.9%"``, ``"0.3%"``,
    ``"0.05%"``, ``"0.0021%"``, ``"0%"``)."""
    percent = 100 * float(fraction)
    if percent == 0:
        return "0%"
    if abs(percent) >= 0.095:  # one decimal shows it as at least 0.1
        return f"{percent:.1f}%"
    decimals = 1 - math.floor(math.log10(abs(percent)))  # two significant digits
    return f"{percent:.{decimals}f}".rstrip("0").rstrip(".") + "%"


def format_duration(seconds: float) -> str:
    """``seconds`` for a person: ``45 s``, ``12 min``, ``3.5 h``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def counted(n: int, noun: str) -> str:
    """``"1 compile"``, ``"2 compiles"``: ``n`` and ``noun``, plural unless ``n`` is 1."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def shortened(text: str, limit: int) -> str:
    """``text`` on one line (its runs of white space as one space), at most ``limit``
    characters: cut with `` ...`` at a word where that drops at most `WORD_CUT` characters
    more, else inside the word (a long path or word is cut, not left out whole)."""
    line = " ".join(text.split())
    if len(line) <= limit:
        return line
    room = max(0, limit - len(" ..."))
    head = line[:room]
    at_word = head.rsplit(" ", 1)[0] if line[room] != " " and " " in head else head
    return (at_word if room - len(at_word) <= WORD_CUT else head).rstrip() + " ..."


#: The most characters `shortened` drops to cut at a word rather than inside one.
WORD_CUT = 16
