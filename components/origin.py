"""The copy of ``components`` a packaged bundle carries, and which copy a bundle runs.

A packaged bundle carries this package's source at ``<bundle>/components/`` (:func:`package_source` lists what
:func:`components.package.package_bundle` copies there at packaging time, from the running package: there is no
second copy to keep by hand), and its commands are run from the bundle folder, which ``python -m`` puts first on
``sys.path``. Started from another folder, or in an environment with another ``components`` installed, another
copy may be imported without any error: :func:`report_origin`, the first item of every bundle config's
``initialize``, logs which one runs and warns when it is not the bundle's own.

Importing this module imports neither torch nor MONAI.
"""

from __future__ import annotations

import ast
import logging
import os
from pathlib import Path

__all__ = ["PACKAGE_DATA", "PACKAGE_DIR", "declared_version", "package_source", "report_origin"]

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent  # the running package: what a bundle packaged now carries
PACKAGE_DATA = ("schema/*.json",)  # its data files besides the modules (pyproject.toml's package-data)


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


def report_origin(bundle_root: str | os.PathLike) -> Path:
    """Logs ``components <version> from <path>`` (INFO) for the imported package and returns its folder.

    When ``bundle_root`` holds a ``components/`` package (a downloaded bundle) that is not the imported one, or
    whose ``__version__`` differs from the imported one's, a WARNING names both versions and paths and says that the
    imported one runs. A bundle folder without ``components/`` (a bundle inside this repository, run with the
    installed package) gets the INFO line only.

    Args:
        bundle_root: the bundle's root folder (the configs' ``@bundle_root``; relative to the working directory).
    """
    from . import __version__

    logger.info("components %s from %s", __version__, PACKAGE_DIR)
    carried = (Path(bundle_root) / "components").resolve()
    if not (carried / "__init__.py").is_file():
        return PACKAGE_DIR
    carried_version = declared_version(carried)
    if carried != PACKAGE_DIR or carried_version != __version__:
        logger.warning(
            "the bundle at %s carries components %s at %s, but components %s from %s is imported and runs; "
            "run the bundle's commands from its folder (cd %s) so that its own copy is imported",
            carried.parent, carried_version, carried, __version__, PACKAGE_DIR, carried.parent,
        )  # fmt: skip
    return PACKAGE_DIR
