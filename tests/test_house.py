"""The package's house rules that a change could silently break: arrows point down, one concern per module, and no
module points outside the repository."""

from __future__ import annotations

import ast
from pathlib import Path

COMPONENTS = Path(__file__).resolve().parents[1] / "components"
# the house as ``ls components/`` shows it, top to bottom (components/__init__.py's docstring): a module imports only
# from its own entry and the entries below it
LAYERS = ("__main__", "release", "demo", "recipes", "training", "checkpoint", "data", "networks", "config",
          "errors", "distributed", "files", "lazy")


def _relative_imports(path: Path, root: Path = COMPONENTS) -> set[str]:
    """The ``components`` entries a file under ``root`` imports (the top-level name after the package)."""
    package = path.relative_to(root.parent).with_suffix("").parts[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = list(package[: len(package) - node.level + 1])
            parts = base + (node.module.split(".") if node.module else [])
            found.add(parts[1] if len(parts) > 1 else (node.names[0].name if node.names else ""))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("components."):
            found.add(node.module.split(".")[1])
    return found


def test_ls_components_shows_the_architecture():
    entries = {p.name.removesuffix(".py") for p in COMPONENTS.iterdir() if p.name != "__pycache__"}
    assert entries == {"__init__", *LAYERS}, sorted(entries ^ {"__init__", *LAYERS})
    assert all((COMPONENTS / name / "__init__.py").is_file() for name in LAYERS if (COMPONENTS / name).is_dir())


def test_imports_point_down_the_house():
    """Each entry imports only entries below it in :data:`LAYERS` (the root package's public names excepted)."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in _module_files():
        entry = path.relative_to(COMPONENTS).parts[0].removesuffix(".py")
        if entry == "__init__":
            continue
        for target in _relative_imports(path) & set(rank):
            if rank[target] < rank[entry]:
                upward.append(f"{path.relative_to(COMPONENTS)} imports {target}")
    assert upward == []


def test_an_upward_import_is_seen(tmp_path):
    """The check above can fail: the entries a data module imports, the trainer among them, are found."""
    fake = tmp_path / "components" / "data" / "store" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from ...training.wrappers import unwrap\nfrom ..datalists import load_datalist\n")
    assert _relative_imports(fake, tmp_path / "components") == {"training", "data"}


def test_checkpoint_is_a_package_of_small_modules_and_no_grab_bag_remains():
    modules = {p.stem: len(p.read_text().splitlines()) for p in (COMPONENTS / "checkpoint").glob("*.py")}
    assert {"layouts", "pretrained", "training_state", "saver", "resume"} <= set(modules)
    assert max(modules.values()) <= 700, modules
    assert not any((COMPONENTS / f"{name}.py").exists() for name in ("faults", "runtime", "checkpoint"))


def test_data_is_a_package_of_small_modules_below_the_trainer():
    """Datalists, partitioning, datasets, the compact cache transforms and the data check live in components/data/
    (the flat data, datacheck and transforms modules are gone), each module under 700 lines, and none of them imports
    the engine, a recipe, the checkpoint package or the command line."""
    import importlib.util

    data = COMPONENTS / "data"
    modules = {p.stem: len(p.read_text().splitlines()) for p in data.rglob("*.py")}
    assert {"datalists", "partition", "datasets", "sources", "compact_cache", "check", "check_report", "check_command"} <= set(modules)
    assert max(modules.values()) < 700, modules
    assert not any((COMPONENTS / f"{name}.py").exists() for name in ("data", "datacheck", "transforms"))
    assert importlib.util.find_spec("components.datacheck") is None
    assert importlib.util.find_spec("components.transforms") is None
    assert importlib.util.find_spec("components.data").submodule_search_locations is not None  # a package, not data.py
    above = {"training", "recipes", "checkpoint", "__main__", "demo", "release"}
    for path in data.rglob("*.py"):
        upward = _relative_imports(path) & above
        assert not upward, f"{path.relative_to(COMPONENTS)} imports {sorted(upward)}"


def _private_imports(path: Path) -> list[str]:
    """The private names (``_x``) that a module imports from another module of the package."""
    return [alias.name for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.level and node.module != "__future__"
            for alias in node.names if alias.name.startswith("_")]  # fmt: skip


def test_the_data_check_modules_meet_at_public_names():
    """The data check is split along interfaces (one file, one entry, the datalist walk): none of its modules imports a
    private name of another, as the split to stay under a line cap once did (13 of them)."""
    check = sorted((COMPONENTS / "data").glob("check*.py"))
    assert len(check) >= 5
    assert {str(p.relative_to(COMPONENTS)): _private_imports(p) for p in check if _private_imports(p)} == {}


def test_a_private_import_is_seen(tmp_path):
    fake = tmp_path / "components" / "data" / "check_x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("from .check_files import _fmt, read_header\nfrom numpy import _core\n")
    assert _private_imports(fake) == ["_fmt"]


def test_no_module_points_to_files_outside_the_repository():
    outside = ("shared/notes", "recipe.md", "pitfalls.md", "architecture.md", "bundle-conventions.md")
    offenders = [f"{p.relative_to(COMPONENTS)}:{n}" for p in COMPONENTS.rglob("*.py")
                 for n, line in enumerate(p.read_text().splitlines(), 1) if any(o in line for o in outside)]  # fmt: skip
    assert offenders == []


def _module_files() -> list[Path]:
    return sorted(COMPONENTS.rglob("*.py"))


def test_each_recipe_is_a_package_and_the_general_modules_hold_no_recipe():
    recipes = COMPONENTS / "recipes"
    assert {p.name for p in recipes.iterdir() if (p / "__init__.py").is_file()} >= {"inpainting_contrast", "self_distillation"}
    assert {p.stem for p in (recipes / "inpainting_contrast").glob("*.py")} >= {"network", "views", "loss", "recipe"}
    assert not any((COMPONENTS / f"{name}.py").exists() for name in ("augment", "losses"))
    shared = "".join(p.read_text() for p in (COMPONENTS / "networks").glob("*.py"))
    assert "class SSLHead" not in shared and "SelfDistillation" not in shared


def test_no_module_is_over_700_lines():
    sizes = {str(p.relative_to(COMPONENTS)): len(p.read_text().splitlines()) for p in _module_files()}
    assert {name: n for name, n in sizes.items() if n > 700} == {}


def _touches_torch_distributed(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (node.value.id, node.attr) == ("torch", "distributed"):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.name for alias in node.names] + [getattr(node, "module", None) or ""]
            if any(name.startswith("torch.distributed") for name in names):
                lines.append(node.lineno)
    return lines


def test_only_distributed_py_touches_torch_distributed():
    offenders = {str(p.relative_to(COMPONENTS)): _touches_torch_distributed(p) for p in _module_files() if p.name != "distributed.py"}
    assert {name: lines for name, lines in offenders.items() if lines} == {}
    assert _touches_torch_distributed(COMPONENTS / "distributed.py")  # the check can see a use


def test_both_pretraining_losses_gather_through_one_helper():
    for loss in ("recipes/inpainting_contrast/loss.py", "recipes/self_distillation/loss.py"):
        text = (COMPONENTS / loss).read_text()
        assert "RankBatches(" in text, loss
        assert "_equal_checked" not in text and "def _gathering" not in text, loss


def test_no_import_cycles_between_modules():
    graph: dict[str, set[str]] = {}
    for path in _module_files():
        name = path.relative_to(COMPONENTS).parts[0].removesuffix(".py")
        graph.setdefault(name, set()).update(m for m in _relative_imports(path) if m and m != name)
    seen: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        if seen.get(node) == 1:
            raise AssertionError(f"import cycle: {' -> '.join(stack + [node])}")
        if seen.get(node) == 2:
            return
        seen[node] = 1
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, stack + [node])
        seen[node] = 2

    for node in sorted(graph):
        visit(node, [])
