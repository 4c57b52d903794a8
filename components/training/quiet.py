"""Quiet runs: known-harmless third-party warnings and log lines are filtered where they arise, narrowly (by
message, category and module), and engine progress comes from rank 0 alone.

Every filter here names one message that a run of these bundles prints on every start (or per rank, per volume)
although nothing is wrong; a warning that could point at a real problem is never filtered. Installed once when
``components`` is imported (the bundle configs import it first), so it acts in every process of a run.
"""

from __future__ import annotations

import logging
import re
import warnings

from ..config.values import as_bool


__all__ = ["install_filters", "log_from_rank_zero"]

# MONAI 1.5 and 1.6 warn at every Orientation(d) built without `labels` that the default became None ("use the space
# of the meta-tensor"). The bundles load NIfTI with LoadImaged, whose images are in RAS space, for which the new
# default and the old explicit labels ((L, R), (P, A), (I, S)) give the same orientation: nothing changes, once per
# rank.
_ORIENTATION = r"monai\.transforms\.spatial\.(dictionary|array) Orientationd?\.__init__:labels: Current default value"

# ignite logs "Engine run resuming from iteration 0, epoch E until N epochs" for every fresh run of a MONAI engine
# (MONAI sets the engine state at construction, so ignite takes the first run for a resume) and for every
# validation (the evaluator's epoch is set to the trainer's): it announces a resume that did not happen. The line is
# the run's start line, so it is reworded rather than dropped; a real resume (iteration > 0) keeps ignite's words.
_FRESH_RUN = re.compile(r"Engine run resuming from iteration 0, epoch \d+ until ")
_ENGINE_LOGGERS = "ignite.engine.engine."


class _FreshRunLine(logging.Filter):
    """Rewords ignite's "resuming from iteration 0" of a fresh run to "starting"."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith(_ENGINE_LOGGERS) and isinstance(record.msg, str) and _FRESH_RUN.match(record.msg):
            record.msg = _FRESH_RUN.sub("Engine run starting, until ", record.msg)
        return True


class _RankZeroEngineProgress(logging.Filter):
    """Drops the INFO lines of ignite / MONAI engines (epoch and run progress, best metrics) on ranks > 0: every
    rank would print the same progress."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or not record.name.startswith(_ENGINE_LOGGERS) or get_rank() == 0


_INSTALLED: list[bool] = []


def get_rank() -> int:
    """This process's rank (``ignite.distributed.get_rank``), imported on first use: ``import components`` installs
    these filters and must not import torch."""
    import ignite.distributed as idist

    return idist.get_rank()


def install_filters() -> None:
    """Installs the narrow warning filters and the fresh-run log filter, once per process."""
    if _INSTALLED:
        return
    warnings.filterwarnings("ignore", message=_ORIENTATION, category=FutureWarning)
    _add_to_handlers(_FreshRunLine())
    _INSTALLED.append(True)


def log_from_rank_zero(log_per_rank: bool | str = False) -> None:
    """Leaves engine progress to rank 0 (call after the process group exists); ``log_per_rank`` (command-line words
    accepted) keeps every rank's.

    Filters sit on the handlers of the root logger (where the bundles' logging.conf writes), so they see the
    records of every engine's logger, whatever its class name.
    """
    if not as_bool(log_per_rank, "log_per_rank"):
        _add_to_handlers(_RankZeroEngineProgress())


def _add_to_handlers(flt: logging.Filter) -> None:
    """Adds ``flt`` to the root logger's handlers (once per kind). A bundle run configures logging (logging.conf)
    before its config imports ``components``; without handlers only WARNING and above reach Python's last-resort
    output, and none of these filters drops those."""
    for handler in logging.getLogger().handlers:
        if not any(type(f) is type(flt) for f in handler.filters):
            handler.addFilter(flt)
