"""What the SSL (inpainting and contrast) bundle's own settings accept (:func:`components.check_setting_types`)."""

from __future__ import annotations

from ...config.kinds import Kind, OneOf
from .network import UPSAMPLE_MODES

__all__ = ["SSL_SETTINGS"]

#: the kinds of the SSL bundle's settings beyond the shared ones, by id (these win)
SSL_SETTINGS: dict[str, Kind] = {
    "network_def#upsample": OneOf(UPSAMPLE_MODES).because("the reconstruction decoder"),
}
