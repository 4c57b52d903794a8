"""The SSL bundle's inference input: the cutout boxes of pretraining on one volume, or none, as ``corrupt`` says.

Kept apart from :mod:`.views`, which imports only torch and the standard library (``benchmarks/
views_against_revision.py`` loads it as a single file).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...config.values import as_bool
from .views import aug_rand

__all__ = ["input_corruption"]


def input_corruption(enabled: bool | str, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the SSL bundle's inference does to a ``(C, H, W, D)`` input before reconstructing it: with ``enabled``
    (``corrupt``, command-line words accepted) :func:`~.views.aug_rand`'s boxes drawn from ``seed``, as in
    pretraining; without it the input itself. A function for MONAI's ``Lambdad``.

    Raises:
        ValueError: ``enabled`` is not a clear yes / no.
    """
    if not as_bool(enabled, "corrupt"):
        return lambda x: x
    return lambda x: aug_rand(x[None], generator=torch.Generator().manual_seed(int(seed)))[0]
