"""Errors told in one line: ``<bundle>: error: <Type>: <message>`` on stderr, once; the traceback with ``--debug``.

This project's refusals (:class:`UserError`) say in their message the cause, the file or id, and the fix. Under
``python -m monai.bundle run`` such a message reached the user as one line inside a 53-220-line traceback ending in
MONAI's ``RuntimeError: Failed to evaluate ConfigExpression`` (MONAI wraps whatever a config expression or component
raises), and an error raised while an engine runs was printed three times: ignite's ``Engine`` logs it, MONAI's
``StatsHandler`` logs it with its traceback, then Python prints the traceback.

:func:`report_errors`, the first step of every bundle run (:func:`components.start`; inference.json's ``initialize``),
installs for the rest of the process:

- ``sys.excepthook`` and ``threading.excepthook``: an uncaught exception whose chain (``__cause__``, else
  ``__context__``, as Python prints it) holds a :class:`UserError` is printed as ``<bundle>: error: <Type>:
  <message> (--debug shows the traceback)``, further lines of the message indented, and the process exits with
  status 1, as after any uncaught exception. With ``debug`` (the bundles' ``--debug`` id, as ``python -m components
  ... --debug``) Python prints the traceback instead, on every rank. Any other exception (a bug) keeps Python's
  traceback.
- a filter on the handlers of the root logger, of MONAI's ``StatsHandler`` logger and of logging's last resort that
  drops the ERROR records logged while a :class:`UserError` is being handled: ignite's and MONAI's reports of it
  before it propagates.

Under ``torchrun`` each distinct error is printed once, by the first rank that reaches it, whichever rank that is:
ranks count the errors they are about to print in torchrun's own key-value store (the one its agent serves at
``MASTER_ADDR:MASTER_PORT``: :func:`components.distributed.agent_store`), keyed by the error's type and first line,
and the line says which rank printed it (``(from rank 1 of 2; ...)``). A rank that stays quiet (another printed the same error,
or the error names other ranks as the ones to report it: :attr:`UserError.reporting_ranks`) waits, a few seconds at
most, until some rank has printed before it exits, since torchrun stops the other ranks as soon as one exits. An
error that only a rank > 0 meets (a bad volume in its own shard) is so printed by that rank. Any other exception of a
rank after a rank printed an error (gloo's "Connection closed by peer" in a collective that waited for the rank that
exited) is one line too, ``<bundle>: rank 0 of 2 stopped after rank 1's error: ...``, rather than a traceback. Without
torchrun's store (another launcher) every rank prints its own errors.

Importing this module imports neither torch nor MONAI (:func:`report_errors` imports MONAI's handlers; a rank of a
``torchrun`` run imports :mod:`components.distributed` when it reports).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

__all__ = ["ConfigError", "MissingFileError", "UserError", "report_errors"]

#: what the one-line report says to get the traceback, for ``python -m monai.bundle run`` and ``python -m components``
DEBUG_HINT = "--debug shows the traceback"
#: the longest a quiet rank waits for another rank to print an error before it exits (seconds)
QUIET_RANK_WAIT_S = 10.0


class UserError(Exception):
    """Base of this project's refusals: the message alone (the cause, the file or id, the fix) is what the user needs,
    so :func:`report_errors` prints it in one line. Each concrete error also derives from the built-in type it always
    had (``ValueError``, ``FileNotFoundError``, ...), so ``except`` clauses written for that type still catch it.

    Attributes:
        reporting_ranks: under ``torchrun``, the ranks whose own report of this error the user needs (e.g. the ranks
            whose loss was not finite, which name their own batch's files), when every rank raises it; the other ranks
            stay quiet. None (the default): any rank that raises it may report it.
    """

    reporting_ranks: tuple[int, ...] | None = None


class ConfigError(UserError, ValueError):
    """A setting, an override, or an input named by one (a datalist, a checkpoint), that the run cannot use."""


class MissingFileError(UserError, FileNotFoundError):
    """A file the run needs is not there (a datalist, a trained ``model.pt``)."""


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc``, then what it was raised from as Python prints it: ``__cause__``, else ``__context__`` unless
    suppressed."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        yield exc
        seen.add(id(exc))
        exc = exc.__cause__ if exc.__cause__ is not None or exc.__suppress_context__ else exc.__context__


def user_error(exc: BaseException | None) -> UserError | None:
    """The :class:`UserError` in ``exc``'s chain as Python prints it (``__cause__``, else ``__context__`` unless
    suppressed): ``exc`` itself, or what MONAI's ``RuntimeError("Failed to evaluate ...")`` wraps; None if none."""
    return next((e for e in _chain(exc) if isinstance(e, UserError)), None)


class _Report:
    """What :func:`report_errors` was last given, and the hooks it replaced."""

    bundle = "components"
    debug = False
    excepthook = sys.excepthook
    thread_excepthook = threading.excepthook


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks as ``torchrun`` sets them (``RANK``, ``WORLD_SIZE``); (0, 1)
    without: read from the environment, since an error may come before the process group exists."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _flag(value: Any) -> bool:
    """``debug`` as a command line passes it: ``--debug`` gives True, ``--debug true`` the string "true"."""
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def error_lines(prefix: str, err: BaseException, hint: str) -> list[str]:
    """``<prefix>: error: <Type>: <first line> (<hint>)``, then the message's further lines indented (one line per
    error when a message lists several)."""
    head, *rest = str(err).splitlines() or ["(no message)"]
    return [f"{prefix}: error: {type(err).__name__}: {head} ({hint})", *(f"  {line}" for line in rest)]


