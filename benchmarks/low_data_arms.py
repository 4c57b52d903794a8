"""The low-data protocol's arms and the contrasts between them. Standard library only: ``low_data.py --help`` lists
them without importing torch."""

from __future__ import annotations

from typing import NamedTuple

RECIPES = ("ssl", "dino", "mim")  # SSL (inpainting, rotation, contrast), self-distillation, masked image modelling
PROBE_NETWORK = "$components.LinearProbe"  # the CT bundle's network_def#network of a probe arm


class Arm(NamedTuple):
    """An arm: the recipe whose encoder it starts from (None: random initialisation) and how it trains.

    ``kind``: ``"finetune"`` (every weight trains), ``"probe"`` (a linear probe: the ``swinViT`` encoder frozen and one
    1x1x1 convolution per multi-scale feature trains, :data:`PROBE_NETWORK`: the test of the representation itself) or
    ``"frozen_swinvit"`` (``swinViT`` frozen for the whole run while the decoder and the convolutional encoder blocks
    of SwinUNETR still train: what the old protocol called ``frozen_*``).
    """

    recipe: str | None
    kind: str


ARMS: dict[str, Arm] = {
    "scratch": Arm(None, "finetune"),
    "ssl": Arm("ssl", "finetune"),
    "dino": Arm("dino", "finetune"),
    "mim": Arm("mim", "finetune"),
    "probe_random": Arm(None, "probe"),
    "probe_ssl": Arm("ssl", "probe"),
    "probe_dino": Arm("dino", "probe"),
    "probe_mim": Arm("mim", "probe"),
    "frozen_swinvit_random": Arm(None, "frozen_swinvit"),
    "frozen_swinvit_ssl": Arm("ssl", "frozen_swinvit"),
    "frozen_swinvit_dino": Arm("dino", "frozen_swinvit"),
    "frozen_swinvit_mim": Arm("mim", "frozen_swinvit"),
}
DEFAULT_ARMS = ("scratch", "ssl", "dino", "mim", "probe_random", "probe_ssl", "probe_dino", "probe_mim")
BASELINES = {"finetune": "scratch", "probe": "probe_random", "frozen_swinvit": "frozen_swinvit_random"}
# each pretrained arm against the arm of its kind from a random encoder: "ssl - scratch", "probe_mim - probe_random", ...
CONTRASTS: dict[str, tuple[str, str]] = {
    f"{name} - {BASELINES[arm.kind]}": (name, BASELINES[arm.kind]) for name, arm in ARMS.items() if arm.recipe
}


def plan_contrasts(arms: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """The contrasts both of whose arms are among ``arms``."""
    return {name: pair for name, pair in CONTRASTS.items() if set(pair) <= set(arms)}
