"""The small values of a stored item as JSON, read back as the same Python types: the foreground box and compact
geometry of :class:`~components.data.CompactCropForegroundd`, ``LoadImaged``'s ``image_meta_dict``, a
MetaTensor's metadata.

JSON keeps ``None``, ``bool``, ``int``, ``float`` (NaN and infinities included, as Python's ``json`` writes them),
``str``, lists and dicts with string keys. The rest is written as a one-key object naming its type:
``{"__tuple__": [...]}``, ``{"__ndarray__": [...], "dtype": "<i8", "shape": [3]}`` (numpy arrays; ``"shape": null``
for a numpy scalar),
``{"__tensor__": [...], "dtype": "float64", "shape": [4, 4]}``. String enums (MONAI's ``MetaKeys``, ``SpaceKeys``)
are written as their string and read back as ``str``, which compares equal to them. Anything else is refused
naming where it is, before any volume is written.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["decode_value", "encode_value"]

_TAGS = ("__tuple__", "__ndarray__", "__tensor__")


def encode_value(value: Any, where: str = "value") -> Any:
    """``value`` as JSON-able data that :func:`decode_value` turns back into an equal value of the same type.

    Raises:
        TypeError: a value of another type, or a dict key that is not a string, naming ``where`` (e.g.
            ``"image_meta_dict['space']"``).

    Example:
        >>> encode_value((1, np.arange(2)))
        {'__tuple__': [1, {'__ndarray__': [0, 1], 'dtype': '<i8', 'shape': [2]}]}
    """
    if isinstance(value, (np.ndarray, np.generic)):  # first: np.float64 is also a float
        if value.dtype.kind not in "biuf":
            raise TypeError(f"{where}: a numpy {value.dtype} value cannot be stored (only bool, int, float).")
        shape = list(value.shape) if isinstance(value, np.ndarray) else None  # None: a numpy scalar
        return {"__ndarray__": np.asarray(value).tolist(), "dtype": value.dtype.str, "shape": shape}
    if value is None or isinstance(value, (bool, int, float)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, str):
        return str.__str__(value)  # a str enum's own text (its str() may be "Class.MEMBER")
    if isinstance(value, torch.Tensor):
        plain = value.as_tensor() if hasattr(value, "as_tensor") else value
        if plain.is_complex():
            raise TypeError(f"{where}: a complex tensor cannot be stored.")
        dtype = str(plain.dtype).removeprefix("torch.")
        return {"__tensor__": plain.detach().cpu().tolist(), "dtype": dtype, "shape": list(plain.shape)}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [encode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{where}: key {bad[0]!r} is not a string; only string keys can be stored.")
        reserved = [k for k in _TAGS if k in value]
        if reserved:
            raise TypeError(f"{where}: a dict with the key {reserved[0]!r} cannot be stored (it marks a type).")
        return {str(k): encode_value(v, f"{where}[{str(k)!r}]") for k, v in value.items()}
    raise TypeError(f"{where}: a {type(value).__name__} cannot be stored (JSON types, tuples, numpy / torch arrays).")


def decode_value(data: Any) -> Any:
    """The value that :func:`encode_value` wrote as ``data``."""
    if isinstance(data, list):
        return [decode_value(v) for v in data]
    if not isinstance(data, dict):
        return data
    if "__tuple__" in data:
        return tuple(decode_value(v) for v in data["__tuple__"])
    if "__ndarray__" in data:
        array = np.array(data["__ndarray__"], dtype=np.dtype(data["dtype"]))
        return array[()] if data["shape"] is None else array.reshape(data["shape"])
    if "__tensor__" in data:
        dtype = getattr(torch, data["dtype"])
        return torch.tensor(data["__tensor__"], dtype=dtype).reshape(data["shape"])
    return {k: decode_value(v) for k, v in data.items()}
