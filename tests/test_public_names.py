"""The public names (components.lazy): each written once, in its module's ``__all__``; the packages name only modules,
find a name from the modules' sources without importing them, and offer every name the bundle configs use."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from components.lazy import module_names

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ROOT / "components"


def _packages() -> list[Path]:
    return sorted(COMPONENTS.rglob("__init__.py"))


def _dotted(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def test_no_package_lists_a_public_name():
    """A package's __init__ names modules, never public names: no __all__, no table of names, no re-export import."""
    for init in _packages():
        tree = ast.parse(init.read_text())
        assigned = {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
        assert not assigned & {"__all__", "_EXPORTS"}, init
        imported = [a.name for node in tree.body if isinstance(node, ast.ImportFrom) and node.level
                    for a in node.names if a.name != "lazy_names"]  # fmt: skip
        assert imported == [], (init, imported)


def test_each_name_is_written_once_and_read_back_from_the_source():
    """Every module a package offers has an __all__ that the source reader sees exactly as Python does, and no name is
    offered by two modules of the whole package (components offers them all)."""
    import components

    seen: dict[str, str] = {}
    for init in _packages():
        package = importlib.import_module(_dotted(init))
        for name in package.__all__:
            assert name in dir(package)
        for path in sorted(init.parent.glob("*.py")):
            if path.name in ("__init__.py", "__main__.py"):
                continue
            module = importlib.import_module(f"{_dotted(init)}.{path.stem}")
            if "__all__" not in module.__dict__:
                continue
            assert list(module_names(module.__name__)) == list(module.__all__), module.__name__
            for name in module.__all__:
                assert name not in seen, f"{name}: {seen.get(name)} and {module.__name__}"
                seen[name] = module.__name__
    assert {name for name in seen if seen[name].startswith("components.demo.")}.isdisjoint(components.__all__)
    assert set(components.__all__) <= set(seen)


def test_every_name_the_bundle_configs_use_resolves():
    """``$components.X`` and ``components.X.Y`` in any bundle config: each is an attribute of the package."""
    import components

    used = set()
    for config in sorted(ROOT.glob("bundles/*/configs/*.json")):
        used |= set(re.findall(r"\bcomponents((?:\.\w+)+)", json.dumps(json.load(config.open()))))
    assert len(used) > 50
    for dotted in sorted(used):
        value = components
        for part in dotted.strip(".").split("."):
            value = getattr(value, part)  # AttributeError names the one that does not resolve
    assert components.get_rank.__module__.startswith("ignite.distributed")


def test_the_names_cost_no_import_until_one_is_used():
    """``import components`` and its list of names import neither torch nor any module that offers a name; the first
    name used imports its own module (the data check: without MONAI)."""
    code = ("import sys, components; names = components.__all__; dir(components.data)\n"
            "modules = lambda: sorted(m for m, v in sys.modules.items() if not hasattr(v, '__path__'))\n"
            "print(len(names), [m for m in modules() if m.startswith(('torch', 'monai', 'components.data.'))])\n"
            "components.check_datalist; print([m for m in modules() if m.startswith(('monai', 'components.data.'))])")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    listed, after = out.splitlines()
    count, imported = listed.split(" ", 1)
    assert int(count) > 150 and imported == "[]"
    assert "'components.data.check'" in after and "monai" not in after


@pytest.fixture()
def fake_package(tmp_path, monkeypatch):
    """A package ``fakepkg`` with modules a and b, whose ``__init__`` offers both (a fresh import per test)."""
    root = tmp_path / "fakepkg"
    root.mkdir()
    (root / "__init__.py").write_text(
        "from components.lazy import lazy_names\n__getattr__, __dir__ = lazy_names(__name__, modules=('a', 'b'))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield root
    for name in [m for m in sys.modules if m == "fakepkg" or m.startswith("fakepkg.")]:
        del sys.modules[name]


def test_a_name_is_imported_from_its_module_on_first_use(fake_package):
    (fake_package / "a.py").write_text('__all__ = ["one", "ONE"]  # a comment\none, ONE = 1, "I"\n')
    (fake_package / "b.py").write_text('X = 0\n__all__ = (\n    "two",\n)\ntwo = 2\n')
    import fakepkg

    assert "fakepkg.a" not in sys.modules and fakepkg.__all__ == ["ONE", "one", "two"]
    assert "fakepkg.a" not in sys.modules  # the list came from the sources
    assert (fakepkg.two, "fakepkg.a" in sys.modules) == (2, False)
    assert fakepkg.ONE == "I" and "fakepkg.a" in sys.modules
    with pytest.raises(AttributeError, match="module 'fakepkg' has no attribute 'X'"):
        fakepkg.X  # noqa: B018  (public in b's namespace but not in its __all__)


def test_a_name_offered_twice_or_a_module_without_names_is_refused(fake_package):
    (fake_package / "a.py").write_text('__all__ = ["one"]\none = 1\n')
    (fake_package / "b.py").write_text('__all__ = ["one"]\none = 2\n')
    import fakepkg

    with pytest.raises(ImportError, match="'one' is offered by both a and b"):
        fakepkg.one  # noqa: B018
    (fake_package / "b.py").write_text("two = 2\n")
    with pytest.raises(ImportError, match=r"fakepkg\.b has no `__all__"):
        module_names("fakepkg.b")

