"""What pyproject.toml promises about Python and MONAI versions, against what the code needs and what CI runs."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def test_requires_python_admits_no_python_the_code_cannot_run_on():
    """vermin reads every module (the standard library's members by the version that added them, e.g.
    ``hashlib.file_digest`` and ``tomllib``: 3.11) and finds the oldest Python the code runs on; the floor of
    ``requires-python`` is not below it (.ci/run runs the suite on that floor)."""
    floor = re.fullmatch(r">=(\d+\.\d+)", PROJECT["requires-python"])
    assert floor, f"requires-python {PROJECT['requires-python']!r} is not of the form '>=X.Y'"
    folders = [str(REPO / name) for name in ("components", "tests", "benchmarks")]
    vermin = [sys.executable, "-c", "import sys, vermin; sys.exit(vermin.main())"]  # its command line, this Python
    out = subprocess.run([*vermin, "--no-tips", *folders], capture_output=True, text=True).stdout
    needed = re.search(r"Minimum required versions: (?:2\.\d+, )?(3\.\d+)", out)
    assert needed, out
    assert _version(needed[1]) <= _version(floor[1]), f"the code needs Python {needed[1]}: {out}"


def test_monai_is_a_range_whose_oldest_ci_installs():
    """MONAI is required as ``monai>=OLDEST,<NEXT``, the form .ci/run reads OLDEST from for its second run (and
    no exact pin: the package installs beside other MONAI versions)."""
    (monai,) = [d for d in PROJECT["dependencies"] if re.match(r"monai\b", d)]
    assert re.fullmatch(r"monai>=\d+\.\d+(\.\d+)?,<\d+\.\d+", monai), monai


def test_the_docs_state_the_monai_range_of_pyproject():
    """README.md and docs/testing.md name the MONAI range pyproject.toml declares, and docs/testing.md the oldest
    version that .ci/run's second environment installs."""
    (monai,) = [d for d in PROJECT["dependencies"] if re.match(r"monai\b", d)]
    oldest = re.fullmatch(r"monai>=([\d.]+),<[\d.]+", monai)[1]
    readme, testing = ((REPO / name).read_text() for name in ("README.md", "docs/testing.md"))
    assert f"MONAI `{monai[len('monai'):]}` work" in readme, f"README.md does not name {monai}"
    assert f"`{monai}`" in testing and f"`monai=={oldest}`" in testing, f"docs/testing.md does not name {monai}"
