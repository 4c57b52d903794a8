"""The package's house rules that a change could silently break: arrows point down, one concern per module, and no
module points outside the repository."""

from __future__ import annotations

import ast
from pathlib import Path

COMPONENTS = Path(__file__).resolve().parents[1] / "components"
# the general pieces below the engine and the recipes: they import none of what sits above them
LOWER = ("checkpoint", "data", "datacheck", "distributed", "atomic", "transforms", "synthetic")
UPPER = ("engine", "recipes", "demo", "runner", "__main__", "rankme")


def _relative_imports(path: Path) -> set[str]:
    """The ``components`` modules a file imports (top-level name after the package)."""
    package = path.relative_to(COMPONENTS.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - node.level + 1])
            parts = base + (node.module.split(".") if node.module else [])
            found.add(parts[1] if len(parts) > 1 else (node.names[0].name if node.names else ""))
    return found


def test_general_modules_import_nothing_above_them():
    for name in LOWER:
        files = list((COMPONENTS / name).rglob("*.py")) if (COMPONENTS / name).is_dir() else [COMPONENTS / f"{name}.py"]
        for path in files:
            upward = _relative_imports(path) & set(UPPER)
            assert not upward, f"{path.relative_to(COMPONENTS)} imports {sorted(upward)}"


def test_checkpoint_is_a_package_of_small_modules_and_no_grab_bag_remains():
    modules = {p.stem: len(p.read_text().splitlines()) for p in (COMPONENTS / "checkpoint").glob("*.py")}
    assert {"layouts", "pretrained", "training_state", "saver", "resume"} <= set(modules)
    assert max(modules.values()) <= 700, modules
    assert not any((COMPONENTS / f"{name}.py").exists() for name in ("faults", "runtime", "checkpoint"))


def test_no_module_points_to_files_outside_the_repository():
    outside = ("shared/notes", "recipe.md", "pitfalls.md", "architecture.md", "bundle-conventions.md")
    offenders = [f"{p.relative_to(COMPONENTS)}:{n}" for p in COMPONENTS.rglob("*.py")
                 for n, line in enumerate(p.read_text().splitlines(), 1) if any(o in line for o in outside)]  # fmt: skip
    assert offenders == []
