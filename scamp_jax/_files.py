"""Files written whole or not at all."""

from __future__ import annotations

import os
import threading
from pathlib import Path


def write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: a new file beside it, then renamed over
    it, so a process stopped at any point (a second Ctrl-C) leaves the old file or the new
    one, never a cut one (each thread of each process writes a part file of its own)."""
    part = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    try:
        with part.open("w", newline="") as handle:
            handle.write(text)
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
