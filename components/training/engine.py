"""One recipe-agnostic pretraining trainer and evaluator as MONAI engines.

MONAI's ``SupervisedTrainer`` assumes ``loss(network(image), label)``, autocasts to CUDA only and steps nothing but
the optimizer. A self-supervised step needs views made on the device, a recipe-specific forward and loss, AMP on any
device, clipping after unscaling and a scheduler stepped only when the optimizer stepped (a GradScaler skips
steps on overflow, and stepping the schedule anyway shifts it).
:class:`PretrainingTrainer` owns exactly those shared pieces and replaces only ``_iteration``; what differs between
recipes comes from a :class:`Recipe` (``components.recipes``): its views, its forward, its loss with named parts and,
optionally, an update after each optimizer step (a teacher's EMA).

:class:`StopOnNonFiniteLoss` guards any MONAI trainer (the finetuning bundles' ``SupervisedTrainer`` too): it stops
the run after a NaN / Inf training loss, naming the first bad iteration's epoch, loss parts and batch files, and
never lets a checkpoint saver write a state trained past it (:class:`~components.checkpoint.CheckpointEvents`).
:class:`ReseedEachEpoch` gives any trainer (the finetuning bundles' too) what :class:`PretrainingTrainer` does for its
own loader: an epoch's crops depend on (seed, epoch, rank) only, so a restart at an epoch boundary replays them.
"""

from __future__ import annotations

import contextlib
import inspect
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from ignite.engine import Engine, Events
from monai.data.utils import set_rnd
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.engines.utils import IterationEvents
from monai.engines.workflow import Workflow
from monai.handlers import from_engine
from monai.utils import CommonKeys as Keys
from torch.optim.lr_scheduler import LRScheduler

from ..checkpoint.training_state import CheckpointEvents, register_checkpoint_events
from ..config.values import is_null
from ..data.sources import NOT_TRACKED, batch_filenames
from ..distributed import all_reduce_mean, get_rank, get_world_size, is_distributed
from ..errors import UserError
from .settings import check_accumulation_steps

__all__ = [
    "NonFiniteLossError",
    "StopOnNonFiniteLoss",
    "Recipe",
    "PretrainingTrainer",
    "PretrainingEvaluator",
    "ReseedEachEpoch",
    "resolve_amp_dtype",
    "epoch_seed",
    "log_filter",
    "reseed_data",
    "unwrap",
]

