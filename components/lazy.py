"""Public names that import their submodule on first use (PEP 562 module ``__getattr__``), for the package and its
sub-packages: ``import components`` costs nothing, ``components.SSLHead`` (as the bundle configs write it) imports its
submodule then, so ``python -m components --help`` pays for neither torch nor MONAI.

Importing this module imports neither torch nor MONAI.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, exports: Mapping[str, Sequence[str]], submodules: Iterable[str] = ()
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``(__all__, __getattr__, __dir__)`` for ``package`` (its ``__name__``, already being imported): each name of
    ``exports`` (submodule -> the public names it provides) is imported from its submodule on first access and kept in
    the package's namespace; each of ``submodules`` (and every submodule of ``exports``) is importable as an attribute.

    Example (a package's ``__init__.py``)::

        __all__, __getattr__, __dir__ = lazy_names(__name__, {"datasets": ("build_dataset",)})
    """
    module_of = {name: module for module, names in exports.items() for name in names}
    modules = frozenset(exports) | frozenset(submodules)
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name in module_of:
            value = getattr(importlib.import_module(f".{module_of[name]}", package), name)
        elif name in modules:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        namespace[name] = value  # later accesses skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(module_of) | modules)

    return sorted(module_of), __getattr__, __dir__
