"""The API reference (``make docs``: pdoc over the public modules) builds without a warning."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _requirements import require_module

ROOT = Path(__file__).resolve().parent.parent


def _pdoc_modules() -> list[str]:
    """The modules ``make docs`` documents (its ``PDOC_MODULES`` line)."""
    match = re.search(r"^PDOC_MODULES\s*=\s*(.+)$", (ROOT / "Makefile").read_text(), re.M)
    assert match, "Makefile has no PDOC_MODULES line"
    return match.group(1).split()


@pytest.mark.slow  # run with -m slow (README: Tests)
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


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces -> -."""
    anchors: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        if fenced or not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        base, n = slug, 0
        while slug in anchors:
            n += 1
            slug = f"{base}-{n}"
        anchors.add(slug)
    return anchors


def _doc_pages() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BUILD.md", ROOT / "BENCHMARKS.md",
            *sorted((ROOT / "benchmarks" / "notes").glob("*.md"))]


def test_links_between_the_docs_resolve():
    broken = []
    for page in _doc_pages():
        for target in _LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked here
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_benchmarks_page_stays_a_page_of_results_at_a_glance():
    lines = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    assert len(lines) <= 250, (
        f"BENCHMARKS.md has {len(lines)} lines; keep the latest figure of each promise there "
        "and move the history to benchmarks/notes/<topic>.md")
