"""The API reference (``make docs``: pdoc over the public modules) builds without a warning."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from _requirements import require_module

ROOT = Path(__file__).resolve().parent.parent


def _pdoc_modules() -> list[str]:
    """The modules ``make docs`` documents (its ``PDOC_MODULES`` line)."""
    match = re.search(r"^PDOC_MODULES\s*=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, "Makefile has no PDOC_MODULES line"
    return match.group(1).split()


def test_api_reference_builds_without_warnings(tmp_path):
    require_module("pdoc", "pdoc (the `docs` extra) is not installed")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "pdoc", "--docformat", "google", "-o", str(tmp_path),
         *_pdoc_modules()],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", f"pdoc warned:\n{proc.stderr}"
    page = (tmp_path / "scamp_jax.html").read_text()
    for name in ("run_study", "FunctionTask", "SearchSettings", "SearchSpace", "plan_mesh"):
        assert f'id="{name}"' in page, f"{name} is missing from the API reference"
    assert (tmp_path / "scamp_jax" / "pipeline.html").is_file()
