"""Restarts of every training bundle (SSL, self-distillation, BTCV, BraTS) continue the uninterrupted run, end to end
on CPU.

Per bundle, an uninterrupted 2-epoch run (shared by both tests) and runs stopped and restarted, on tiny synthetic data
(feature size 12, 2 training volumes, one volume per batch: 2 iterations per epoch, validation on 1 volume); a probe
(``tests/probes.py``) records per iteration the exact LR, the batch's files and a digest of its crops.

- After a restart at an epoch boundary the run replays the uninterrupted one: the same LR at every iteration (also
  when relaunched with a larger ``max_epochs``: the LR of an uninterrupted run of that length), the same volumes and
  crops (the loader is reseeded per (seed, epoch, rank): ``components.ReseedEachEpoch``) and the same weights.
- After a mid-epoch restart the run continues that epoch's volumes and the schedule, and ``model.pt`` stays
  byte-identical when the validation after the restart is worse than the stored best.

``ReseedEachEpoch`` itself is tested first, without a bundle (fast).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from ignite.engine import Engine, Events
from monai.data import DataLoader, Dataset
from monai.data.utils import set_rnd
from monai.networks.layers import DropPath
from monai.transforms import RandSpatialCropd

from components import ReseedEachEpoch, write_dataset
from components.demo.runner import BUNDLES_DIR
from tests.probes import read_crops, read_lr, read_volumes
from tests.test_pretrain_bundle import TINY as SSL_TINY
from tests.test_pretrain_bundle import _run

PER_EPOCH = 2  # 2 training volumes, one per batch
FINETUNE_TINY = {
    "roi_size": [64, 32, 32],  # SwinUNETR's bottleneck InstanceNorm needs 2x1x1 voxels in training
    "feature_size": 12,
    "training#num_samples": 1,
    "batch_size": 1,
    "loader#num_workers": 0,
    "training#warmup_epochs": 1,  # within the tiny runs, so that the schedule's end (max_epochs) matters
    "training#val_interval": 1,
    "training#log_interval": 1,
    "device": "cpu",
    "speed#amp": False,
    "speed#use_checkpoint": False,
}


@dataclass(frozen=True)
class Bundle:
    """One training bundle as these tests run it.

    Args:
        name: its folder under ``bundles/``.
        kind: the synthetic data it trains on (``components.write_dataset``).
        overrides: its tiny settings.
        warmup_iterations: the LR warm-up of those settings, in iterations.
        metric: the validation key metric that picks ``model.pt``; None where no validation picks a best model
            (the self-distillation bundle exports its final teacher).
        higher_is_better: the metric's direction (Dice: higher; an error: lower).
    """

    name: str
    kind: str
    overrides: dict = field(repr=False)
    warmup_iterations: int
    metric: str | None = None
    higher_is_better: bool = False

    @property
    def beaten(self) -> float:
        """A stored best that any validation beats: below every Dice, above every error."""
        return -1.0 if self.higher_is_better else 1e9

    @property
    def unbeatable(self) -> float:
        """A stored best that no validation beats (only a strictly better one replaces model.pt): the best value
        the metric can take, a perfect Dice or a zero error."""
        return 1.0 if self.higher_is_better else 0.0

    @property
    def learning_rate(self) -> float:
        return float(json.loads((BUNDLES_DIR / self.name / "configs" / "train.json").read_text())["learning_rate"])


MIM_TINY = {**SSL_TINY, "network_def#window_size": 4, "training#rankme_crops": 4}
# the masked-token self-distillation with schedules constant over max_epochs (as the self-distillation bundle's
# here), so that a longer run's first epoch trains as a shorter one's
MIM_DISTILL = {"masking#distill_weight": 1.0, "masking#distill_prototypes": 32, "masking#head_hidden_dim": 24,
               "masking#head_bottleneck_dim": 8, "masking#momentum": [0.996, 0.996],
               "masking#teacher_temperature_warmup_epochs": 0}  # fmt: skip

BUNDLES = [
    Bundle("swin_unetr_ssl_pretrain", "ct", SSL_TINY, SSL_TINY["training#warmup_iterations"], "val_recon_l1"),
    Bundle(
        "swin_unetr_dino_pretrain",
        "ct",
        {
            "roi_size": [32, 32, 32],
            "training#context_size": [48, 48, 48],
            "training#local_size": [32, 32, 32],
            "training#num_local_crops": 1,
            "feature_size": 12,
            "training#prototypes": 32,
            "training#head_hidden_dim": 24,
            "training#head_bottleneck_dim": 8,
            "batch_size": 1,
            "training#num_samples": 2,  # KoLeo needs 2 crops per step
            "training#warmup_epochs": 1,
            "training#teacher_temperature_warmup_epochs": 1,
            # the recipe's own schedules span max_epochs: constant here, so that the first epoch of a longer run
            # trains as that of a shorter one (as the LR warm-up does)
            "training#momentum": [0.996, 0.996],
            "training#weight_decay": [0.04, 0.04],
            "training#log_interval": 1,
            "loader#num_workers": 0,
            "device": "cpu",
            "speed#amp": False,
            "speed#use_checkpoint": False,
        },
        PER_EPOCH,
    ),
    Bundle("swin_unetr_mim_pretrain", "ct", MIM_TINY, MIM_TINY["training#warmup_iterations"], "val_masked_l1"),
    Bundle("swin_unetr_mim_pretrain", "ct", {**MIM_TINY, **MIM_DISTILL}, MIM_TINY["training#warmup_iterations"],
           "val_masked_l1"),
    Bundle("swin_unetr_btcv_finetune", "ct", {**FINETUNE_TINY, "spacing": [3.0, 3.0, 4.0]}, PER_EPOCH,
           "val_mean_dice", higher_is_better=True),
    Bundle("swin_unetr_brats_finetune", "mri", {**FINETUNE_TINY, "spacing": [2.0, 2.0, 2.0]}, PER_EPOCH,
           "val_mean_dice", higher_is_better=True),
    Bundle("swin_unetr_ssl_pretrain", "ct", {**SSL_TINY, "loader#cache": "disk"}, SSL_TINY["training#warmup_iterations"],
           "val_recon_l1"),
    # the store read by two loader workers, kept for the run and reseeded per epoch (PersistentWorkerLoader)
    Bundle("swin_unetr_ssl_pretrain", "ct", {**SSL_TINY, "loader#cache": "disk", "loader#num_workers": 2},
           SSL_TINY["training#warmup_iterations"], "val_recon_l1"),
]
IDS = ["ssl", "dino", "mim", "mim_distill", "btcv", "brats", "ssl_disk", "ssl_disk_workers"]


def _overrides(bundle: Bundle, data: Path) -> dict:
    """The bundle's tiny settings on ``data``; with ``loader#cache`` "disk", the store of ``data`` for those
    settings' deterministic transforms, written once beside the data."""
    overrides = {**bundle.overrides, "dataset_dir": str(data)}
    if overrides.get("loader#cache") != "disk":
        return overrides
    from components.data.store import bundle_transforms, preprocess

    store = data / f"store_{bundle.name}"
    if not (store / "index.json").is_file():
        transforms = bundle_transforms(BUNDLES_DIR / bundle.name, {k: v for k, v in bundle.overrides.items() if k == "roi_size"})
        preprocess(data / "dataset.json", store, transforms)
    return {**overrides, "loader#store": str(store)}


