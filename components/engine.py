"""The SSL training and validation iterations as MONAI engines, and the handlers the SSL bundle needs.

MONAI's ``SupervisedTrainer`` assumes ``loss(network(image), label)``, autocasts to CUDA only and
steps nothing but the optimizer. The SSL step needs views made on the device, a six-argument loss,
AMP on any device, clipping after unscaling and a scheduler stepped only when the optimizer stepped
(distributed-pitfalls.md e), so the two subclasses below replace just ``_iteration``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from ignite.engine import Engine, Events
from monai.engines import SupervisedEvaluator, SupervisedTrainer
from monai.engines.workflow import Workflow
from monai.data.utils import set_rnd
from monai.utils import CommonKeys as Keys
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.tensorboard import SummaryWriter

from .augment import ssl_views
from .distributed import all_reduce_mean, get_rank

__all__ = ["SSLTrainer", "SSLEvaluator", "SSLViewsImageHandler", "resolve_amp_dtype", "epoch_seed", "reseed_data"]

LOG_KEY = "log"
_AMP_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_amp_dtype(device: torch.device, amp_dtype: str | None) -> torch.dtype:
    """The autocast dtype: ``amp_dtype`` if given, else bf16 where the device supports it, fp16 otherwise."""
    if amp_dtype is not None:
        if amp_dtype not in _AMP_DTYPES:
            raise ValueError(f"amp_dtype must be one of {sorted(_AMP_DTYPES)} or None (auto), got {amp_dtype!r}.")
        return _AMP_DTYPES[amp_dtype]
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


def _autocast(device: torch.device, enabled: bool, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type=device.type, dtype=dtype) if enabled else contextlib.nullcontext()


def _unwrap(network: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    while hasattr(network, "module") or hasattr(network, "_orig_mod"):
        network = getattr(network, "module", None) or network._orig_mod
    return network


class _SSLViewsMixin:
    """Shared pieces of the SSL trainer and evaluator: device-side view generation and the AMP context."""

    network: torch.nn.Module

    def _setup_views(self, seed: int, amp: bool, amp_dtype: str | None) -> None:
        self.device = torch.device(self.state.device)
        self.seed = int(seed)
        self.use_amp = bool(amp)
        self.amp_dtype = resolve_amp_dtype(self.device, amp_dtype)
        self.view_generator = torch.Generator(device=self.device)

    def _views(self, batchdata: dict) -> tuple[torch.Tensor, ...]:
        if not isinstance(batchdata, dict) or Keys.IMAGE not in batchdata:
            raise ValueError(f"SSL batches must be dicts with an {Keys.IMAGE!r} key, got {type(batchdata).__name__}.")
        image = batchdata[Keys.IMAGE]
        image = image.as_tensor() if hasattr(image, "as_tensor") else image
        image = image.to(self.device, non_blocking=True)
        return (image, *ssl_views(image, generator=self.view_generator))

    def _forward(self, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with _autocast(self.device, self.use_amp, self.amp_dtype):
            return self.network(inputs)


class SSLTrainer(_SSLViewsMixin, SupervisedTrainer):
    """``SupervisedTrainer`` running the SSL pretraining step of recipe.md s1.

    One iteration: two rotated views of every crop, each corrupted by ``aug_rand`` (views drawn on the
    device from a generator reseeded per epoch and rank), one forward of the concatenated views (exact:
    the model has no BatchNorm), ``loss_function(rot_logits, rot_labels, emb_1, emb_2, recon, clean_views)``,
    backward (scaled under fp16 AMP), gradient clipping after unscaling, optimizer step, and the LR
    scheduler stepped only when the optimizer really stepped (GradScaler skips steps on overflow).

    Args:
        lr_scheduler: scheduler stepped once per optimizer step (per iteration), or None.
        clip_grad_norm: max gradient norm, or None/0 for no clipping.
        amp: autocast the forward; fp16 also uses a GradScaler, bf16 needs none.
        amp_dtype: "bfloat16" / "float16", or None to choose bf16 where supported.
        seed: base seed of the view generator.
        other args: as ``monai.engines.SupervisedTrainer`` (its own CUDA-only ``amp`` is not used).

    ``engine.state.output`` is a one-item list (as MONAI handlers expect: ``from_engine(["loss"], first=True)``)
    of a dict with ``image``, ``pred`` (reconstructions), ``label`` (clean rotated views), ``loss`` and ``log``:
    the loss parts and learning rate, averaged over ranks, for the stats handlers.
    """

    def __init__(
        self,
        device: str | torch.device,
        max_epochs: int,
        train_data_loader: Any,
        network: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_function: Callable,
        lr_scheduler: LRScheduler | None = None,
        clip_grad_norm: float | None = 1.0,
        amp: bool = False,
        amp_dtype: str | None = None,
        seed: int = 0,
        train_handlers: Sequence | None = None,
        epoch_length: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            device=device,
            max_epochs=max_epochs,
            train_data_loader=train_data_loader,
            network=network,
            optimizer=optimizer,
            loss_function=loss_function,
            train_handlers=train_handlers,
            epoch_length=epoch_length,
            amp=False,
            decollate=False,
            **kwargs,
        )
        self._setup_views(seed, amp, amp_dtype)
        self.lr_scheduler = lr_scheduler
        self.clip_grad_norm = clip_grad_norm
        use_scaler = self.use_amp and self.amp_dtype == torch.float16
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=use_scaler)
        self.add_event_handler(Events.EPOCH_STARTED, self._seed_epoch)

    def run(self) -> None:  # type: ignore[override]
        """Runs the training with this trainer's own GradScaler (MONAI's ``Trainer.run`` would replace it with a
        CUDA-only one, or None)."""
        Workflow.run(self)

    def _seed_epoch(self, engine: Engine) -> None:
        """Views, crops and worker seeds of an epoch depend on (seed, epoch, rank) only: resuming at an epoch
        boundary replays the uninterrupted run."""
        seed = epoch_seed(self.seed, engine.state.epoch, get_rank())
        self.view_generator.manual_seed(seed)
        reseed_data(self.data_loader, seed)

    def _iteration(self, engine: SupervisedTrainer, batchdata: dict) -> list[dict]:
        image, inputs, rot_labels, targets = self._views(batchdata)
        self.network.train()
        self.optimizer.zero_grad(set_to_none=True)
        rot_logits, embeddings, recon = self._forward(inputs)
        emb_1, emb_2 = embeddings.float().chunk(2)
        total, parts = self.loss_function(rot_logits.float(), rot_labels, emb_1, emb_2, recon.float(), targets)
        self.scaler.scale(total).backward()
        if self.clip_grad_norm:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.network.parameters(), self.clip_grad_norm)
        scale_before = self.scaler.get_scale() if self.scaler.is_enabled() else None
        self.scaler.step(self.optimizer)
        self.scaler.update()
        stepped = scale_before is None or self.scaler.get_scale() >= scale_before
        if stepped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        logged = torch.stack([total.detach(), parts["rot"].detach(), parts["contrast"].detach(), parts["recon"].detach()])
        logged = all_reduce_mean(logged)
        log = dict(zip(("loss", "loss_rot", "loss_contrast", "loss_recon"), logged))
        log["lr"] = self.optimizer.param_groups[0]["lr"]
        # a one-item list: the shape MONAI handlers read with from_engine([...], first=True) (their decollated
        # outputs); the views of a batch have no per-sample meaning to decollate
        return [{Keys.IMAGE: image, Keys.PRED: recon.detach(), Keys.LABEL: targets, Keys.LOSS: total.detach(), LOG_KEY: log}]


class SSLEvaluator(_SSLViewsMixin, SupervisedEvaluator):
    """``SupervisedEvaluator`` computing reconstructions of the same kind of views as training.

    Views and crops are reseeded at every evaluation start, so each validation scores the same views and
    the reconstruction L1 (the key metric, lower is better) is comparable across evaluations. The output
    holds ``pred`` (reconstructions of both augmented views), ``label`` (the clean rotated views),
    ``image`` (clean crops) and ``views`` (the augmented network inputs).
    """

    def __init__(
        self,
        device: str | torch.device,
        val_data_loader: Any,
        network: torch.nn.Module,
        amp: bool = False,
        amp_dtype: str | None = None,
        seed: int = 12345,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("metric_cmp_fn", lambda current, best: current < best)
        super().__init__(device=device, val_data_loader=val_data_loader, network=network, amp=False, decollate=False, **kwargs)
        self._setup_views(seed, amp, amp_dtype)
        self.add_event_handler(Events.STARTED, self._seed_evaluation)

    def _seed_evaluation(self, engine: Engine) -> None:
        seed = epoch_seed(self.seed, 0, get_rank())
        self.view_generator.manual_seed(seed)
        reseed_data(self.data_loader, seed)

    def _iteration(self, engine: SupervisedEvaluator, batchdata: dict) -> dict:
        image, inputs, _, targets = self._views(batchdata)
        self.network.eval()
        with torch.no_grad():
            _, _, recon = self._forward(inputs)
        return {Keys.IMAGE: image, "views": inputs, Keys.PRED: recon.float(), Keys.LABEL: targets}


class SSLViewsImageHandler:
    """Writes middle slices of the first validation batch to TensorBoard after each evaluation.

    One row per crop (up to ``max_crops``): the clean crop, its two augmented views and the two
    reconstructions, so a user sees what the model learns. Attach to the evaluator; the step is its epoch,
    which MONAI's ``ValidationHandler`` sets to the trainer's. Only rank 0 writes.
    """

    def __init__(self, log_dir: str, max_crops: int = 2, tag: str = "ssl_views") -> None:
        self.log_dir = log_dir
        self.max_crops = max_crops
        self.tag = tag
        self._writer: SummaryWriter | None = None
        self._grid: torch.Tensor | None = None

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=1), self._capture)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._write)

    def _capture(self, engine: Engine) -> None:
        out = engine.state.output
        crops = out[Keys.IMAGE].shape[0]
        n = min(self.max_crops, crops)
        views, recon = out["views"], out[Keys.PRED]
        columns = [out[Keys.IMAGE][:n], views[:n], views[crops : crops + n], recon[:n], recon[crops : crops + n]]
        middle = [c[:, 0, :, :, c.shape[-1] // 2].float().clamp(0, 1).cpu() for c in columns]  # (n, H, W) each
        rows = [torch.cat([col[i] for col in middle], dim=1) for i in range(n)]  # (H, 5W) per crop
        self._grid = torch.cat(rows, dim=0).unsqueeze(0)  # (1, nH, 5W)

    def _write(self, engine: Engine) -> None:
        if self._grid is None or get_rank() != 0:
            return
        if self._writer is None:
            self._writer = SummaryWriter(log_dir=self.log_dir)
        self._writer.add_image(self.tag, self._grid, global_step=engine.state.epoch)
        self._writer.flush()
        self._grid = None