LOG_KEY = "log"
LOSS_PARTS_KEY = "loss_parts"
#: the autocast dtypes ``amp_dtype`` names (None or "null": bf16 where the device supports it, fp16 otherwise)
AMP_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@runtime_checkable
class Recipe(Protocol):
    """What a pretraining recipe gives :class:`PretrainingTrainer` (and :class:`PretrainingEvaluator`).

    - ``views(image, generator)``: the network inputs (and targets) of a batch of crops ``image`` (B, C, *spatial),
      already on the device, drawn from ``generator`` only (reseeded per (seed, epoch, rank) by the trainer). A
      ``views`` with a ``host_generator`` parameter also gets a CPU generator, reseeded alike, on accelerators (None
      on CPU): small draws made there can be read on the host without a device sync.
    - ``forward(network, views)``: the network outputs; runs under autocast when AMP is on.
    - ``loss(outputs, views)``: ``(total, {name: part})``, scalar tensors; the trainer logs every part as
      ``loss_<name>``, averaged over ranks.
    - ``outputs(outputs, views)``: the detached tensors the engine's output holds for handlers (``image``, ``pred``, ...).

    Optional: ``monitor(outputs, views) -> {name: scalar}`` (diagnostics logged under their names, averaged over
    ranks), ``after_step(engine)`` (called after every real optimizer step, e.g. a teacher's EMA) and
    ``attach(engine)`` (registers the recipe's own event handlers on the trainer).
    """

    def views(self, image: torch.Tensor, generator: torch.Generator) -> Any: ...

    def forward(self, network: torch.nn.Module, views: Any) -> Any: ...

    def loss(self, outputs: Any, views: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def outputs(self, outputs: Any, views: Any) -> dict[str, Any]: ...


def resolve_amp_dtype(device: torch.device, amp_dtype: str | None) -> torch.dtype:
    """The autocast dtype: ``amp_dtype`` if given, else bf16 where the device supports it, fp16 otherwise."""
    if not is_null(amp_dtype):  # "null" from a command line is None
        if amp_dtype not in AMP_DTYPES:
            raise ValueError(f"amp_dtype must be one of {sorted(AMP_DTYPES)} or None (auto), got {amp_dtype!r}.")
        return AMP_DTYPES[amp_dtype]
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


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
        seed = epoch_seed(self.seed, engine.state.epoch, get_rank())
        reseed_data(engine.state.dataloader, seed)
        if torch.cuda.is_initialized():  # the network's own draws on a GPU (drop-path, dropout) come from its generator
            torch.cuda.manual_seed(seed)
        return seed


def log_filter(log_interval: int) -> Callable[[Any, int], bool]:
    """The iterations that log, as an ignite event filter: 1, 1 + n, 1 + 2n, ... for ``log_interval`` n (the first
    iteration always, so a run shows progress at once). The trainer reduces its logged values at exactly these
    iterations; give the same filter to StatsHandler / TensorBoardStatsHandler as ``iteration_log``.

    Raises:
        ValueError: for an interval that is not a positive integer.

    Example:
        >>> [i for i in range(1, 25) if log_filter(10)(None, i)]
        [1, 11, 21]
    """
    try:  # a command line may pass "10"
        interval = int(log_interval)
        valid = not isinstance(log_interval, bool) and float(log_interval) == interval >= 1
    except (TypeError, ValueError):
        valid = False
    if not valid:
        raise ValueError(f"log_interval must be a positive integer, got {log_interval!r}.")
    return lambda engine, iteration: (iteration - 1) % interval == 0


def unwrap(network: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while hasattr(network, "module") or hasattr(network, "_orig_mod"):
        network = getattr(network, "module", None) or network._orig_mod
    return network


def _check_recipe(recipe: Any) -> None:
    missing = [name for name in ("views", "forward", "loss", "outputs") if not callable(getattr(recipe, name, None))]
    if missing:
        raise TypeError(f"recipe {type(recipe).__name__} lacks {missing}: see components.training.engine.Recipe.")


class _RecipeEngineMixin:
    """Shared pieces of the trainer and evaluator: the batch image on the device, the recipe's views, autocast."""

    network: torch.nn.Module

    def _setup_recipe(self, recipe: Recipe, seed: int, amp: bool, amp_dtype: str | None) -> None:
        _check_recipe(recipe)
        self.recipe = recipe
        self.device = torch.device(self.state.device)
        self.seed = int(seed)
        self.use_amp = bool(amp)
        self.amp_dtype = resolve_amp_dtype(self.device, amp_dtype)
        self.view_generator = torch.Generator(device=self.device)
        self.host_generator = torch.Generator() if self.device.type != "cpu" else None
        self._views_take_host = "host_generator" in inspect.signature(recipe.views).parameters

    def _seed_views(self, seed: int) -> None:
        self.view_generator.manual_seed(seed)
        if self.host_generator is not None:
            self.host_generator.manual_seed(seed)

    def _views(self, batchdata: dict) -> Any:
        if not isinstance(batchdata, Mapping) or Keys.IMAGE not in batchdata:
            raise ValueError(f"pretraining batches must be dicts with an {Keys.IMAGE!r} key, got {type(batchdata).__name__}.")
        image = batchdata[Keys.IMAGE]
        image = image.as_tensor() if hasattr(image, "as_tensor") else image
        image = image.to(self.device, non_blocking=True)
        if self._views_take_host:
            return self.recipe.views(image, self.view_generator, host_generator=self.host_generator)
        return self.recipe.views(image, self.view_generator)

    def _forward(self, views: Any) -> Any:
        autocast = torch.autocast(self.device.type, dtype=self.amp_dtype) if self.use_amp else contextlib.nullcontext()
        with autocast:
            return self.recipe.forward(self.network, views)


class PretrainingTrainer(_RecipeEngineMixin, SupervisedTrainer):
    """``SupervisedTrainer`` running one step of a pretraining :class:`Recipe`.

    One iteration: the recipe's views of the batch (drawn on the device from a generator reseeded per
    (seed, epoch, rank)), its forward under autocast, its loss, backward (scaled under fp16 AMP), gradient clipping
    after unscaling, optimizer step, then -- only when the optimizer really stepped (GradScaler skips steps on
    overflow) -- the LR scheduler and the recipe's ``after_step``. MONAI's ``IterationEvents`` fire in MONAI's
    order (FORWARD_COMPLETED, LOSS_COMPLETED, BACKWARD_COMPLETED, MODEL_COMPLETED), each with this iteration's
    values already in ``engine.state.output`` (as MONAI fills it), so a recipe or handler can act between backward
    and the optimizer step (e.g. drop the gradients of a frozen layer). Gradient accumulation is not supported:
    ``accumulation_steps`` other than the integer 1 is refused at construction.

    Args:
        recipe: the :class:`Recipe`; its ``loss`` is also the engine's ``loss_function``.
        lr_scheduler: scheduler stepped once per optimizer step (per iteration), or None.
        clip_grad_norm: max gradient norm, or None/0 for no clipping.
        amp: autocast the forward; fp16 also uses a GradScaler, bf16 needs none.
        amp_dtype: "bfloat16" / "float16", or None to choose bf16 where supported.
        seed: base seed of the view generator and the data loader's random transforms.
        log_interval: the iterations whose output carries ``log`` (see :func:`log_filter`): the only iterations
            that reduce the logged values over ranks and read them back to the host.
        other args: as ``monai.engines.SupervisedTrainer`` (its own CUDA-only ``amp`` is not used).

    ``engine.state.output`` is a one-item list (as MONAI handlers expect: ``from_engine(["loss"], first=True)``) of
    a dict with the recipe's ``outputs`` (e.g. ``image``, ``pred``, ``label``), ``loss`` (this rank's, a detached
    tensor), ``loss_parts`` (this rank's named parts, detached tensors) and ``log``. At the log iterations ``log``
    holds ``loss``, ``loss_<part>`` for every named part, the recipe's ``monitor`` values (all averaged over ranks,
    as Python floats) and ``lr``; at the others it is None, which MONAI's stats handlers skip. So on CUDA an
    iteration between two log iterations never waits for the device (bf16; fp16's GradScaler reads its overflow
    flag every step).
    """

    def __init__(
        self,
        device: str | torch.device,
        max_epochs: int,
        train_data_loader: Any,
        network: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        recipe: Recipe,
        lr_scheduler: LRScheduler | None = None,
        clip_grad_norm: float | None = 1.0,
        amp: bool = False,
        amp_dtype: str | None = None,
        seed: int = 0,
        log_interval: int = 1,
        train_handlers: Sequence | None = None,
        epoch_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        check_accumulation_steps(kwargs.pop("accumulation_steps", 1))
        kwargs.setdefault("loss_function", getattr(recipe, "loss", None))
        self.log_due = log_filter(log_interval)
        super().__init__(
            device=device,
            max_epochs=max_epochs,
            train_data_loader=train_data_loader,
            network=network,
            optimizer=optimizer,
            train_handlers=train_handlers,
            epoch_length=epoch_length,
            amp=False,
            decollate=False,
            **kwargs,
        )
        self._setup_recipe(recipe, seed, amp, amp_dtype)
        self.lr_scheduler = lr_scheduler
        self.clip_grad_norm = None if is_null(clip_grad_norm) else clip_grad_norm  # "null" from a command line
        use_scaler = self.use_amp and self.amp_dtype == torch.float16
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=use_scaler)
        self._reseed_data = ReseedEachEpoch(self.seed)
        self.add_event_handler(Events.EPOCH_STARTED, self._seed_epoch)
        if callable(getattr(recipe, "attach", None)):
            recipe.attach(self)

    def run(self) -> None:  # type: ignore[override]
        """Runs the training with this trainer's own GradScaler (MONAI's ``Trainer.run`` would replace it with a
        CUDA-only one, or None)."""
        Workflow.run(self)

    def _seed_epoch(self, engine: Engine) -> None:
        """Crops, worker seeds and views of an epoch depend on (seed, epoch, rank) only: resuming at an epoch
        boundary replays the uninterrupted run."""
        self._seed_views(self._reseed_data(engine))

    def _optimizer_step(self) -> bool:
        """Clip after unscaling, step through the scaler; True when the optimizer really stepped."""
        if self.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.network.parameters(), self.clip_grad_norm)
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return scale_before is None or self.scaler.get_scale() >= scale_before

    def _iteration(self, engine: PretrainingTrainer, batchdata: dict) -> list[dict]:
        """One step. ``engine.state.output`` is this iteration's before each ``IterationEvents`` fires, as in MONAI's
        SupervisedTrainer: the recipe's outputs from FORWARD_COMPLETED on, ``loss`` and ``loss_parts`` from
        LOSS_COMPLETED on, ``log`` at MODEL_COMPLETED."""
        views = self._views(batchdata)
        self.network.train()
        self.optimizer.zero_grad(set_to_none=True)
        outputs = self._forward(views)
        # a one-item list: the shape MONAI handlers read with from_engine([...], first=True) (their decollated
        # outputs); the views of a batch have no per-sample meaning to decollate
        state = {**self.recipe.outputs(outputs, views), LOG_KEY: None}
        engine.state.output = [state]
        engine.fire_event(IterationEvents.FORWARD_COMPLETED)
        total, parts = self.loss_function(outputs, views)
        state.update({Keys.LOSS: total.detach(), LOSS_PARTS_KEY: {name: part.detach() for name, part in parts.items()}})
        engine.fire_event(IterationEvents.LOSS_COMPLETED)
        self.scaler.scale(total).backward()
        engine.fire_event(IterationEvents.BACKWARD_COMPLETED)
        if self._optimizer_step():
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            if callable(getattr(self.recipe, "after_step", None)):
                self.recipe.after_step(engine)
        if self.log_due(engine, engine.state.iteration):
            state[LOG_KEY] = self._log(outputs, views, total, parts)
        engine.fire_event(IterationEvents.MODEL_COMPLETED)
        return engine.state.output

    def _log(self, outputs: Any, views: Any, total: torch.Tensor, parts: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """The logged values, averaged over ranks in one all-reduce and read back to the host (one sync)."""
        monitor = self.recipe.monitor(outputs, views) if callable(getattr(self.recipe, "monitor", None)) else {}
        names = ["loss", *(f"loss_{name}" for name in parts), *monitor]
        values = [total.detach(), *(p.detach() for p in parts.values()), *(torch.as_tensor(m).detach() for m in monitor.values())]
        reduced = all_reduce_mean(torch.stack([v.float().to(total.device) for v in values])).tolist()
        return {**dict(zip(names, reduced)), "lr": self.optimizer.param_groups[0]["lr"]}


class PretrainingEvaluator(_RecipeEngineMixin, SupervisedEvaluator):
    """``SupervisedEvaluator`` running a :class:`Recipe`'s views and forward without gradients.

    Views and crops are reseeded at every evaluation start, so each validation scores the same views and its
    metrics are comparable across evaluations. The output is the recipe's ``outputs`` dict.
    """

    def __init__(
        self,
        device: str | torch.device,
        val_data_loader: Any,
        network: torch.nn.Module,
        recipe: Recipe,
        amp: bool = False,
        amp_dtype: str | None = None,
        seed: int = 12345,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("metric_cmp_fn", lambda current, best: current < best)
        super().__init__(device=device, val_data_loader=val_data_loader, network=network, amp=False, decollate=False, **kwargs)
        self._setup_recipe(recipe, seed, amp, amp_dtype)
        self.add_event_handler(Events.STARTED, self._seed_evaluation)

    def _seed_evaluation(self, engine: Engine) -> None:
        seed = epoch_seed(self.seed, 0, get_rank())
        self._seed_views(seed)
        reseed_data(self.data_loader, seed)

    def _iteration(self, engine: PretrainingEvaluator, batchdata: dict) -> dict:
        views = self._views(batchdata)
        self.network.eval()
        with torch.no_grad():
            outputs = self._forward(views)
        return self.recipe.outputs(outputs, views)


# ---------------------------------------------------------------------------------------------------------------
# stopping on a non-finite loss
# ---------------------------------------------------------------------------------------------------------------


class NonFiniteLossError(UserError, RuntimeError):
    """The training loss became NaN or Inf; the message names the epoch, iteration, loss parts and batch files."""


def _as_float(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.detach().float().reshape(-1)[0]) if value.numel() else float("nan")
    return float(value)


@dataclass
class _Seen:
    """What the error message needs of one iteration, kept until the next check: host values and device scalars."""

    epoch: int
    in_epoch: int
    epoch_length: int | None
    loss: torch.Tensor
    parts: dict[str, torch.Tensor]
    files: list[str] | None


class StopOnNonFiniteLoss:
    """Raises :class:`NonFiniteLossError` when a training loss was not finite, naming the first bad iteration.

    Every iteration updates an on-device record of the first iteration whose loss was NaN / Inf (a few tiny kernels,
    nothing read back to the host); it is read (on CUDA, one sync) only at the checks: every ``check_interval``
    iterations (the iterations that log, see :func:`components.training.engine.log_filter`), at each epoch end (before
    validation) and before every checkpoint save (:class:`CheckpointEvents`). So with ``check_interval`` = the log
    interval an iteration costs no host sync, a NaN state is never saved or validated, and the run stops at most
    ``check_interval - 1`` iterations after the first bad one. With ``check_interval=1`` it stops at that iteration.
    Under DDP each check is one all-reduce of every rank's first bad iteration (on every rank, at the same
    iterations), so all ranks stop together; the message names the ranks whose own loss was bad, and only those
    ranks report it (:attr:`~components.errors.UserError.reporting_ranks`): their messages name their own batches.

    The loss is ``from_engine([loss_key], first=True)`` of the output (a PretrainingTrainer dict, or a MONAI
    trainer's list of per-sample dicts); its parts come from ``output[parts_key]`` when the trainer provides them
    (PretrainingTrainer's ``loss_parts``). The message holds the epoch, the iteration (global and within the
    epoch), the loss and its parts, and this rank's batch files at that iteration (:func:`batch_filenames`), or
    says that they are not tracked.

    Args:
        loss_key: key of the loss in the output dicts.
        parts_key: key of the dict of named loss parts in the output, when the trainer provides one.
        image_key: key of the image in the batch, for the file names.
        max_files: at most this many file names are listed.
        check_interval: read the record every this many iterations (1: at every iteration).

    Attach it to the trainer before the validation handler and the checkpoint savers of the same events.
    """

    def __init__(
        self,
        loss_key: str = "loss",
        parts_key: str = "loss_parts",
        image_key: str = "image",
        max_files: int = 32,
        check_interval: int = 1,
    ) -> None:
        from .engine import log_filter  # validates the interval

        self.due = log_filter(check_interval)
        self.check_interval = int(check_interval)
        self.loss_key, self.parts_key, self.image_key = loss_key, parts_key, image_key
        self.max_files = int(max_files)
        self._first_bad: torch.Tensor | None = None  # int64 scalar on the loss's device; 0: none yet
        self._seen: dict[int, _Seen] = {}

    def attach(self, engine: Engine) -> None:
        register_checkpoint_events(engine)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.track)
        engine.add_event_handler(Events.ITERATION_COMPLETED(event_filter=self.due), self.check)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self.check)
        engine.add_event_handler(CheckpointEvents.BEFORE_SAVE, self.check)

    def _loss(self, output: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = from_engine([self.loss_key], first=True)(output)
        if loss is None:
            raise KeyError(
                f"StopOnNonFiniteLoss: no {self.loss_key!r} in the trainer output ({type(output).__name__}); "
                "set loss_key to the key of the loss."
            )
        first = output[0] if isinstance(output, (list, tuple)) and output else output
        parts = first.get(self.parts_key) if isinstance(first, Mapping) else None
        as_tensor = lambda v: (v if isinstance(v, torch.Tensor) else torch.tensor(float(v))).detach()  # noqa: E731
        return as_tensor(loss), {str(k): as_tensor(v) for k, v in (parts or {}).items()}

    def track(self, engine: Engine) -> None:
        """Folds this iteration's loss into the on-device record and keeps what a message would need."""
        loss, parts = self._loss(engine.state.output)
        state = engine.state
        if self._first_bad is None or self._first_bad.device != loss.device:
            self._first_bad = torch.zeros((), dtype=torch.int64, device=loss.device)
        bad = ~torch.isfinite(loss).all()
        self._first_bad = torch.where(bad & (self._first_bad == 0), state.iteration, self._first_bad)
        length = state.epoch_length or 0
        in_epoch = (state.iteration - 1) % length + 1 if length else state.iteration
        files = batch_filenames(state.batch, self.image_key)
        self._seen[state.iteration] = _Seen(state.epoch, in_epoch, state.epoch_length, loss, parts, files)

    def check(self, engine: Engine) -> None:
        """Reads the record (all ranks' under DDP); raises when any rank saw a non-finite loss."""
        if self._first_bad is None:
            return
        world, rank = get_world_size(), get_rank()
        if world > 1 and is_distributed():
            own = torch.zeros(world, dtype=torch.float64, device=self._first_bad.device)
            own[rank] = self._first_bad
            per_rank = [int(round(v)) for v in (all_reduce_mean(own) * world).tolist()]
        else:
            per_rank = [int(self._first_bad)]
        bad_ranks = [r for r, iteration in enumerate(per_rank) if iteration > 0]
        if not bad_ranks:
            self._seen.clear()
            return
        iteration = min(per_rank[r] for r in bad_ranks)
        error = NonFiniteLossError(self._message(engine, iteration, bad_ranks))
        error.reporting_ranks = tuple(bad_ranks)  # a bad rank's message names its own batch (components.errors)
        raise error

    def _message(self, engine: Engine, iteration: int, bad_ranks: list[int]) -> str:
        seen = self._seen[iteration]
        loss = _as_float(seen.loss)
        world, rank = get_world_size(), get_rank()
        checked = min(self.check_interval, engine.state.iteration - iteration + 1)
        lines = [  # the first line is the same on every bad rank of equal loss: said once (components.errors)
            f"non-finite training loss {loss if rank in bad_ranks else 'on another rank'} at epoch {seen.epoch}, "
            f"iteration {iteration} (iteration {seen.in_epoch}/{seen.epoch_length or '?'} of the epoch)"
            + (f" on ranks {bad_ranks} of {world}." if world > 1 else ".")
        ]
        if iteration != engine.state.iteration:
            lines.append(
                f"found at iteration {engine.state.iteration} (checked every {self.check_interval} iterations, at "
                f"epoch ends and before checkpoints; {checked - 1} later iterations ran on)."
            )
        if seen.parts:
            lines.append("loss parts: " + ", ".join(f"loss_{k}={_as_float(v)}" for k, v in seen.parts.items()))
        if world > 1:
            lines.append(f"this rank's own loss: {loss}")
        if seen.files is None:
            lines.append(f"batch files: {NOT_TRACKED}")
        else:
            shown = seen.files[: self.max_files]
            more = f" (+{len(seen.files) - len(shown)} more)" if len(seen.files) > len(shown) else ""
            lines.append(f"batch files (rank {rank}): {shown}{more}")
        lines.append(
            "Check these volumes for NaN/Inf voxels or a wrong intensity range, lower the learning rate, or turn "
            "off fp16 AMP; resume from the last checkpoint (saved before this iteration) once fixed."
        )
        return "\n".join(lines)