def _epoch_crops(first_epoch: int, build_seed: int, reseed: bool) -> dict[int, list[torch.Tensor]]:
    """The crops of every epoch of a 2-epoch ignite run over 2 volumes that starts at ``first_epoch`` (2: as a run
    resumed at the epoch boundary does), its random crop seeded with ``build_seed`` when built, with or without
    ``ReseedEachEpoch(seed=7)``."""
    volumes = [{"image": torch.arange(512.0).reshape(1, 8, 8, 8) + 1000 * i} for i in range(2)]
    crop = RandSpatialCropd(keys="image", roi_size=(2, 2, 2), random_size=False)
    loader = DataLoader(Dataset(volumes, crop), batch_size=1, generator=torch.Generator())
    set_rnd(crop, build_seed)  # after MONAI's DataLoader seeded it from its generator
    engine = Engine(lambda engine, batch: batch["image"])
    if reseed:
        ReseedEachEpoch(seed=7).attach(engine)

    def resume(engine: Engine) -> None:  # what ResumeHandler sets at STARTED
        engine.state.epoch, engine.state.iteration = first_epoch - 1, (first_epoch - 1) * len(loader)

    seen: dict[int, list[torch.Tensor]] = {}
    engine.add_event_handler(Events.STARTED, resume)

    @engine.on(Events.ITERATION_COMPLETED)
    def record(engine: Engine) -> None:
        seen.setdefault(engine.state.epoch, []).append(engine.state.output)

    engine.run(loader, max_epochs=2)
    return seen


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_reseed_each_epoch_makes_the_crops_a_function_of_seed_and_epoch():
    """With ReseedEachEpoch, epoch 2 draws the same crops whether the run started at epoch 1 or was resumed at
    epoch 2, and epoch 1 draws the same crops whatever random state the transforms were built with: the handler runs
    before the epoch's first batch. Without it (MONAI seeds the transforms once, when built), both differ."""
    uninterrupted = _epoch_crops(first_epoch=1, build_seed=0, reseed=True)
    assert _same(_epoch_crops(first_epoch=2, build_seed=0, reseed=True)[2], uninterrupted[2])
    assert _same(_epoch_crops(first_epoch=1, build_seed=123, reseed=True)[1], uninterrupted[1])
    assert not _same(uninterrupted[1], uninterrupted[2])  # each epoch its own crops

    plain = _epoch_crops(first_epoch=1, build_seed=0, reseed=False)
    assert not _same(_epoch_crops(first_epoch=2, build_seed=0, reseed=False)[2], plain[2])
    assert not _same(_epoch_crops(first_epoch=1, build_seed=123, reseed=False)[1], plain[1])


