"""MONAI's supervised trainer and evaluator with a bundle's speed settings as a command line gives them.

``python -m monai.bundle run ... --speed#amp false`` passes the string "false", which MONAI's engines would take as
true; their ``amp`` autocasts on CUDA only (``torch.autocast("cuda")``), in float16 unless told otherwise. The
bundles build these two instead, so their configs hand over ``speed#amp``, ``speed#amp_dtype`` and ``speed#compile``
as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from monai.engines import SupervisedEvaluator, SupervisedTrainer

from ..config.values import as_bool, is_null
from .recipe import AMP_DTYPES

__all__ = ["BundleEvaluator", "BundleTrainer", "amp_kwargs", "cuda_amp"]


def cuda_amp(amp: bool | str, device: str | torch.device) -> bool:
    """Whether MONAI's engines autocast: the ``amp`` flag (command-line words accepted) on a CUDA ``device``."""
    return as_bool(amp, "amp") and torch.device(device).type == "cuda"


def amp_kwargs(amp_dtype: str | None) -> dict | None:
    """MONAI's ``amp_kwargs`` for an ``amp_dtype`` setting: ``{"dtype": ...}``, or None for null (autocast's own
    float16).

    Raises:
        ValueError: a name outside :data:`~components.training.recipe.AMP_DTYPES`.
    """
    if is_null(amp_dtype):
        return None
    if amp_dtype not in AMP_DTYPES:
        raise ValueError(f"amp_dtype must be one of {sorted(AMP_DTYPES)} or null (float16), got {amp_dtype!r}.")
    return {"dtype": AMP_DTYPES[amp_dtype]}


class BundleTrainer(SupervisedTrainer):
    """``monai.engines.SupervisedTrainer`` with ``amp`` (on CUDA only, :func:`cuda_amp`) and ``compile`` read as flags
    and ``amp_dtype`` as a name (:func:`amp_kwargs`).

    Args:
        device, amp, compile: as ``SupervisedTrainer``, the flags as a command line gives them.
        amp_dtype: "bfloat16" / "float16" (or "bf16" / "fp16"); null: autocast's float16.
        kwargs: the other arguments of ``SupervisedTrainer``.
    """

    def __init__(self, device: str | torch.device, amp: bool | str = False, amp_dtype: str | None = None,
                 compile: bool | str = False, **kwargs: Any) -> None:  # fmt: skip
        super().__init__(device=device, amp=cuda_amp(amp, device), amp_kwargs=amp_kwargs(amp_dtype),
                         compile=as_bool(compile, "compile"), **kwargs)  # fmt: skip


class BundleEvaluator(SupervisedEvaluator):
    """``monai.engines.SupervisedEvaluator`` with ``amp`` read as a flag and on CUDA only (:func:`cuda_amp`) and
    ``amp_dtype`` as a name (:func:`amp_kwargs`).

    Args:
        device, amp, amp_dtype: as :class:`BundleTrainer`.
        kwargs: the other arguments of ``SupervisedEvaluator``.
    """

    def __init__(self, device: str | torch.device, amp: bool | str = False, amp_dtype: str | None = None,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(device=device, amp=cuda_amp(amp, device), amp_kwargs=amp_kwargs(amp_dtype), **kwargs)
