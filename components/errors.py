"""Errors told in one line: ``<bundle>: error: <Type>: <message>`` on stderr, once; the traceback on request.

This project's refusals (:class:`UserError`) say in their message the cause, the file or id, and the fix. Under
``python -m monai.bundle run`` such a message reached the user as one line inside a 53-220-line traceback ending in
MONAI's ``RuntimeError: Failed to evaluate ConfigExpression`` (MONAI wraps whatever a config expression or component
raises), and an error raised while an engine runs was printed three times: ignite's ``Engine`` logs it, MONAI's
``StatsHandler`` logs it with its traceback, then Python prints the traceback.

:func:`report_errors`, the first expression of every bundle's ``initialize``, installs for the rest of the process:

- ``sys.excepthook`` and ``threading.excepthook``: an uncaught exception whose chain (``__cause__``, else
  ``__context__``, as Python prints it) holds a :class:`UserError` is printed as ``<bundle>: error: <Type>:
  <message> (COMPONENTS_DEBUG=1 shows the traceback)``, further lines of the message indented, and the process exits
  with status 1, as after any uncaught exception. A rank > 0 of ``torchrun`` (``RANK``) prints nothing: rank 0 says
  it. With ``COMPONENTS_DEBUG=1`` every rank prints the traceback as Python does. Any other exception (a bug) keeps
  Python's traceback.
- a filter on the handlers of the root logger, of MONAI's ``StatsHandler`` logger and of logging's last resort that
  drops the ERROR records logged while a :class:`UserError` is being handled: ignite's and MONAI's reports of it
  before it propagates.

Importing this module imports neither torch nor MONAI (:func:`report_errors` imports MONAI's handlers).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from types import TracebackType

__all__ = ["DEBUG_VARIABLE", "ConfigError", "MissingFileError", "UserError", "error_lines", "report_errors", "user_error"]

#: the environment variable that prints the traceback of a :class:`UserError` instead of its one line
DEBUG_VARIABLE = "COMPONENTS_DEBUG"


class UserError(Exception):
    """Base of this project's refusals: the message alone (the cause, the file or id, the fix) is what the user needs,
    so :func:`report_errors` prints it in one line. Each concrete error also derives from the built-in type it always
    had (``ValueError``, ``FileNotFoundError``, ...), so ``except`` clauses written for that type still catch it."""


class ConfigError(UserError, ValueError):
    """A setting, an override, or an input named by one (a datalist, a checkpoint), that the run cannot use."""


class MissingFileError(UserError, FileNotFoundError):
    """A file the run needs is not there (a datalist, a trained ``model.pt``)."""


def user_error(exc: BaseException | None) -> UserError | None:
    """The :class:`UserError` in ``exc``'s chain as Python prints it (``__cause__``, else ``__context__`` unless
    suppressed): ``exc`` itself, or what MONAI's ``RuntimeError("Failed to evaluate ...")`` wraps; None if none."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, UserError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ if exc.__cause__ is not None or exc.__suppress_context__ else exc.__context__
    return None


class _Report:
    """What :func:`report_errors` was last given, and the hooks it replaced."""

    bundle = "components"
    excepthook = sys.excepthook
    thread_excepthook = threading.excepthook


def _rank() -> int:
    """This process's rank as ``torchrun`` sets it (``RANK``), 0 without it: read from the environment, since an error
    may come before the process group exists."""
    return int(os.environ.get("RANK", "0"))


def _debug() -> bool:
    return os.environ.get(DEBUG_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def error_lines(prefix: str, err: BaseException, hint: str) -> list[str]:
    """``<prefix>: error: <Type>: <first line> (<hint>)``, then the message's further lines indented (one line per
    error when a message lists several)."""
    head, *rest = str(err).splitlines() or ["(no message)"]
    return [f"{prefix}: error: {type(err).__name__}: {head} ({hint})", *(f"  {line}" for line in rest)]


def _report(exc: BaseException) -> bool:
    """Tells the user about ``exc`` in one line if it holds a :class:`UserError`; False to leave it to Python."""
    err = user_error(exc)
    if err is None or _debug():
        return False
    if _rank() == 0:
        print("\n".join(error_lines(_Report.bundle, err, f"{DEBUG_VARIABLE}=1 shows the traceback")), file=sys.stderr,
              flush=True)  # fmt: skip
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


def report_errors(bundle: str) -> None:
    """Makes an uncaught :class:`UserError` one line on stderr naming ``bundle`` (see the module's docstring); call
    it before anything else of a run. A second call (another workflow in the same process) only renames ``bundle``.

    Example (first expression of a bundle's ``initialize``)::

        "$components.report_errors('swin_unetr_btcv_finetune')"
    """
    _Report.bundle = str(bundle)
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