def _epoch_drop_path_masks(first_epoch: int, device: str) -> dict[int, torch.Tensor]:
    """The drop-path mask (MONAI's DropPath, p 0.5, in training mode) the network draws in each epoch of a 2-epoch
    run on ``device`` that starts at ``first_epoch``, after a different random history for each start."""
    drop = DropPath(0.5).train()
    torch.manual_seed(first_epoch)  # another history before the run
    if device == "cuda":
        torch.cuda.manual_seed(first_epoch)
    engine = Engine(lambda engine, batch: drop(torch.ones(16, 1, device=device)).flatten().cpu())
    ReseedEachEpoch(seed=7).attach(engine)
    engine.add_event_handler(Events.STARTED, lambda e: setattr(e.state, "epoch", first_epoch - 1))
    masks: dict[int, torch.Tensor] = {}
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: masks.setdefault(e.state.epoch, e.state.output))
    engine.run([0], max_epochs=2)
    return masks


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_reseed_each_epoch_reseeds_the_networks_own_draws(device):
    """The student's drop-path draws from the device's generator: a run resumed at epoch 2 draws epoch 2's masks as
    the uninterrupted run does (on a GPU: the CUDA generator is reseeded too)."""
    uninterrupted, resumed = _epoch_drop_path_masks(1, device), _epoch_drop_path_masks(2, device)
    assert torch.equal(resumed[2], uninterrupted[2])
    assert not torch.equal(uninterrupted[1], uninterrupted[2])


@pytest.mark.parametrize("seed", ["1", 1.0, True, None])
def test_reseed_each_epoch_wants_an_integer_seed(seed):
    with pytest.raises(ValueError, match=f"seed must be an integer, got {re.escape(repr(seed))}"):
        ReseedEachEpoch(seed)