class _RankReports:
    """The errors the ranks of a ``torchrun`` run have printed, counted in torchrun's store (see the module's
    docstring; :func:`components.distributed.agent_store`); unusable (:attr:`store` None) without it."""

    def __init__(self) -> None:
        from .distributed import agent_store  # imports torch: only when a rank of a torchrun run reports

        self.store = agent_store("errors", QUIET_RANK_WAIT_S)

    def first(self, err: UserError) -> bool:
        """Whether this rank is the first to reach ``err`` (its type and first line)."""
        head = (str(err).splitlines() or [""])[0]
        key = hashlib.sha256(f"{type(err).__name__}: {head}".encode()).hexdigest()
        try:
            return self.store is None or self.store.add(key, 1) == 1
        except RuntimeError:  # the store went away: print rather than stay quiet
            return True

    def printed(self, rank: int) -> None:
        """Tells the other ranks that ``rank`` has put an error on the user's screen."""
        try:
            if self.store is not None:
                self.store.set("printed", str(rank))
        except RuntimeError:  # the store went away: the quiet ranks stop waiting at their timeout
            pass

    def printed_by(self) -> str | None:
        """The rank that has printed an error, if one has; asks without waiting."""
        try:
            if self.store is not None and self.store.check(["printed"]):
                return self.store.get("printed").decode()
        except RuntimeError:  # the store went away: leave the exception to Python
            pass
        return None

    def wait_until_printed(self) -> None:
        """Waits (at most :data:`QUIET_RANK_WAIT_S`) until a rank has printed an error: torchrun stops every rank as
        soon as one exits, maybe before the rank that prints has reached its report."""
        try:
            if self.store is not None:
                self.store.wait(["printed"])
        except RuntimeError:  # waited long enough (torch's DistStoreError is a RuntimeError)
            pass


def _print(lines: list[str]) -> None:
    """Prints ``lines`` on stderr; under torchrun from a line of their own, since the ranks share the terminal and
    another rank's progress bar may have left the cursor mid-line."""
    _, world = _rank_and_world()
    print(("\n" if world > 1 else "") + "\n".join(lines), file=sys.stderr, flush=True)


def _report(exc: BaseException) -> bool:
    """Tells the user about ``exc`` in one line if it holds a :class:`UserError`, or, under torchrun, if another rank
    has printed an error before (a rank whose collective fails because that rank exited); False to leave it to
    Python."""
    if _Report.debug:
        return False
    err = user_error(exc)
    rank, world = _rank_and_world()
    if world <= 1:
        if err is not None:
            _print(error_lines(_Report.bundle, err, DEBUG_HINT))
        return err is not None
    reports = _RankReports()
    if err is None:
        by = reports.printed_by()
        if by is None:
            return False
        *_, cause = _chain(exc)  # what MONAI's "Failed to instantiate" wraps: gloo's closed connection
        head = (str(cause).splitlines() or ["(no message)"])[0]
        _print([f"{_Report.bundle}: rank {rank} of {world} stopped after rank {by}'s error: {type(cause).__name__}: "
                f"{head} ({DEBUG_HINT})"])  # fmt: skip
    elif (not err.reporting_ranks or rank in err.reporting_ranks) and reports.first(err):
        _print(error_lines(_Report.bundle, err, f"from rank {rank} of {world}; {DEBUG_HINT}"))
        reports.printed(rank)
    else:
        reports.wait_until_printed()
    return True


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if not _report(exc):
        _Report.excepthook(exc_type, exc, tb)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None or not _report(args.exc_value):
        _Report.thread_excepthook(args)


class _DuplicateReports(logging.Filter):
    """Drops ERROR records logged while a :class:`UserError` is being handled (ignite's "Engine run is terminating
    due to exception", MONAI's ``StatsHandler`` "Exception: ..." with its traceback): the except hook reports it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        exc = record.exc_info[1] if record.exc_info else sys.exc_info()[1]
        return user_error(exc) is None


def report_errors(bundle: str, debug: bool | int | str = False) -> None:
    """Makes an uncaught :class:`UserError` one line on stderr naming ``bundle`` (see the module's docstring); call
    it before anything else of a run. A second call (another workflow in the same process) only sets ``bundle`` and
    ``debug`` anew.

    Args:
        bundle: the name the line starts with.
        debug: print Python's traceback instead (every rank): the bundles pass their ``debug`` id, which
            ``python -m monai.bundle run ... --debug`` (or ``--debug true``) sets.

    Example (first expression of an inference.json's ``initialize``)::

        "$components.report_errors('swin_unetr_btcv_finetune', @debug)"
    """
    _Report.bundle, _Report.debug = str(bundle), _flag(debug)
    if sys.excepthook is not _excepthook:
        _Report.excepthook, sys.excepthook = sys.excepthook, _excepthook
    if threading.excepthook is not _thread_excepthook:
        _Report.thread_excepthook, threading.excepthook = threading.excepthook, _thread_excepthook
    for handler in _handlers():
        if not any(isinstance(f, _DuplicateReports) for f in handler.filters):
            handler.addFilter(_DuplicateReports())


def _handlers() -> list[logging.Handler]:
    """The handlers that an engine's reports of an exception reach: the root logger's (ignite's engine loggers
    propagate there), logging's last resort, and those of MONAI's ``StatsHandler`` logger, which has its own and
    does not propagate (made here as ``StatsHandler`` makes it, from the default ``name`` of its signature)."""
    import inspect

    from monai.apps import get_logger
    from monai.handlers import StatsHandler

    stats = get_logger(inspect.signature(StatsHandler).parameters["name"].default)
    return [*logging.getLogger().handlers, *stats.handlers, *([logging.lastResort] if logging.lastResort else [])]
