"""The package as a user installs it: a wheel built from this repository and installed with its dependencies into a
fresh virtual environment runs ``demo``, ``package`` and ``fetch`` from a folder outside any clone, with the bundles
the wheel carries as package data (``components/bundles/<name>/``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
import torch

from tests.test_bundle_download import _env, _ok, _run

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BTCV = "swin_unetr_btcv_finetune"


def _tracked(folder: str) -> list[str]:
    out = subprocess.run(["git", "ls-files", folder], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return out.split()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    dist = tmp_path_factory.mktemp("wheel")
    _ok(_run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", dist, REPO], dist, _env()), "pip wheel")
    (path,) = dist.glob("swin_ssl_bundles-*.whl")
    return path


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding torch and the wheel with its dependencies, nothing of the clone."""
    root = tmp_path_factory.mktemp("wheel_venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", root / "env"], check=True, timeout=300)
    python = root / "env" / "bin" / "python"
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--no-compile", "--quiet", torch_pin, wheel]
    _ok(_run(pip, root, _env()), "pip install the wheel")
    return python


def test_the_wheel_carries_every_package_and_every_bundle_file(wheel):
    """The explicit package list of pyproject.toml is the source tree's (a new subpackage cannot be left out), and
    the wheel holds every tracked file of bundles/ under components/bundles/."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = [".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "components").rglob("__init__.py")]
    assert sorted(config["packages"]) == sorted([*packages, "components.bundles"])
    names = set(zipfile.ZipFile(wheel).namelist())
    bundle_files = _tracked("bundles")
    assert bundle_files and {"components/" + f for f in bundle_files} <= names
    sources = [f for f in _tracked("components") if f.endswith((".py", ".json"))]
    assert set(sources) <= names


def test_demo_package_and_fetch_run_from_the_installed_wheel(venv_python, tmp_path):
    """From a folder outside the clone, with no PYTHONPATH: components and its bundles come from the venv; the quick
    demo writes its summary, ``package`` zips a carried bundle, ``fetch`` verifies and extracts it; nothing is
    written into the installed bundles; an unknown bundle name fails naming the carried ones."""
    env = _env(OMP_NUM_THREADS="2")
    where = "import json, components, components.demo.runner as r; print(json.dumps([components.__file__, str(r.BUNDLES_DIR)]))"
    package_file, bundles = json.loads(_ok(_run([venv_python, "-c", where], tmp_path, env), "import").strip().splitlines()[-1])
    site = Path(venv_python).parent.parent
    assert Path(package_file).is_relative_to(site) and Path(bundles) == Path(package_file).parent / "bundles"
    before = sorted(str(p.relative_to(bundles)) for p in Path(bundles).rglob("*") if "__pycache__" not in p.parts)

    _ok(_run([venv_python, "-m", "components", "demo", "--budget", "quick", "--out", "demo"], tmp_path, env), "demo")
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert str(Path(bundles) / BTCV / "configs") in json.dumps(summary)  # its runs used the carried bundles

    _ok(_run([venv_python, "-m", "components", "package", BTCV, "--out", "dist"], tmp_path, env), "package")
    (zip_path,) = (tmp_path / "dist").glob(f"{BTCV}_v*.zip")
    assert (tmp_path / "dist" / f"{zip_path.name}.sha256").is_file()
    _ok(_run([venv_python, "-m", "components", "fetch", f"dist/{zip_path.name}", "--dest", "got"], tmp_path, env), "fetch")
    assert json.loads((tmp_path / "got" / BTCV / "configs" / "train.json").read_text()) == json.loads(
        (REPO / "bundles" / BTCV / "configs" / "train.json").read_text()
    )

    after = sorted(str(p.relative_to(bundles)) for p in Path(bundles).rglob("*") if "__pycache__" not in p.parts)
    assert after == before
    wrong = _run([venv_python, "-m", "components", "package", "no_such_bundle"], tmp_path, env)
    assert wrong.returncode == 2 and BTCV in wrong.stdout and "no_such_bundle" in wrong.stdout, wrong.stdout[-2000:]