@pytest.fixture(scope="module", autouse=True)
def one_thread_runs():
    """The bundle runs use one OpenMP thread: two runs of the same iterations then compute bitwise the same weights
    (measured: with two threads two identical BTCV runs already differ in the last bits, from the order of parallel
    sums), and a shared 2-core machine is not oversubscribed."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def small_data(tmp_path_factory):
    """The synthetic dataset of a kind ("ct", "mri"), written once: 2 training volumes, 1 validation, 1 test."""
    written: dict[str, Path] = {}

    def of_kind(kind: str) -> Path:
        if kind not in written:
            written[kind] = tmp_path_factory.mktemp(f"restart_{kind}")
            write_dataset(written[kind], kind=kind, num=4, seed=1)
        return written[kind]

    return of_kind


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, small_data):
    """A bundle's uninterrupted 2-epoch run, run once for both tests: (its copy, its probe's record)."""
    done: dict[str, tuple[Path, Path]] = {}

    def of_bundle(bundle: Bundle) -> tuple[Path, Path]:
        key = IDS[BUNDLES.index(bundle)]
        if key not in done:
            tmp = tmp_path_factory.mktemp(f"uninterrupted_{key}")
            root, log = _bundle_copy(tmp, bundle), tmp / "straight.lr"
            _run(root, {**_overrides(bundle, small_data(bundle.kind)), "max_epochs": 2},
                 extra=_probe(bundle, log))  # fmt: skip
            done[key] = root, log
        return done[key]

    return of_bundle


def _bundle_copy(tmp: Path, bundle: Bundle) -> Path:
    root = tmp / bundle.name
    shutil.copytree(BUNDLES_DIR / bundle.name, root, ignore=shutil.ignore_patterns("models", "eval", "data"))
    return root


def _probe(bundle: Bundle, log: Path, stop: str | None = None, scramble: bool = False) -> dict:
    """An extra config: the bundle's own ``run`` (its start: checks, seed) with, before its last step (the training),
    a record of every iteration to ``log`` (tests.probes.record_lr); ``stop`` ends the run early; ``scramble``
    reseeds the built transforms with an unrelated seed before the run starts."""
    *start, train = json.loads((BUNDLES_DIR / bundle.name / "configs" / "train.json").read_text())["run"]
    probe = ["$import tests.probes as probes", f"$probes.record_lr(@train#trainer, {str(log)!r})"]
    if scramble:
        probe.append("$probes.scramble_random_state(@train#dataloader)")
    if stop:
        probe.append(f"$probes.{stop}")
    return {"run": [*start, *probe, train]}


def _schedule(bundle: Bundle, max_epochs: int) -> dict[int, float]:
    """The LR after each iteration of an uninterrupted run: the bundles' WarmupCosineSchedule (their learning_rate,
    the tiny warm-up, t_total = max_epochs x iterations per epoch), stepped once per iteration."""
    from monai.optimizers import WarmupCosineSchedule

    optimizer = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=bundle.learning_rate)
    schedule = WarmupCosineSchedule(optimizer, warmup_steps=bundle.warmup_iterations, t_total=max_epochs * PER_EPOCH)
    lrs = {}
    for iteration in range(1, max_epochs * PER_EPOCH + 1):
        optimizer.step()
        schedule.step()
        lrs[iteration] = optimizer.param_groups[0]["lr"]
    return lrs


def _set_best(checkpoint: Path, value: float) -> None:
    """Stands for a stored best that the next validation cannot beat (or cannot fail to beat)."""
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    state["best_metric"] = value
    torch.save(state, checkpoint)


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _adam_step_bound(step: int, betas: tuple[float, float]) -> float:
    """The most one Adam(W) step can move an element, in units of the LR: max |m_hat / sqrt(v_hat)| over every
    gradient sequence of ``step`` steps (Cauchy-Schwarz on the two exponential averages; eps only lowers it)."""
    beta1, beta2 = betas
    ratio = sum(beta1 ** (2 * k) / beta2**k for k in range(step)) ** 0.5
    return (1 - beta1) / (1 - beta1**step) * ((1 - beta2**step) / (1 - beta2)) ** 0.5 * ratio


# tensors of the SSL head whose true gradient is zero at its tiny ROI (64x32x32): the decoder biases right before an
# InstanceNorm (it removes any constant), and the first decoder conv, whose InstanceNorm normalises the 2x1x1
# bottleneck: two voxels normalise to -1 and +1 whatever the weights, so its gradient is rounding noise, which Adam
# turns into steps
ZERO_GRADIENT = re.compile(r"conv\.0\.weight|conv\.(0|4|8|12|16)\.bias")


def _assert_same_training(a: dict, b: dict, reference: dict, lrs: dict[int, float]) -> None:
    """Two runs of the same iterations in different processes agree up to floating-point rounding.

    Bitwise equality across processes is not guaranteed on CPU (memory alignment changes how vectorised
    reductions round), and Adam divides each gradient by its own running scale: an element whose true gradient
    is at the level of that rounding noise moves by up to a whole step in either direction. So the tolerances come
    from the optimizer, not from a guess:

    - every element: |a - b| <= 2 x sum_t lr_t x max|m_hat_t / sqrt(v_hat_t)| (both runs start from the same
      initialisation; AdamW's decay, a factor 1 - lr x wd <= 1, only shrinks a difference), with the LRs the
      runs logged;
    - the update of epoch 2 (from the epoch-1 state ``reference``) of every tensor with a true gradient
      (not ``ZERO_GRADIENT``): ||update_a - update_b|| < 1e-2 x ||update_a||. Rounding changes only the few
      elements whose gradient is at its level (repeated runs: at most 1.9e-3 even with conv.0.weight included,
      most runs bitwise equal); a resume that loses or misplaces state (weights, Adam moments, the schedule)
      changes every element's update by a fraction of order one."""
    betas = torch.optim.AdamW([torch.zeros(1)]).defaults["betas"]
    bound = 2 * sum(lr * _adam_step_bound(step, betas) for step, lr in sorted(lrs.items()))
    floats = [k for k in a if a[k].is_floating_point()]
    worst = max(floats, key=lambda k: float((a[k] - b[k]).abs().max()))
    assert float((a[worst] - b[worst]).abs().max()) <= bound, f"{worst} differs by more than Adam can move it ({bound})"
    keys = [k for k in floats if not ZERO_GRADIENT.fullmatch(k)]
    update_a = torch.cat([(a[k] - reference[k]).flatten() for k in keys])
    update_b = torch.cat([(b[k] - reference[k]).flatten() for k in keys])
    assert torch.linalg.vector_norm(update_a - update_b) < 1e-2 * torch.linalg.vector_norm(update_a)


def _assert_same_state(bundle: Bundle, a: dict, b: dict, reference: dict, lrs: dict[int, float]) -> None:
    """The trained state of two runs of the same iterations: bitwise equal for the finetuning and self-distillation
    bundles (on CPU with one thread, as measured), the SSL model up to the rounding :func:`_assert_same_training`
    bounds."""
    if bundle.name == "swin_unetr_ssl_pretrain":
        _assert_same_training(a["model"], b["model"], reference=reference["model"], lrs=lrs)
        return
    for entry in ("model", "recipe"):
        if entry in a:
            different = [k for k in a[entry] if not torch.equal(a[entry][k], b[entry][k])]
            assert not different, f"{entry}: {len(different)} tensors differ, e.g. {different[:3]}"


@pytest.mark.slow
@pytest.mark.parametrize("bundle", BUNDLES, ids=IDS)
def test_resume_follows_max_epochs_and_reproduces_the_uninterrupted_run(tmp_path, small_data, uninterrupted, bundle):
    """Shorter: 1 epoch of a 4-epoch schedule, resumed with max_epochs 2, equals 2 uninterrupted epochs (weights,
    every LR, every batch's volumes and crops; the first epoch's crops too, though the transforms' random state was
    scrambled after the bundle built them: the crops depend on the seed alone). Longer: those 2 epochs resumed with
    max_epochs 4 follow the 4-epoch schedule at every iteration, and the first validation better than the stored
    best replaces model.pt."""
    common = {**_overrides(bundle, small_data(bundle.kind)), "max_epochs": 2}
    straight, straight_log = uninterrupted(bundle)

    resumed = _bundle_copy(tmp_path / "resumed", bundle)
    first_epoch = _probe(bundle, tmp_path / "resumed.lr", "stop_after_epoch(@train#trainer, 1)", scramble=True)
    _run(resumed, {**common, "max_epochs": 4}, extra=first_epoch)
    ckpt = resumed / "models" / "checkpoint.pt"
    first = _load(ckpt)
    assert first["trainer"]["iteration"] == 2
    output = _run(resumed, {**common, "checkpointing#resume": str(ckpt)}, extra=_probe(bundle, tmp_path / "resumed.lr"))
    assert f"with this run's settings {{'warmup_steps': {bundle.warmup_iterations}, 't_total': 4}}" in output

    lr_straight, lr_resumed = read_lr(straight_log), read_lr(tmp_path / "resumed.lr")
    assert lr_straight == _schedule(bundle, 2)  # the bundle follows the schedule here
    assert sorted(lr_resumed) == [1, 2, 3, 4]
    assert lr_resumed == lr_straight  # warm-up did not restart; t_total is this run's, not the 4 epochs' saved one
    assert read_volumes(tmp_path / "resumed.lr") == read_volumes(straight_log)
    crops = read_crops(straight_log)
    assert read_crops(tmp_path / "resumed.lr") == crops and len(set(crops.values())) == 4
    a, b = _load(straight / "models" / "checkpoint.pt"), _load(ckpt)
    assert a["trainer"] == b["trainer"]
    _assert_same_state(bundle, a, b, reference=first, lrs=lr_straight)

    # longer: the 2 epochs of max_epochs 2 resumed with max_epochs 4
    if bundle.metric is not None:
        assert b["best_metric"] == pytest.approx(a["best_metric"], rel=1e-4)
        best_before = (resumed / "models" / "model.pt").read_bytes()
        _set_best(ckpt, bundle.beaten)
    output = _run(resumed, {**common, "max_epochs": 4}, extra=_probe(bundle, tmp_path / "longer.lr"))  # auto_resume
    longer = read_lr(tmp_path / "longer.lr")
    assert sorted(longer) == [5, 6, 7, 8]
    assert longer == {it: lr for it, lr in _schedule(bundle, 4).items() if it > 4}
    assert longer[5] > longer[6] > longer[7] > longer[8] == 0.0  # down to 0 at the new end, not back up after the old
    if bundle.metric is not None:
        final = _load(ckpt)
        assert final["best_metric"] != bundle.beaten and final["best_metric_epoch"] in (3, 4)
        assert final["best_metric_iteration"] == PER_EPOCH * final["best_metric_epoch"]
        assert (resumed / "models" / "model.pt").read_bytes() != best_before  # a strictly better validation replaced it
        stored = f"{bundle.beaten} (epoch {b['best_metric_epoch']}, iteration {b['best_metric_iteration']})"
        assert f"restored best {bundle.metric} {stored}" in output


@pytest.mark.slow
@pytest.mark.parametrize("bundle", BUNDLES, ids=IDS)
def test_restart_mid_epoch_continues_the_epoch_and_keeps_the_better_stored_model(tmp_path, small_data, uninterrupted,
                                                                                  bundle):
    """Stopped after iteration 3 (the first of epoch 2) and restarted: the iteration count, the schedule and the
    volumes seen continue those of the uninterrupted run; the validation after the restart is worse than the stored
    best, so model.pt stays byte-identical and the logged best is the stored one."""
    common = {**_overrides(bundle, small_data(bundle.kind)), "max_epochs": 2,
              "checkpointing#iteration_interval": 1}  # fmt: skip
    _, reference = uninterrupted(bundle)
    root = _bundle_copy(tmp_path / "mid", bundle)
    _run(root, common, extra=_probe(bundle, tmp_path / "mid.lr", "stop_after_iteration(@train#trainer, 3)"))
    ckpt = root / "models" / "checkpoint.pt"
    saved = _load(ckpt)
    assert saved["trainer"]["iteration"] == 3 and saved["sampler"]["position"] == 1
    if bundle.metric is not None:
        _set_best(ckpt, bundle.unbeatable)
        best_before = (root / "models" / "model.pt").read_bytes()
    output = _run(root, {**common, "checkpointing#resume": str(ckpt)}, extra=_probe(bundle, tmp_path / "mid.lr"))
    lrs, volumes = read_lr(tmp_path / "mid.lr"), read_volumes(tmp_path / "mid.lr")
    assert [it for it, _ in volumes] == [1, 2, 3, 4]  # the iteration count continues
    assert lrs == read_lr(reference)  # and so does the schedule: no new warm-up
    expected = read_volumes(reference)
    assert volumes == expected and volumes[3][1] != volumes[2][1]  # the rest of epoch 2, not its head again
    assert "Epoch: 2/2, Iter: 2/2" in output
    assert "continue the epoch's order from sample 1" in output
    if bundle.metric is not None:
        assert (root / "models" / "model.pt").read_bytes() == best_before
        assert f"Key metric: {bundle.metric} best value: {bundle.unbeatable} at epoch: 1" in output
        final = _load(ckpt)
        best = (final["best_metric"], final["best_metric_epoch"], final["best_metric_iteration"])
        assert best == (bundle.unbeatable, 1, 2)
