"""What a bundle setting accepts, in words a one-line error can quote: the kinds of :mod:`components.config.types`.

A command line passes a setting as python-fire parses it (``--max_epochs 2`` an int, ``--speed#amp false`` the string
"false", ``--pretrained_path null`` the string "null": ``--x None`` leaves the config's value, so "null" is how a
command line says None). Each kind accepts what the code that reads the setting accepts, and says so in
:attr:`Kind.accepted`, e.g. ``an integer >= 1``.

Importing this module imports neither torch nor MONAI.

Example:
    >>> Integer(1).accepts(1.5), Integer(1).accepted
    (False, 'an integer >= 1')
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping as _Mapping
from dataclasses import dataclass
from typing import Any

from .values import _FALSE, _NONE, _TRUE

__all__ = ["Because", "Dict", "Either", "Flag", "Integer", "Kind", "ListOf", "Null", "Number", "OneOf", "Text", "or_null"]


class Kind(ABC):
    """What one setting accepts. Subclasses say it in :attr:`accepted` and test it in :meth:`accepts`."""

    @property
    @abstractmethod
    def accepted(self) -> str:
        """What the setting accepts, as a refusal names it (e.g. "an integer >= 1")."""

    @abstractmethod
    def accepts(self, value: Any) -> bool:
        """Whether ``value`` is one the setting accepts."""

    def because(self, why: str) -> Because:
        """This kind, its message saying why in parentheses."""
        return Because(self, why)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class Flag(Kind):
    """A yes/no setting read with :func:`components.as_bool`: a bool, 0 or 1, or one of its words."""

    @property
    def accepted(self) -> str:
        return "true or false"

    def accepts(self, value: Any) -> bool:
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return True
        return isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE


@dataclass(frozen=True)
class Null(Kind):
    """None, or what a command line passes for it ("null", "none", ""), as :func:`components.optional_path` reads."""

    @property
    def accepted(self) -> str:
        return "null"

    def accepts(self, value: Any) -> bool:
        return value is None or (isinstance(value, str) and value.strip().lower() in _NONE)


@dataclass(frozen=True)
class Integer(Kind):
    """An int (not a bool, not 2.0) within ``[low, high]``, a multiple of ``multiple_of`` when given."""

    low: int | None = None
    high: int | None = None
    multiple_of: int | None = None

    @property
    def accepted(self) -> str:
        if self.low is not None and self.low == self.high:
            return f"the integer {self.low}"
        text = "an integer"
        if self.multiple_of:
            text = f"a multiple of {self.multiple_of}"
        if self.low is not None and self.high is not None:
            return f"{text} from {self.low} to {self.high}"
        if self.low is not None:
            return f"{text} >= {self.low}"
        return f"{text} <= {self.high}" if self.high is not None else text

    def accepts(self, value: Any) -> bool:
        if not isinstance(value, int) or isinstance(value, bool):
            return False
        in_range = (self.low is None or value >= self.low) and (self.high is None or value <= self.high)
        return in_range and (not self.multiple_of or value % self.multiple_of == 0)


@dataclass(frozen=True)
class Number(Kind):
    """A finite int or float (not a bool) within ``[low, high]``, and above ``above`` / below ``below`` when given."""

    low: float | None = None
    high: float | None = None
    above: float | None = None
    below: float | None = None

    @property
    def accepted(self) -> str:
        if self.low is not None and self.high is not None and self.above is None and self.below is None:
            return f"a number from {self.low} to {self.high}"
        bounds = [f"{sign} {bound}" for sign, bound in ((">=", self.low), (">", self.above), ("<=", self.high),
                                                        ("<", self.below)) if bound is not None]  # fmt: skip
        return " ".join(["a number", " and ".join(bounds)]).strip()

    def accepts(self, value: Any) -> bool:
        if not _number(value):
            return False
        return ((self.low is None or value >= self.low) and (self.above is None or value > self.above)
                and (self.high is None or value <= self.high) and (self.below is None or value < self.below))  # fmt: skip


@dataclass(frozen=True)
class OneOf(Kind):
    """One of ``choices`` (strings compared exactly, as the code that reads them does)."""

    choices: tuple[Any, ...]

    @property
    def accepted(self) -> str:
        return repr(self.choices[0]) if len(self.choices) == 1 else "one of " + ", ".join(map(repr, self.choices))

    def accepts(self, value: Any) -> bool:
        return isinstance(value, (str, int, float)) and not isinstance(value, bool) and value in self.choices


@dataclass(frozen=True)
class Text(Kind):
    """A string: a path, a device, a name. ``what`` says which in the message."""

    what: str = "a string"

    @property
    def accepted(self) -> str:
        return self.what

    def accepts(self, value: Any) -> bool:
        return isinstance(value, str)


@dataclass(frozen=True)
class ListOf(Kind):
    """A list (or tuple) of ``length`` items (any number, at least one, when None), each accepted by ``item``."""

    item: Kind
    length: int | None = None

    @property
    def accepted(self) -> str:
        count = f"{self.length} values" if self.length else "one or more values"
        return f"a list of {count}, each {self.item.accepted}"

    def accepts(self, value: Any) -> bool:
        if not isinstance(value, (list, tuple)) or not value or (self.length and len(value) != self.length):
            return False
        return all(self.item.accepts(v) for v in value)


@dataclass(frozen=True)
class Dict(Kind):
    """A dict (keyword arguments passed on, e.g. to ``torch.compile``)."""

    @property
    def accepted(self) -> str:
        return "a dict"

    def accepts(self, value: Any) -> bool:
        return isinstance(value, _Mapping)


@dataclass(frozen=True)
class Either(Kind):
    """What any of ``kinds`` accepts."""

    kinds: tuple[Kind, ...]

    @property
    def accepted(self) -> str:
        return " or ".join(k.accepted for k in self.kinds)

    def accepts(self, value: Any) -> bool:
        return any(k.accepts(value) for k in self.kinds)


@dataclass(frozen=True)
class Because(Kind):
    """What ``kind`` accepts, the message adding ``why``."""

    kind: Kind
    why: str

    @property
    def accepted(self) -> str:
        return f"{self.kind.accepted} ({self.why})"

    def accepts(self, value: Any) -> bool:
        return self.kind.accepts(value)


def or_null(kind: Kind) -> Either:
    """Null (:class:`Null`) or ``kind``: for a setting whose reader takes None for "not set"."""
    return Either((Null(), kind))
