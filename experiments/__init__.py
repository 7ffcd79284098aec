"""The experiments' command lines (``python -m experiments.<name>``).

Started with ``-m``, a Ctrl-C that comes while the command is still importing (JAX, Flax and
the rest take a second or two, before the command's own handler, `experiments._cli.user_errors`,
is in place) ends it with one line and status 130, where Python would print the traceback of
the import it cut into (or JAX's garbage-collection hook would swallow it and the run go on).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from typing import Any


def _interrupted_while_starting(signum: int, frame: Any) -> None:
    """SIGINT before the command stored anything: say so and end at once."""
    with contextlib.suppress(OSError):
        os.write(2, b"\ninterrupted while starting: nothing was stored\n")
    os._exit(128 + signum)


# ``-m`` is argv[0] while Python imports this package to run a module of it (a command), not
# when a program (a test, a notebook) imports it.
if sys.argv[:1] == ["-m"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _interrupted_while_starting)
