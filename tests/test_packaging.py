"""The lower-bound run's pins (.ci/minimum-versions.txt) are the floors pyproject.toml declares."""

from __future__ import annotations

import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
# What the lower-bound run installs, on the oldest Python pyproject.toml declares.
EXTRAS = ("dev", "mpi")


def _floors() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    oldest = project["requires-python"].removeprefix(">=")
    environment = {**default_environment(), "python_version": oldest,
                   "python_full_version": f"{oldest}.0"}
    lines = list(project["dependencies"])
    for extra in EXTRAS:
        lines += project["optional-dependencies"][extra]
    floors = {}
    for line in lines:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        lows = [s.version for s in requirement.specifier if s.operator == ">="]
        assert len(lows) == 1, f"{line!r} needs exactly one '>=' floor for the lower-bound run"
        floors[canonicalize_name(requirement.name)] = lows[0]
    return floors


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci" / "minimum-versions.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_the_lower_bound_pins_are_the_declared_floors():
    floors, pins = _floors(), _pins()
    assert sorted(pins) == sorted(floors), (
        "pin exactly the floors of pyproject.toml's dependencies and its "
        f"{', '.join(EXTRAS)} extras in .ci/minimum-versions.txt")
    # Versions compare as releases: a floor written short (">=13") is the pin "13.0.0".
    different = {name: (floors[name], pins[name]) for name in floors
                 if Version(pins[name]) != Version(floors[name])}
    assert not different, f"floor in pyproject.toml vs pin in .ci/minimum-versions.txt: {different}"


def test_make_run_after_make_test_installs_nothing(tmp_path: Path) -> None:
    """``scripts/setup.sh run`` (``make run``) needs the package alone: an install of it with
    the test extras since ``pyproject.toml`` last changed has it, so nothing is installed
    again (no network needed); with no install yet, it installs."""
    import os
    import shutil
    import subprocess
    import time

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "scripts").mkdir()
    shutil.copy(root / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    shutil.copy(root / "pyproject.toml", tmp_path / "pyproject.toml")
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    log = tmp_path / "calls.log"
    # A stand-in interpreter that records what it is asked (no real venv: this checks the
    # script's decision, not pip).
    (venv / "python").write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                                 'case "$1" in --version) echo "Python 3.12.0";; esac\n')
    (venv / "python").chmod(0o755)
    env = {**os.environ, "PYTHON": str(venv / "python")}
    env.pop("SCAMP_EXTRAS", None)  # the package alone, as make run asks (CI adds extras)

    def setup() -> list[str]:
        log.write_text("")
        proc = subprocess.run(["bash", "scripts/setup.sh", "run"], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return [c for c in log.read_text().splitlines() if "pip install" in c]

    assert setup()  # nothing installed yet: the package is
    (tmp_path / ".venv" / ".installed-run-none").unlink()
    time.sleep(0.01)
    (tmp_path / ".venv" / ".installed-test-dev,mpi,postgres").touch()
    assert setup() == []
    time.sleep(0.01)
    (tmp_path / "pyproject.toml").touch()  # changed since: installed again
    assert setup()
