"""Seeds per (run seed, epoch, rank): an epoch's crops, augmentations and views depend on those three numbers only, so a
run restarted at an epoch boundary replays the uninterrupted one. :class:`ReseedEachEpoch` gives any trainer (the
finetuning bundles' too) what :class:`~components.PretrainingTrainer` does for its own loader.
"""

from __future__ import annotations

import operator
from typing import Any

import ignite.distributed as idist
import torch
from ignite.engine import Engine, Events
from monai.data.utils import set_rnd


__all__ = ["ReseedEachEpoch"]


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """A seed per (run seed, epoch, rank): resuming at an epoch boundary replays the same views."""
    return (int(seed) * 1_000_003 + int(epoch) * 7_919 + int(rank) * 104_729) % (2**63 - 1)


def reseed_data(loader: Any, seed: int) -> None:
    """Makes a data loader's next pass a function of ``seed`` alone: the random transforms run in this process
    (``num_workers=0``) and the base seed torch draws for worker processes. MONAI seeds transforms once, when
    the loader is built, so without this a resumed run would draw different crops than an uninterrupted one."""
    dataset = getattr(loader, "dataset", None)
    if dataset is not None:
        set_rnd(getattr(dataset, "transform", dataset), seed)
    generator = getattr(loader, "generator", None)
    (generator if generator is not None else torch.default_generator).manual_seed(seed)


class ReseedEachEpoch:
    """Reseeds a trainer's data loader at every epoch start with :func:`epoch_seed` ``(seed, epoch, rank)``
    (:func:`reseed_data`), so the crops and augmentations of an epoch depend on those three numbers only.

    MONAI seeds a dataset's random transforms once, when ``monai.data.DataLoader`` is built (from its generator), or
    when a worker process starts (from the base seed its iterator drew), and their random streams then run on from
    epoch to epoch. A run resumed at epoch ``e`` draws epoch ``e``'s crops from that fresh start, where the
    uninterrupted run drew them from the state its epochs ``1 .. e-1`` left: the two runs see different crops.
    Reseeding at ``EPOCH_STARTED`` makes every epoch start from its own seed in both runs. ignite fires
    ``EPOCH_STARTED`` before it creates the epoch's data iterator (the first epoch's too), so even the epoch's first
    batch is drawn after the reseeding; worker processes get the seed through the base seed the new iterator draws
    (persistent ones too, see :class:`~components.PersistentWorkerLoader`). The current CUDA device's generator,
    which the network's own random draws use on a GPU (the student's drop-path), is reseeded with the same seed; on
    the CPU those draws come from the default generator that :func:`reseed_data` reseeds.

    :class:`PretrainingTrainer` uses it for its own loader; attach it to other trainers, such as MONAI's
    ``SupervisedTrainer`` in the finetuning bundles. A mid-epoch restart continues with the epoch's remaining
    volumes (:class:`~components.EpochShuffleSampler`) but draws their crops from the start of the epoch's stream.

    Args:
        seed: the run's seed (``training#seed``).

    Raises:
        ValueError: a seed that is not an integer.

    Example::

        "handlers": [{"_target_": "components.ReseedEachEpoch", "seed": "@training#seed"}, ...]
    """

    def __init__(self, seed: int) -> None:
        try:
            if isinstance(seed, bool):
                raise TypeError
            self.seed = operator.index(seed)
        except TypeError:
            raise ValueError(f"ReseedEachEpoch: seed must be an integer, got {seed!r}.") from None

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.EPOCH_STARTED, self)

    def __call__(self, engine: Engine) -> int:
        """Reseeds the loader ``engine`` iterates for its current epoch; returns the seed (for a trainer's own
        generators)."""
        seed = epoch_seed(self.seed, engine.state.epoch, idist.get_rank())
        reseed_data(engine.state.dataloader, seed)
        if torch.cuda.is_initialized():  # the network's own draws on a GPU (drop-path, dropout) come from its generator
            torch.cuda.manual_seed(seed)
        return seed
