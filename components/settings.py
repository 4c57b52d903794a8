"""Settings of a bundle that must agree with each other, checked when the workflow starts.

A disagreement found by the first iteration (a rotation of a non-square crop) or by the first validation (a metric
given fewer classes than names) costs a whole epoch of caching and training and then fails far from the cause.
:func:`check_settings` runs in a bundle's ``initialize`` and fails at once, in one line naming both settings.
"""

from __future__ import annotations

from collections.abc import Sequence

from .networks import check_roi_size

__all__ = ["check_settings"]


def check_settings(
    roi_size: Sequence[int] | None = None,
    network: str = "network_def",
    rotation: bool = False,
) -> None:
    """Checks the settings that must agree; each argument left None is not checked.

    Args:
        roi_size: the training crop; every axis a multiple of 32 with at least two tokens at the encoder's last
            stage (Swin UNETR reduces each axis by 32; :func:`~components.networks.check_roi_size`).
        network: names the network in the message, e.g. "SwinUNETR".
        rotation: the SSL rotation views rotate each crop by k * 90 degrees in its last two axes, which needs the
            last two ``roi_size`` values equal (else the first iteration fails in ``rot_rand``).

    Raises:
        ValueError: one line naming the two settings that disagree and how to fix them.

    Example:
        >>> check_settings(roi_size=[96, 96, 96], network="SwinUNETR")
    """
    if roi_size is None:
        return
    roi = [int(s) for s in roi_size]
    try:
        check_roi_size(roi, spatial_dims=3)
    except ValueError as err:
        reason = str(err).removeprefix("SSLHead: ")
        raise ValueError(f"roi_size {roi} does not fit the network ({network}): {reason}") from None
    if rotation and roi[1] != roi[2]:
        side = max(roi[1], roi[2])
        raise ValueError(
            f"roi_size {roi} and the SSL rotation views disagree: rot_rand rotates each crop by k * 90 degrees in its "
            f"last two axes, which needs them equal, got {roi[1]} and {roi[2]}; "
            f"e.g. --roi_size \"[{roi[0]},{side},{side}]\"."
        )
