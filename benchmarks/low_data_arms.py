"""The low-data protocol's arms and the contrasts between them. Standard library only: ``low_data.py --help`` lists
them without importing torch."""

from __future__ import annotations

from typing import NamedTuple


class Arm(NamedTuple):
    """An arm: the recipe whose encoder it starts from (None: random initialisation) and whether it stays frozen."""

    recipe: str | None
    frozen: bool


ARMS: dict[str, Arm] = {
    "scratch": Arm(None, False),
    "ssl": Arm("ssl", False),
    "dino": Arm("dino", False),
    "frozen_random": Arm(None, True),
    "frozen_ssl": Arm("ssl", True),
    "frozen_dino": Arm("dino", True),
}
CONTRASTS: dict[str, tuple[str, str]] = {
    "ssl - scratch": ("ssl", "scratch"),
    "dino - scratch": ("dino", "scratch"),
    "frozen_ssl - frozen_random": ("frozen_ssl", "frozen_random"),
    "frozen_dino - frozen_random": ("frozen_dino", "frozen_random"),
}


def plan_contrasts(arms: tuple[str, ...]) -> dict[str, tuple[str, str]]:
    """The contrasts both of whose arms are among ``arms``."""
    return {name: pair for name, pair in CONTRASTS.items() if set(pair) <= set(arms)}
