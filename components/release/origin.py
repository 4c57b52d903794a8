"""The copy of ``components`` a packaged bundle carries, and which copy a bundle runs.

A packaged bundle carries this package's source at ``<bundle>/components/`` (:func:`package_source` lists what
:func:`components.release.package.package_bundle` copies there at packaging time, from the running package: there is no
second copy to keep by hand). Python imports one ``components`` per process, the first it finds on ``sys.path``, and a
config imports it when its first expression is evaluated (``initialize``). So the bundle's own copy runs when the
bundle folder comes first on ``sys.path``. MONAI (1.5.1, 1.6.1) adds the bundle folder to ``sys.path`` itself only in
``ConfigWorkflow.run``, after ``initialize``, and ``monai.bundle.load`` never does; so every bundle config's
``initialize`` begins with ``"$sys.path.insert(0, os.path.abspath(@bundle_root))"`` and ``"$import components"``:
``python -m monai.bundle run --config_file B/configs/train.json --bundle_root B`` runs from any working directory
(started in ``B`` it needs no ``--bundle_root``: ``python -m`` puts the working directory first), and
``monai.bundle.load``, whose ``bundle_root`` is the caller's directory, needs ``sys.path.insert(0, <bundle folder>)``.
The second item is needed because MONAI evaluates a config's import statements (its ``imports``) once, before the
first expression of ``initialize``: without the folder on ``sys.path`` yet, ``components`` is bound to MONAI's
placeholder that raises on use. ``initialize`` keeps no results, so MONAI evaluates an import statement of it again
before the next expression, which then finds the bundle's copy.

Any other copy, an installed one or the copy of another bundle already imported in the same process, may differ
(another version, another bundle's edits) and would run the config silently on the wrong code. :func:`report_origin`,
called when a bundle starts, finds the bundle from the config files of the ``python -m monai.bundle run`` command
line (:func:`components.config.running.running_bundle`; without one, ``bundle_root`` or the first copy on
``sys.path``), compares the imported package with
the bundle's copy by content (:func:`source_digest`) and refuses a different one in one line naming both. Two
bundles carrying the same code share one import.

Importing this module imports neither torch nor MONAI.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.machinery
import logging
import os
import sys
from collections.abc import Collection
from pathlib import Path

from ..config.running import running_bundle
from ..errors import UserError

__all__ = ["report_origin"]

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # the running package: what a bundle packaged now carries
PACKAGE_DATA = ("release/schema/*.json",)  # its data files besides the modules (pyproject.toml's package-data)


class BundleCodeMismatch(UserError, ImportError):
    """The ``components`` imported in this process is not the code the bundle carries."""


def package_source(package_dir: str | os.PathLike = PACKAGE_DIR) -> list[str]:
    """The files of a ``components`` package that a bundle carries, as sorted POSIX paths relative to ``package_dir``:
    every ``*.py`` and the :data:`PACKAGE_DATA`, not caches (``__pycache__``), hidden folders or compiled files.
    Raises ``FileNotFoundError`` when ``package_dir`` is not a package (no ``__init__.py``)."""
    root = Path(package_dir)
    if not (root / "__init__.py").is_file():
        raise FileNotFoundError(f"{root} is not a Python package (no __init__.py) to carry in a bundle.")
    found = set(root.rglob("*.py")) | {p for pattern in PACKAGE_DATA for p in root.glob(pattern)}
    rels = [p.relative_to(root) for p in found if p.is_file()]
    return sorted(r.as_posix() for r in rels if not any(part.startswith(".") or part == "__pycache__" for part in r.parts))


def declared_version(package_dir: str | os.PathLike) -> str | None:
    """The string assigned to ``__version__`` in ``package_dir/__init__.py``, read without importing it (a second
    package of the same name cannot be imported next to the first); ``None`` when the file assigns none.
    Example: ``declared_version(Path(components.__file__).parent) == components.__version__``."""
    init = Path(package_dir) / "__init__.py"
    tree = ast.parse(init.read_text(encoding="utf-8"), filename=str(init))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__version__" for t in targets):
            value = node.value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                return value.value
    return None


def source_digest(package_dir: str | os.PathLike, exclude: Collection[str] = ()) -> str:
    """The SHA-256 of a ``components`` package's source, :func:`package_source` (names and bytes): equal for two copies
    of the same code wherever they are (a bundle's copy and the installed package it was packaged from). ``exclude``
    names files (relative POSIX paths, e.g. ``"demo/run.py"``) left out, for a digest of the code a process runs;
    raises ``ValueError`` for a name that is not one of the package's files (a renamed module would otherwise be
    digested again silently)."""
    root = Path(package_dir)
    files = package_source(root)
    unknown = sorted(set(exclude) - set(files))
    if unknown:
        raise ValueError(f"exclude names {unknown}, not files of the package at {root}.")
    digest = hashlib.sha256()
    for rel in (f for f in files if f not in exclude):
        data = (root / rel).read_bytes()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def _folder_without_command_line(bundle_root: Path) -> Path:
    """``bundle_root`` when it holds a ``components/`` package, else the folder of the first ``components`` package on
    ``sys.path`` (the copy a fresh import would take), else ``bundle_root``."""
    if (bundle_root / "components" / "__init__.py").is_file():
        return bundle_root
    spec = importlib.machinery.PathFinder.find_spec("components", sys.path)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]).resolve().parent if locations else bundle_root


def report_origin(bundle_root: str | os.PathLike = ".") -> Path:
    """Logs ``components <version> from <path>`` (INFO) for the imported package and returns its folder; refuses a run
    on code other than the bundle's own.

    The bundle folder is that of the config files on the ``python -m monai.bundle run`` command line
    (:func:`~components.config.running.running_bundle`, whatever the working directory). Without one (a workflow
    started from Python, ``monai.bundle.load``) it is ``bundle_root`` when that holds a ``components/`` package,
    else the folder of the first ``components`` on ``sys.path`` (``importlib.machinery.PathFinder``: the copy a fresh
    import would take, where the docs have the user put the bundle's folder before ``monai.bundle.load``). When the
    bundle folder holds a ``components/`` package (a downloaded bundle) whose source differs from the imported
    package's (:func:`source_digest`), the run stops. A bundle folder without ``components/`` (a bundle inside this
    repository, run with the installed package) gets the INFO line only.

    Args:
        bundle_root: the configs' ``@bundle_root``, used without such a command line.

    Raises:
        BundleCodeMismatch: one line naming the bundle's copy and the imported one (versions and paths), and how to
            run the bundle's own.
    """
    from .. import __version__

    logger.info("components %s from %s", __version__, PACKAGE_DIR)
    running = running_bundle()
    folder = running.folder if running is not None else _folder_without_command_line(Path(bundle_root).resolve())
    carried = folder / "components"
    if not (carried / "__init__.py").is_file() or carried.resolve() == PACKAGE_DIR:
        return PACKAGE_DIR
    if source_digest(carried) != source_digest(PACKAGE_DIR):
        raise BundleCodeMismatch(
            f"the bundle at {folder} carries components {declared_version(carried)} at {carried.resolve()}, but this "
            f"process imported components {__version__} from {PACKAGE_DIR}, other code: run the bundle in a new "
            f"Python process started in {folder} (python -m monai.bundle run ...), or with that folder first on "
            "sys.path before monai.bundle.load, so that its own copy is imported."
        )
    logger.info("components at %s is the same code as the bundle's own copy at %s", PACKAGE_DIR, carried.resolve())
    return PACKAGE_DIR
