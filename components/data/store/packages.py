"""The package versions a store's values depend on, part of its fingerprint: a store written under other versions
is refused, naming the packages that changed, rather than read as if nothing had.

Which packages, and why:

- ``monai``: the deterministic transforms are MONAI's (orientation, resampling, intensity scaling, foreground box);
  a release can change their defaults or their arithmetic, and with them the stored values or shapes;
- ``nibabel``: it decodes the source files (scaling slope and intercept, the affine the orientation follows);
- ``numpy`` and ``torch``: the arithmetic of those transforms and of the compact crop (dtype promotion, the
  resampling kernels). A build's local label (``+cpu``, ``+cu128``) is left out: the preprocessing runs on the CPU
  whatever the build, so a store written on CPU nodes serves GPU nodes.

Not ``blosc2``: its compression is lossless, so any version reads back the values written, and every byte of a
stored file is checked against its CRC-32 before blosc2 parses it (:mod:`~components.data.store.format`): a frame it
cannot read is refused at its first read (``StoreReadError``), never misread.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

__all__ = ["FINGERPRINT_PACKAGES", "package_versions", "version_changes"]

#: the packages whose versions are part of a store's fingerprint (see the module docstring)
FINGERPRINT_PACKAGES: tuple[str, ...] = ("monai", "nibabel", "numpy", "torch")


def _version(package: str) -> str:
    """``package.__version__`` without a local build label (``2.13.0+cpu`` -> ``2.13.0``)."""
    return str(importlib.import_module(package).__version__).split("+", 1)[0]


def package_versions(packages: tuple[str, ...] = FINGERPRINT_PACKAGES) -> dict[str, str]:
    """``{package: version}`` of ``packages`` as installed here, e.g. ``{"monai": "1.6.1", ..., "torch": "2.13.0"}``."""
    return {package: _version(package) for package in packages}


def version_changes(recorded: Mapping[str, str] | None) -> str:
    """The packages whose version differs from ``recorded`` (a store's), e.g. ``"monai 1.5.0, now 1.6.1"``; "" when
    none does or nothing was recorded."""
    if not recorded:
        return ""
    now = package_versions(tuple(recorded))
    return "; ".join(f"{name} {recorded[name]}, now {now[name]}" for name in recorded if recorded[name] != now[name])
