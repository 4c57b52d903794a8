"""One atomic-write helper (components.files) for every file the package writes for a user."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from components.files import atomic_write

COMPONENTS = Path(__file__).resolve().parents[1] / "components"


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text("old")
    os.chmod(path, 0o600)
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_write(path, "w") as f:
            f.write("half of the new")
            raise RuntimeError("disk full")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
    with atomic_write(path, "w") as f:
        f.write("new")
    assert path.read_text() == "new" and (path.stat().st_mode & 0o777) == 0o600  # permissions kept
    with atomic_write(tmp_path / "sub" / "new.bin") as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "sub" / "new.bin").read_bytes() == b"\x00\x01" and ((tmp_path / "sub" / "new.bin").stat().st_mode & 0o777) == 0o644
    with pytest.raises(ValueError, match="mode must be"):
        with atomic_write(path, "a"):
            pass


def test_no_module_writes_a_temporary_file_by_hand():
    """Checkpoints, metrics, packages, sidecars and downloads all go through atomic_write."""
    by_hand = re.compile(r"mkstemp|uuid4\(\)\.hex")
    offenders = [f"{p.name}:{n}" for p in COMPONENTS.rglob("*.py") if p.name != "files.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if by_hand.search(line)]  # fmt: skip
    assert offenders == []
