"""What a data check found: one :class:`DataIssue` per problem (``ERROR <file> [<entry>]: <what is wrong>``),
collected in a :class:`DataReport` with a summary line, and the :class:`DataCheckError` that
:meth:`DataReport.raise_if_errors` raises."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import UserError

__all__ = ["DataCheckError", "DataIssue", "DataReport"]

ERROR, WARNING = "error", "warning"


@dataclass(frozen=True)
class DataIssue:
    """One problem: the file (or datalist) it concerns, the datalist entry (``"training[3] image"``) and what
    is wrong. ``severity`` is ``"error"`` (training would fail or silently learn garbage) or ``"warning"``."""

    path: str
    entry: str | None
    message: str
    severity: str = ERROR

    def format(self) -> str:
        """``ERROR <file> [<entry>]: <what is wrong>`` -- one line."""
        where = f" [{self.entry}]" if self.entry else ""
        return f"{self.severity.upper()} {self.path}{where}: {self.message}"


class DataCheckError(UserError, ValueError):
    """Raised by :meth:`DataReport.raise_if_errors`; the message holds a summary line and every error line,
    and ``report`` the full :class:`DataReport` (warnings included)."""

    def __init__(self, message: str, report: DataReport | None = None) -> None:
        super().__init__(message)
        self.report = report


@dataclass
class DataReport:
    """What a check found.

    Attributes:
        errors: problems that must be fixed before training.
        warnings: problems that training survives (e.g. padding of small volumes).
        checked: number of datalist entries checked.
        files: number of distinct files whose header was read.
        deep: whether voxel data was read too.
    """

    errors: list[DataIssue] = field(default_factory=list)
    warnings: list[DataIssue] = field(default_factory=list)
    checked: int = 0
    files: int = 0
    deep: bool = False

    @property
    def ok(self) -> bool:
        """True when there are no errors (warnings allowed)."""
        return not self.errors

    def add(self, path: str | os.PathLike, entry: str | None, message: str, severity: str = ERROR) -> None:
        """Records one issue under ``errors`` or ``warnings`` according to ``severity``."""
        if severity not in (ERROR, WARNING):
            raise ValueError(f"severity must be {ERROR!r} or {WARNING!r}, got {severity!r}.")
        issue = DataIssue(str(path), entry, message, severity)
        (self.errors if severity == ERROR else self.warnings).append(issue)

    def extend(self, other: DataReport) -> None:
        """Adds the issues and counts of ``other`` (e.g. the report of another list)."""
        self.errors.extend(other.errors)
        self.warnings.extend(other.warnings)
        self.checked += other.checked
        self.files += other.files
        self.deep = self.deep or other.deep

    def lines(self) -> list[str]:
        """One line per issue, errors first."""
        return [issue.format() for issue in [*self.errors, *self.warnings]]

    def summary(self) -> str:
        """One line: what was checked and how many errors / warnings were found."""
        mode = "headers and voxels" if self.deep else "headers only"
        verdict = "FAILED" if self.errors else "OK"
        return (
            f"data check {verdict} ({mode}): {self.checked} entries, {self.files} files; "
            f"{_plural(len(self.errors), 'error')}, {_plural(len(self.warnings), 'warning')}"
        )

    def format(self) -> str:
        """Every issue line, then the summary line."""
        return "\n".join([*self.lines(), self.summary()])

    def raise_if_errors(self, context: str | None = None) -> None:
        """Raises :class:`DataCheckError` listing all errors (after a summary line) when there are any.

        Args:
            context: prefix of the summary line saying who checked what, e.g. ``"rank 1 shard"``.
        """
        if not self.errors:
            return
        head = f"{context}: {self.summary()}" if context else self.summary()
        lines = [head, *(issue.format() for issue in self.errors)]
        if self.warnings:
            lines.append(f"(and {_plural(len(self.warnings), 'warning')}; see DataCheckError.report)")
        raise DataCheckError("\n".join(lines), report=self)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
