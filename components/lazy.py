"""Public names that import their module on first use (PEP 562 module ``__getattr__``), for the package and its
sub-packages: ``import components`` costs nothing, ``components.SSLHead`` (as the bundle configs write it) imports its
module then, so ``python -m components --help`` pays for neither torch nor MONAI.

Each public name is written once, in the ``__all__`` of the module that defines it. A package names only the modules
and sub-packages whose names it offers; which module holds a name is read from the modules' ``__all__`` in their
source, without running them, the first time the package is asked for a name it does not hold yet.

Importing this module imports neither torch nor MONAI.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["lazy_names", "module_names"]

# ``__all__ = [...]`` (or a tuple) of string literals at the start of a line, as every module of this package writes it
_ALL = re.compile(r"^__all__\s*=\s*[\[(]([^\])]*)[\])]", re.MULTILINE)
_NAME = re.compile(r"""["'](\w+)["']""")


def module_names(module: str) -> tuple[str, ...]:
    """The names in the ``__all__`` of ``module`` (its full name), read from its source without running it; a module
    without source (installed as bytecode only) is imported to read them.

    Raises:
        ImportError: no such module, or its source has no ``__all__ = [...]`` of names.
    """
    spec = importlib.util.find_spec(module)
    if spec is None:
        raise ImportError(f"no module named {module!r}", name=module)
    source = spec.loader.get_source(module) if spec.loader is not None and hasattr(spec.loader, "get_source") else None
    if source is None:
        return tuple(importlib.import_module(module).__all__)
    found = _ALL.search(source)
    if found is None:
        raise ImportError(f"{module} has no `__all__ = [...]` naming its public names", name=module)
    return tuple(_NAME.findall(found.group(1)))


def lazy_names(
    package: str, modules: Iterable[str] = (), packages: Iterable[str] = (), submodules: Iterable[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` (its ``__name__``, already being imported): the names in the
    ``__all__`` of each of ``modules`` and of each sub-package of ``packages``, each imported from its module on first
    access and kept in the package's namespace, and the package's ``__all__``, their sorted list. Every module and
    sub-package named, and each of ``submodules`` (one whose names the package does not offer), is importable as an
    attribute.

    Raises (from ``__getattr__``):
        AttributeError: a name none of them offers.
        ImportError: two of them offer the same name, or a name is also the name of a module.

    Example (a package's ``__init__.py``)::

        __getattr__, __dir__ = lazy_names(__name__, modules=("datalists", "datasets"), packages=("store",))
    """
    modules, packages = tuple(modules), tuple(packages)
    attributes = frozenset(modules) | frozenset(packages) | frozenset(submodules)
    namespace = sys.modules[package].__dict__
    index: dict[str, str] = {}  # public name -> the module or sub-package offering it, read on first need

    def names() -> dict[str, str]:
        if not index:
            offered = [(module, module_names(f"{package}.{module}")) for module in modules]
            offered += [(sub, importlib.import_module(f".{sub}", package).__all__) for sub in packages]
            found: dict[str, str] = {}
            for owner, owned in offered:
                for name in owned:
                    if name in found or name in attributes:
                        raise ImportError(f"{package}: {name!r} is offered by both {found.get(name, name)} and {owner}")
                    found[name] = owner
            index.update(found)
        return index

    def __getattr__(name: str) -> Any:
        if name in attributes:
            value = importlib.import_module(f".{name}", package)
        elif name == "__all__":
            value = sorted(names())
        elif not name.startswith("__") and name in names():
            value = getattr(importlib.import_module(f".{names()[name]}", package), name)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value  # later accesses skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names()) | attributes)

    return __getattr__, __dir__
