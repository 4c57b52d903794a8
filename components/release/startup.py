"""What every bundle run does first: one line per error from then on, the bundle's own code, and the command line's
config files, ids and setting values checked, before anything is built or read.

It lives here, at the top of the house, because it checks which copy of ``components`` runs
(:mod:`.origin`); everything else it calls lies below.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..config.kinds import Kind
from ..config.overrides import check_overrides
from ..config.running import check_shared_config, running_bundle
from ..config.types import setting_values
from ..errors import report_errors
from ..training.setting_types import check_setting_types
from .origin import report_origin

__all__ = ["start"]


def start(bundle: str, *settings: Mapping[str, Kind]) -> None:
    """The start of a bundle run, the first item of each ``train.json``'s ``run``: errors reported in one line naming
    ``bundle`` (:func:`~components.errors.report_errors`; ``--debug`` on the command line shows the traceback
    instead), the code the bundle carries (:func:`~.origin.report_origin`), and the ``python -m monai.bundle run``
    command line checked: its config files (:func:`~components.config.running.check_shared_config`), its override
    ids (:func:`~components.config.overrides.check_overrides`) and its settings' values against
    :data:`~components.BUNDLE_SETTINGS` and the recipe's tables ``settings``
    (:func:`~components.training.setting_types.check_setting_types`).

    It takes no config id, so that it runs even when the command line left out a config file the ids live in.

    Raises:
        UserError: a subclass naming the first problem found, in that order (all the bad ids or values together).

    Example (``run`` of a bundle config)::

        "$components.start('swin_unetr_ssl_pretrain', components.SSL_SETTINGS)"
    """
    running = running_bundle()
    debug = setting_values(running, ["debug"]).get("debug", False) if running is not None else False
    report_errors(bundle, debug)
    report_origin()
    check_shared_config(running)
    check_overrides(running)
    check_setting_types(*settings, bundle=running)
