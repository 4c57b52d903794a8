"""The self-distillation recipe on the recipe-agnostic trainer: views, loss, schedules, the teacher, the collapse
stop, resume equality and (2 gloo processes) the DDP equalities of shared/notes/distributed-pitfalls.md."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ignite.engine import Engine, Events
from monai.networks.layers import DropPath
from monai.networks.nets.swin_unetr import WindowAttention
from scipy.ndimage import gaussian_filter
from torch.utils._python_dispatch import TorchDispatchMode

from components import (
    MultiCrop,
    PretrainingTrainer,
    ResumableCheckpointSaver,
    ResumeHandler,
    SelfDistillationLoss,
    SelfDistillationNetwork,
    SelfDistillationRecipe,
    StopOnCollapse,
    TeacherCollapseError,
    use_fused_attention,
    weight_decay_groups,
)
from components.recipes.self_distillation import check_koleo_batch, gaussian_blur, koleo_loss
from tests.ranks import run_scenario
from tests.test_engine import _one_thread  # noqa: F401 (autouse fixture: one thread here too)

K = 32  # prototypes of the tiny head
WORLD = 2
LAUNCH_TIMEOUT_S = 240
UNEQUAL_SHARDS = (slice(0, 3), slice(3, 4))  # the volumes of a global batch of 4 on rank 0 and rank 1


def _student(seed: int = 0, drop_path: float = 0.0) -> SelfDistillationNetwork:
    """A tiny student; window 4 tiles the 16^3 tokens of a 32^3 crop (window 7 pads them to 21^3: ~8x slower)."""
    torch.manual_seed(seed)
    return SelfDistillationNetwork(feature_size=12, out_dim=K, hidden_dim=24, bottleneck_dim=8, window_size=4,
                                   dropout_path_rate=drop_path)  # fmt: skip


def _recipe(
    student, total_iterations: int = 4, koleo: float = 0.0, equal_rank_batches: bool = False, **kwargs
) -> SelfDistillationRecipe:
    views = MultiCrop((32, 32, 32), (32, 32, 32), num_local=1)
    loss = SelfDistillationLoss(K, koleo_weight=koleo, equal_rank_batches=equal_rank_batches)
    return SelfDistillationRecipe(student, loss, views, total_iterations=total_iterations, **kwargs)


def _batches(n: int, volumes: int = 1, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"image": torch.rand(volumes, 1, 40, 40, 40, generator=g)} for _ in range(n)]


def _trainer(student, recipe, loader, max_epochs: int = 1, handlers=None, network=None) -> PretrainingTrainer:
    optimizer = torch.optim.AdamW(weight_decay_groups(student, 0.04), lr=1e-3)
    return PretrainingTrainer(
        device="cpu", max_epochs=max_epochs, train_data_loader=loader, network=network or student,
        optimizer=optimizer, recipe=recipe, train_handlers=handlers, seed=5,
    )  # fmt: skip


# ------------------------------------------------------------------------------------------------ pieces


def test_multi_crop_views_shapes_order_and_replay():
    crop = MultiCrop((32, 32, 32), (32, 32, 32), num_local=3, global_scale=(0.5, 1.0), local_scale=(0.05, 0.2))
    x = torch.rand(2, 1, 48, 40, 56)
    views = crop(x, torch.Generator().manual_seed(1))
    assert views.global_crops.shape == (4, 1, 32, 32, 32) and views.local_crops.shape == (6, 1, 32, 32, 32)
    again = crop(x, torch.Generator().manual_seed(1))
    assert torch.equal(views.global_crops, again.global_crops) and torch.equal(views.local_crops, again.local_crops)
    assert not torch.equal(views.global_crops[0], views.global_crops[2])  # two global crops of volume 0 differ
    with pytest.raises(ValueError, match="multiples of 32"):
        MultiCrop((32, 32, 32), (24, 24, 24))


def test_multi_crop_boxes_from_the_host_generator_need_no_device_read():
    """On the meta device any read of a value fails: with a CPU host_generator the boxes never come from it. On
    the CPU the host generator's crops equal the ones the same stream draws as the device generator."""
    crop = MultiCrop((32, 32, 32), (32, 32, 32), num_local=2)
    views = crop(torch.empty(2, 1, 48, 48, 48, device="meta"), None, torch.Generator().manual_seed(3))
    assert views.global_crops.shape == (4, 1, 32, 32, 32) and views.global_crops.device.type == "meta"
    x = torch.rand(2, 1, 48, 40, 56)
    crops_only = MultiCrop((32, 32, 32), (32, 32, 32), num_local=2, intensity_scale=0.0, intensity_shift=0.0,
                           contrast_prob=0.0, noise_prob=0.0, flip_prob=0.0, global_blur_prob=(0.0, 0.0),
                           global_solarize_prob=(0.0, 0.0), local_blur_prob=0.0)  # fmt: skip
    from_host = crops_only(x, torch.Generator().manual_seed(9), torch.Generator().manual_seed(3))
    from_device = crops_only(x, torch.Generator().manual_seed(3))
    assert torch.equal(from_host.global_crops, from_device.global_crops)
    assert torch.equal(from_host.local_crops, from_device.local_crops)


def _ramp_with_a_cube(size: int = 32) -> torch.Tensor:
    """A (1, 1, size^3) volume of range exactly [0, 1]: a ramp along the first axis plus a bright cube (sharp edges
    to blur)."""
    x = torch.linspace(0.0, 0.6, size).view(size, 1, 1).expand(size, size, size).clone()
    x[8:20, 10:22, 6:18] += 0.4
    return ((x - x.min()) / (x.max() - x.min()))[None, None]


def test_global_crop_1_is_blurred_and_global_crop_2_solarised():
    """DINO's asymmetric augmentations, here with probabilities 1 / 0 and every other augmentation off: global crop 1
    is the input smoothed by a Gaussian of sigma 1 voxel (scipy's filter as reference), global crop 2 the input with
    the intensities of the upper half of its range inverted; neither gets the other's augmentation."""
    x = _ramp_with_a_cube()
    crop = MultiCrop((32, 32, 32), (32, 32, 32), num_local=1, global_scale=(1.0, 1.0), local_scale=(1.0, 1.0),
                     flip_prob=0.0, intensity_scale=0.0, intensity_shift=0.0, contrast_prob=0.0, noise_prob=0.0,
                     global_blur_prob=(1.0, 0.0), global_solarize_prob=(0.0, 1.0), local_blur_prob=0.0,
                     blur_sigma=(1.0, 1.0))  # fmt: skip
    first, second = crop(x, torch.Generator().manual_seed(0)).global_crops
    blurred = torch.from_numpy(gaussian_filter(x[0, 0].double().numpy(), sigma=1.0, mode="nearest", truncate=3.0))
    torch.testing.assert_close(first[0].double(), blurred, rtol=0, atol=1e-6)
    assert (first - x[0]).abs().max() > 0.1  # the cube's edges did move
    torch.testing.assert_close(second, torch.where(x[0] >= 0.5, 1.0 - x[0], x[0]), rtol=0, atol=1e-6)
    assert second.max() <= 0.5 + 1e-6 and not torch.equal(second, x[0])


def test_gaussian_blur_gives_each_crop_its_own_sigma_and_sigma_0_is_the_identity():
    x = torch.rand(3, 2, 20, 16, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    y = gaussian_blur(x, torch.tensor([2.0, 0.5, 0.0], dtype=torch.float64), radius=6)
    for i, sigma in ((0, 2.0), (1, 0.5)):
        for c in range(2):
            reference = gaussian_filter(x[i, c].numpy(), sigma=sigma, mode="nearest", truncate=6 / sigma)
            torch.testing.assert_close(y[i, c], torch.from_numpy(reference), rtol=0, atol=1e-12)
    assert torch.equal(y[2], x[2])


def test_multi_crop_needs_one_blur_and_solarisation_probability_per_global_crop():
    with pytest.raises(ValueError, match=r"global_blur_prob needs one probability per global crop \(num_global=3"):
        MultiCrop((32, 32, 32), (32, 32, 32), num_global=3)
    with pytest.raises(ValueError, match=r"global_solarize_prob\[1\] must lie in \[0, 1\], got 1.5"):
        MultiCrop((32, 32, 32), (32, 32, 32), global_solarize_prob=(0.0, 1.5))
    three = MultiCrop((32, 32, 32), (32, 32, 32), num_global=3, num_local=0, global_blur_prob=(1.0, 0.1, 0.5),
                      global_solarize_prob=(0.0, 0.2, 0.0))  # fmt: skip
    views = three(torch.rand(2, 1, 40, 40, 40), torch.Generator())
    assert views.global_crops.shape == (6, 1, 32, 32, 32) and views.local_crops.shape[0] == 0


def test_loss_is_the_mean_cross_entropy_over_pairs_and_updates_the_centre():
    torch.manual_seed(0)
    b, g, v = 3, 2, 4
    student, teacher = torch.randn(v * b, K), torch.randn(g * b, K)
    loss = SelfDistillationLoss(K, student_temperature=0.1, center_momentum=0.9)
    loss.center.fill_(0.5)
    total, parts = loss(student, teacher, teacher_temperature=0.04, num_global=g)
    q = torch.softmax((teacher - 0.5) / 0.04, dim=-1).chunk(g)
    logp = torch.log_softmax(student / 0.1, dim=-1).chunk(v)
    pairs = [(-q[t] * logp[s]).sum(-1).mean() for t in range(g) for s in range(v) if s != t]
    assert len(pairs) == g * (v - 1)
    torch.testing.assert_close(total, torch.stack(pairs).mean())
    torch.testing.assert_close(loss.center, 0.9 * 0.5 + 0.1 * teacher.mean(0, keepdim=True))
    log_q = torch.log_softmax((teacher - 0.5) / 0.04, dim=-1)
    entropy = -(log_q.exp() * log_q).sum(-1).mean()
    torch.testing.assert_close(loss.stats["teacher_entropy"], entropy / math.log(K), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss.stats["kl"], total - entropy, rtol=1e-4, atol=1e-6)


def test_koleo_uses_the_nearest_other_sample():
    z = torch.tensor([[1.0, 0.0], [0.8, 0.6], [-1.0, 0.0]])
    d01 = (z[0] - z[1]).norm()
    expected = -(torch.log(d01) * 2 + torch.log((z[2] - z[1]).norm())) / 3
    torch.testing.assert_close(koleo_loss(z), expected)


# aten ops that make the host wait for a GPU: a read of a device value (item, nonzero, masked_select) or an assignment
# through index tensors (index_put_: ``t[rows, rows] = -2.0`` copied the Python value from the host, and
# sync_debug_mode "error" stopped the self-distillation step on an H200)
SYNCHRONISING_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "index_put", "index_put_", "_index_put_impl_"}


class OpNames(TorchDispatchMode):
    """Records the names of the aten ops run while active (``aten.index_put_.default`` -> ``index_put_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def test_the_loss_with_koleo_runs_no_op_that_synchronises_a_gpu():
    """Forward and backward of the loss with KoLeo, on the CPU: none of the ops that stall a GPU step (the CUDA
    test in test_host_sync.py sees them on a GPU; this one fails on any machine if one comes back)."""
    g = torch.Generator().manual_seed(0)
    student = torch.randn(4 * 3, K, generator=g, requires_grad=True)
    embeddings = torch.randn(4 * 3, 16, generator=g, requires_grad=True)
    with OpNames() as ops:
        total, _ = SelfDistillationLoss(K, koleo_weight=0.1)(student, torch.randn(2 * 3, K, generator=g), 0.04, 2,
                                                           student_embeddings=embeddings)  # fmt: skip
        total.backward()
    assert {"mm", "_log_softmax"} <= ops.names  # the mode saw the loss's ops
    assert not ops.names & SYNCHRONISING_OPS, ops.names & SYNCHRONISING_OPS


def test_koleo_is_the_sum_over_the_global_crops_of_each_crops_own_term_times_the_weight():
    """DINOv2: KoLeo of the student's embeddings of global crop 1, plus that of global crop 2, times the weight
    (not their mean, and not over the two crops together)."""
    g = torch.Generator().manual_seed(0)
    b, v = 3, 4
    student, teacher = torch.randn(v * b, K, generator=g), torch.randn(2 * b, K, generator=g)
    embeddings = torch.randn(v * b, 16, generator=g)
    total, parts = SelfDistillationLoss(K, koleo_weight=0.1)(student, teacher, 0.04, 2, student_embeddings=embeddings)
    dino, _ = SelfDistillationLoss(K)(student, teacher, 0.04, 2)
    expected = koleo_loss(embeddings[:b]) + koleo_loss(embeddings[b : 2 * b])
    torch.testing.assert_close(parts["koleo"], expected)
    torch.testing.assert_close(total, dino + 0.1 * expected)
    assert abs(float(parts["koleo"]) - float(koleo_loss(embeddings[: 2 * b]))) > 0.1  # the crops are not pooled


def test_koleo_on_one_volume_per_rank_fails_naming_batch_size_and_koleo_weight():
    message = r"batch_size 1 with koleo_weight 0.1: .*at least 2 volumes per rank"
    with pytest.raises(ValueError, match=message):
        check_koleo_batch(1, 0.1)
    check_koleo_batch(1, 0.0)  # KoLeo off: one volume is fine
    check_koleo_batch(2, 0.1)
    loss = SelfDistillationLoss(K, koleo_weight=0.1)
    with pytest.raises(ValueError, match=message):
        loss(torch.randn(3, K), torch.randn(2, K), 0.04, 2, student_embeddings=torch.randn(3, 16))
    assert torch.equal(loss.center, torch.zeros(1, K))  # failed before the centre moved


def test_teacher_follows_the_student_by_ema_and_gets_no_gradient():
    student = _student()
    recipe = _recipe(student, total_iterations=2, koleo=0.1, momentum=(0.9, 1.0))
    trainer = _trainer(student, recipe, _batches(1, volumes=2))
    before = {}

    def snapshot(engine):
        before["teacher"] = [p.detach().clone() for p in recipe.teacher.parameters()]

    trainer.add_event_handler(Events.ITERATION_STARTED, snapshot)
    trainer.run()
    assert all(p.grad is None and not p.requires_grad for p in recipe.teacher.parameters())
    m = recipe.momentum_at(0)
    assert m == pytest.approx(0.9)
    for old, new, s in zip(before["teacher"], recipe.teacher.parameters(), student.parameters()):
        torch.testing.assert_close(new, m * old + (1 - m) * s.detach())
    log = trainer.state.output[0]["log"]
    assert {"loss", "loss_dino", "loss_koleo", "teacher_entropy", "kl", "teacher_temperature", "momentum", "lr", "loss_dino_trivial"} == set(log)
    assert log["loss_dino_trivial"] == pytest.approx(math.log(recipe.criterion.out_dim))  # uniform targets' cross-entropy


def test_teacher_ema_is_two_foreach_kernels_equal_to_the_per_parameter_loop(monkeypatch):
    """DINOv2's EMA: one _foreach_mul_ and one _foreach_add_ per step, no per-parameter kernel; over several steps
    with a moving student and momentum it equals the loop ``t.mul_(m).add_(s, alpha=1 - m)``."""
    student = _student()
    recipe = _recipe(student, total_iterations=4, momentum=(0.9, 1.0))
    looped = [p.detach().clone() for p in recipe.teacher.parameters()]
    calls: Counter = Counter()

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in ("_foreach_mul_", "_foreach_add_"):
        monkeypatch.setattr(torch, name, counting(name, getattr(torch, name)))
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        with torch.no_grad():
            for p in student.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
        m = recipe.momentum_at(step)
        for teacher, s in zip(looped, student.parameters()):
            teacher.mul_(m).add_(s.detach(), alpha=1.0 - m)
        recipe.step = step
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "mul_", counting("mul_", torch.Tensor.mul_))
            recipe.after_step(SimpleNamespace(network=student))
    assert calls == {"_foreach_mul_": 3, "_foreach_add_": 3}
    assert len({recipe.momentum_at(s) for s in range(3)}) == 3
    for ema, loop in zip(recipe.teacher.parameters(), looped):
        torch.testing.assert_close(ema, loop, rtol=1e-6, atol=1e-7)
    assert not torch.equal(looped[0], student.swinViT.patch_embed.proj.weight)


def test_student_drops_paths_and_the_teacher_has_no_drop_path():
    """The student's stochastic depth is on in training; the teacher's copy has none (identities), so in any mode
    it computes the student's eval-mode function with the same weights."""
    student = _student(drop_path=0.1)
    recipe = _recipe(student)
    assert sum(isinstance(m, DropPath) for m in student.modules()) == 7  # linspace(0, 0.1, 8): the first block gets 0
    assert not any(isinstance(m, DropPath) for m in recipe.teacher.modules())
    assert recipe.teacher.state_dict().keys() == student.state_dict().keys()
    x = torch.rand(4, 1, 32, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    student.train()
    assert not torch.equal(student(x)[0], student(x)[0])  # paths dropped at random
    recipe.teacher.train()
    with torch.no_grad():
        teacher = recipe.teacher(x)[0]
        assert torch.equal(teacher, recipe.teacher(x)[0])
        torch.testing.assert_close(teacher, student.eval()(x)[0])


def test_a_teacher_copied_before_the_attention_switch_fails_the_start_and_a_prepared_one_matches():
    """The teacher is a copy of the network the recipe is given: given the bare network, switched to fused attention
    afterwards (what a config resolving the recipe before the network did), the run stops at its start naming the
    modules; given the prepared network, teacher and student have the same attention class and weights."""
    student = _student()
    recipe = _recipe(student)
    use_fused_attention(student)
    trainer = _trainer(student, recipe, _batches(1))
    with pytest.raises(ValueError, match=r"attn: student FusedWindowAttention, teacher WindowAttention"):
        trainer.run()
    assert trainer.state.iteration == 0
    prepared = use_fused_attention(_student())
    recipe = _recipe(prepared)
    attention = [type(m) for m in prepared.modules() if isinstance(m, WindowAttention)]
    assert [type(m) for m in recipe.teacher.modules() if isinstance(m, WindowAttention)] == attention
    assert len(attention) == 8 and attention[0] is not WindowAttention
    assert all(torch.equal(a, b) for a, b in zip(recipe.teacher.state_dict().values(), prepared.state_dict().values()))


def test_last_layer_is_frozen_in_the_first_epoch_and_weight_decay_follows_its_schedule():
    student = _student()
    recipe = _recipe(student, total_iterations=2, weight_decay=(0.04, 0.4), freeze_last_layer_epochs=1)
    last = student.head.last_layer.parametrizations.weight.original1
    start = last.detach().clone()
    trainer = _trainer(student, recipe, _batches(1), max_epochs=2)
    decays = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: decays.append(e.optimizer.param_groups[0]["weight_decay"]))
    trainer.add_event_handler(Events.EPOCH_COMPLETED(once=1), lambda e: decays.append(torch.equal(last, start)))
    trainer.run()
    assert decays[1] is True  # unchanged through epoch 1
    assert not torch.equal(last, start)  # trained in epoch 2
    expected = [0.04, 0.4 + (0.04 - 0.4) * 0.5 * (1 + math.cos(math.pi / 2))]  # cosine 0.04 -> 0.4 over 2 steps
    assert [d for d in decays if not isinstance(d, bool)] == pytest.approx(expected)
    assert trainer.optimizer.param_groups[1]["weight_decay"] == 0.0  # biases and norms never decay


def test_weight_decay_groups_give_dinov2_layer_wise_learning_rates_on_request():
    """Default: DINO's two groups (weights decayed on the schedule, biases and norms not), no learning rates of their
    own. With encoder_lr_decay 0.5 and patch_embed_lr_mult 0.2 (DINOv2: 0.9 and 0.2): the head at the learning rate,
    each encoder stage one step deeper 0.5 times slower, the patch embedding a further 0.2; every decayed group on
    the recipe's weight-decay schedule, and MONAI's warm-up-cosine schedule keeps the ratios."""
    student = _student()
    trainable = {name: p for name, p in student.named_parameters() if p.requires_grad}
    plain = weight_decay_groups(student, 0.04)
    matrices = sum(p.ndim > 1 for p in trainable.values())
    assert [(len(g["params"]), g["weight_decay"], g.get("scheduled_weight_decay", False), "lr" in g) for g in plain] == [
        (matrices, 0.04, True, False), (len(trainable) - matrices, 0.0, False, False)]  # fmt: skip

    groups = weight_decay_groups(student, 0.04, learning_rate=1e-3, encoder_lr_decay=0.5, patch_embed_lr_mult=0.2)
    expected = {"head.": 1e-3, "swinViT.layers4.": 5e-4, "swinViT.layers3.": 2.5e-4, "swinViT.layers2.": 1.25e-4,
                "swinViT.layers1.": 6.25e-5, "swinViT.patch_embed.": 3.125e-5 * 0.2}  # fmt: skip
    group_of = {id(p): g for g in groups for p in g["params"]}
    assert len(group_of) == sum(len(g["params"]) for g in groups) == len(trainable)
    for name, param in trainable.items():
        group = group_of[id(param)]
        assert group["lr"] == pytest.approx(next(lr for prefix, lr in expected.items() if name.startswith(prefix))), name
        assert group["weight_decay"] == (0.04 if param.ndim > 1 else 0.0), name
        assert group.get("scheduled_weight_decay", False) is (param.ndim > 1), name
    assert (groups[0]["lr"], groups[0]["weight_decay"]) == (1e-3, 0.04)  # the logged lr is the head's

    initial = [g["lr"] for g in groups]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    recipe = _recipe(student, total_iterations=4, weight_decay=(0.04, 0.4))
    recipe._schedule(SimpleNamespace(state=SimpleNamespace(iteration=3), optimizer=optimizer))
    decays = [g["weight_decay"] for g in optimizer.param_groups if g.get("scheduled_weight_decay")]
    assert len(decays) == 6 and decays == pytest.approx([recipe.weight_decay_at(2)] * 6)
    assert recipe.weight_decay_at(2) > 0.04
    from monai.optimizers import WarmupCosineSchedule

    schedule = WarmupCosineSchedule(optimizer, warmup_steps=2, t_total=10)
    optimizer.step()  # no gradients: nothing moves
    schedule.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)  # half-way through the warm-up
    ratios = [g["lr"] / optimizer.param_groups[0]["lr"] for g in optimizer.param_groups]
    assert ratios == pytest.approx([lr / initial[0] for lr in initial])
    with pytest.raises(ValueError, match="encoder_lr_decay 0.5 and patch_embed_lr_mult 1.0 need the learning_rate"):
        weight_decay_groups(student, 0.04, encoder_lr_decay=0.5)


def _dino_reference(student_logits, teacher_logits, center, teacher_temperature, num_global: int) -> torch.Tensor:
    """DINO's loss written out: the cross-entropy of every (teacher global crop g, student crop v != g) pair, as a
    (G, V) matrix of per-volume means whose off-diagonal entries are averaged."""
    volumes = teacher_logits.shape[0] // num_global
    targets = torch.softmax((teacher_logits - center) / teacher_temperature, dim=-1).view(num_global, volumes, -1)
    log_probs = torch.log_softmax(student_logits / 0.1, dim=-1).view(-1, volumes, student_logits.shape[-1])
    cross = -torch.einsum("gbk,vbk->gvb", targets, log_probs).mean(dim=-1)  # (G, V)
    other = ~torch.eye(num_global, log_probs.shape[0], dtype=torch.bool)
    return cross[other].mean()


def test_each_step_s_uses_and_logs_the_teacher_temperature_of_step_s_through_the_warm_up():
    """Across the warm-up (0.04 -> 0.07 over 4 iterations, then 0.07) the loss of step s takes the schedule's
    temperature at s, the one the log shows at s: the DINO loss recomputed from the step's own logits and centre with
    that temperature equals the loss the trainer got (with the next step's it would not)."""
    student = _student()
    recipe = _recipe(student, total_iterations=6, teacher_temperature=0.07, warmup_teacher_temperature=0.04,
                     teacher_temperature_warmup_iterations=4)  # fmt: skip
    schedule = [0.04, 0.0475, 0.055, 0.0625, 0.07, 0.07]
    assert [recipe.teacher_temperature_at(s) for s in range(6)] == pytest.approx(schedule, rel=1e-12)
    calls = []

    def before(module, args, kwargs):
        calls.append({"center": module.center.clone(), "args": [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]})

    def after(module, args, kwargs, output):
        calls[-1]["dino"] = output[1]["dino"].detach()

    recipe.criterion.register_forward_pre_hook(before, with_kwargs=True)
    recipe.criterion.register_forward_hook(after, with_kwargs=True)
    trainer = _trainer(student, recipe, _batches(6))
    logged = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: logged.append(e.state.output[0]["log"]["teacher_temperature"]))
    trainer.run()
    assert logged == pytest.approx(schedule, rel=1e-6) and len(calls) == 6
    for step, call in enumerate(calls):
        student_logits, teacher_logits, temperature = call["args"]
        assert temperature == pytest.approx(schedule[step], rel=1e-12), f"step {step}"
        expected = _dino_reference(student_logits, teacher_logits, call["center"], schedule[step], num_global=2)
        torch.testing.assert_close(call["dino"], expected, rtol=1e-5, atol=0, msg=lambda m: f"step {step}: {m}")
        if step < 4:  # the next step's temperature gives another loss: the check above can fail
            other = _dino_reference(student_logits, teacher_logits, call["center"], schedule[step + 1], num_global=2)
            assert abs(float(other - expected)) > 1e-3 * float(expected), f"step {step}"


# ------------------------------------------------------------------------------------------------ collapse


def test_a_collapsed_teacher_stops_the_run_with_a_clear_message():
    """A head whose bottleneck is zero gives uniform outputs; with momentum 1 the teacher never leaves them."""
    student = _student()
    with torch.no_grad():
        student.head.mlp[-1].weight.zero_()
        student.head.mlp[-1].bias.zero_()
    recipe = _recipe(student, total_iterations=3, momentum=(1.0, 1.0))
    seen = []
    trainer = _trainer(student, recipe, _batches(3), handlers=[StopOnCollapse(interval=1, patience=2)])
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(float(e.state.output[0]["log"]["teacher_entropy"])))
    with pytest.raises(TeacherCollapseError, match=r"collapsed \(the output is uniform\).*2 consecutive checks") as err:
        trainer.run()
    assert "up to iteration 2" in str(err.value)
    assert seen and all(e == pytest.approx(1.0, abs=1e-6) for e in seen)


def test_collapse_check_counts_consecutive_intervals_only():
    values = iter([0.0, 0.5, 0.0, 0.0, 0.0])
    engine = Engine(lambda e, b: [{"log": {"teacher_entropy": next(values), "kl": 0.0}}])
    StopOnCollapse(interval=1, patience=3).attach(engine)
    with pytest.raises(TeacherCollapseError, match="one prototype takes every input") as err:
        engine.run(range(5), max_epochs=1)
    assert "up to iteration 5" in str(err.value)  # 0.5 at iteration 2 reset the count


# ------------------------------------------------------------------------------------------------ resume


def _run_with_checkpoints(tmp: Path, stop_after: int | None, resume: bool) -> tuple:
    student = _student()
    recipe = _recipe(student, total_iterations=2, momentum=(0.9, 1.0), teacher_temperature=0.07,
                     teacher_temperature_warmup_iterations=2)  # fmt: skip
    optimizer = torch.optim.AdamW(weight_decay_groups(student, 0.04), lr=1e-3)
    handlers = []
    if resume:
        handlers.append(ResumeHandler(tmp / "checkpoint.pt", {"model": student, "optimizer": optimizer, "recipe": recipe}))
    handlers.append(ResumableCheckpointSaver(tmp, {"model": student, "optimizer": optimizer, "recipe": recipe}))
    trainer = PretrainingTrainer(device="cpu", max_epochs=2, train_data_loader=_batches(1), network=student,
                                 optimizer=optimizer, recipe=recipe, train_handlers=handlers, seed=5)  # fmt: skip
    logs = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: logs.append({k: float(v) for k, v in e.state.output[0]["log"].items()}))
    if stop_after:
        trainer.add_event_handler(Events.EPOCH_COMPLETED(once=stop_after), lambda e: e.terminate())
    trainer.run()
    return student, recipe, logs


def test_resume_reproduces_the_teacher_centre_and_schedules_of_an_uninterrupted_run(tmp_path):
    straight = _run_with_checkpoints(tmp_path / "a", None, False)
    _run_with_checkpoints(tmp_path / "b", 1, False)
    saved = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)
    assert saved["trainer"]["iteration"] == 1 and "criterion.center" in saved["recipe"]
    resumed = _run_with_checkpoints(tmp_path / "b", None, True)
    assert len(resumed[2]) == 1  # only epoch 2 ran
    for key in ("momentum", "teacher_temperature"):
        assert [log[key] for log in resumed[2]] == [log[key] for log in straight[2][1:]]
    assert straight[2][1]["teacher_temperature"] != straight[2][0]["teacher_temperature"]  # mid warm-up
    for key in ("loss", "teacher_entropy", "kl"):
        assert [log[key] for log in resumed[2]] == pytest.approx([log[key] for log in straight[2][1:]], rel=1e-4)
    torch.testing.assert_close(resumed[1].criterion.center, straight[1].criterion.center, rtol=1e-5, atol=1e-7)
    for (name, a), b in zip(straight[1].teacher.state_dict().items(), resumed[1].teacher.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"teacher {name}: {m}")
    for (name, a), b in zip(straight[0].state_dict().items(), resumed[0].state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"student {name}: {m}")


# ------------------------------------------------------------------------------------------------ DDP (2 ranks)


def _views(rows: slice):
    """Fixed views of a global batch of 4 volumes (2 global crops, 1 local crop each), the volumes ``rows``."""
    from components.recipes.self_distillation import MultiCropViews

    g = torch.Generator().manual_seed(7)
    global_crops = torch.rand(2, 4, 1, 32, 32, 32, generator=g)
    local_crops = torch.rand(1, 4, 1, 32, 32, 32, generator=g)
    return MultiCropViews(global_crops[:, rows].flatten(0, 1), local_crops[:, rows].flatten(0, 1))


def _gradient_step(network, student, recipe, rows: slice) -> dict:
    views = _views(rows)
    total, parts = recipe.loss(recipe.forward(network, views), views)
    total.backward()
    return {
        "grads": {n: p.grad.detach().clone() for n, p in student.named_parameters() if p.grad is not None},
        "center": recipe.criterion.center.clone(),
        "total": total.detach(),
        "parts": {k: v.detach() for k, v in parts.items()},
    }


def _scenario(rank: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    result: dict = {}
    # 1. loss, gradient and centre of one step on each rank's half of the global batch
    for key, equal in (("step", False), ("equal_step", True)):
        student = _student()
        recipe = _recipe(student, koleo=0.1, equal_rank_batches=equal)
        result[key] = _gradient_step(DDP(student), student, recipe, slice(2 * rank, 2 * rank + 2))
    # 1b. unequal shards, 3 volumes on rank 0 and 1 on rank 1 (no KoLeo: it needs 2 per rank)
    student = _student()
    result["unequal_step"] = _gradient_step(DDP(student), student, _recipe(student), UNEQUAL_SHARDS[rank])
    # 2. training with per-rank initialisations and data: the teacher after every step, on every rank
    student = _student(seed=100 + rank)  # DDP broadcasts rank 0's weights; the teacher must follow them
    recipe = _recipe(student, total_iterations=2)
    network = DDP(student)
    trainer = _trainer(student, recipe, _batches(2, seed=rank), network=network)
    teachers = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: teachers.append(
        torch.cat([p.detach().flatten() for p in recipe.teacher.parameters()]).clone()))  # fmt: skip
    trainer.run()
    result["teachers"] = teachers
    result["teacher_grads"] = [p.grad for p in recipe.teacher.parameters() if p.grad is not None]
    result["teacher_wrapped"] = isinstance(recipe.teacher, DDP) or any(isinstance(m, DDP) for m in recipe.teacher.modules())
    result["center"] = recipe.criterion.center.clone()
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_scenario(_scenario, tmp_path_factory.mktemp("sd_ranks"), WORLD, LAUNCH_TIMEOUT_S)


def _one_process(rows: slice, koleo: float = 0.1) -> dict:
    student = _student()
    return _gradient_step(student, student, _recipe(student, koleo=koleo), rows)


def test_ddp_unequal_batches_give_the_gradient_and_centre_of_the_global_batch(ranks):
    """Rank 0 with 3 volumes, rank 1 with 1: each rank's DINO term is its shard's times its rows over the mean rows
    per rank (3 / 2 and 1 / 2), so DDP's averaged gradient and the centre are those of one process on all 4."""
    whole = _one_process(slice(0, 4), koleo=0.0)
    for rank, result in enumerate(ranks):
        step = result["unequal_step"]
        shard = _one_process(UNEQUAL_SHARDS[rank], koleo=0.0)
        share = (3 / 2, 1 / 2)[rank]
        torch.testing.assert_close(step["parts"]["dino"], share * shard["parts"]["dino"], rtol=1e-5, atol=1e-6)
        assert step["grads"].keys() == whole["grads"].keys()
        for name, grad in whole["grads"].items():
            # float32 sums in another order (gloo's all-reduce; AVX2 and AVX-512 kernels differ too) move an element
            # by a share of the tensor's largest values, not of its own: the tolerance scales with the tensor, 10x
            # below the 1e-3 of it by which the unshared mean differs (asserted below)
            scale = float(grad.abs().max())
            tolerance = max(5e-7, 1e-4 * scale)
            torch.testing.assert_close(step["grads"][name], grad, rtol=1e-4, atol=tolerance, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(step["center"], whole["center"], rtol=1e-6, atol=1e-8)
    # the shards' plain mean (no share) would give another gradient: the share is what makes them equal
    shards = [_one_process(rows, koleo=0.0)["grads"] for rows in UNEQUAL_SHARDS]
    name = max(whole["grads"], key=lambda n: float(whole["grads"][n].abs().max()))
    plain = (shards[0][name] + shards[1][name]) / 2
    assert float((plain - whole["grads"][name]).abs().max()) > 1e-3 * float(whole["grads"][name].abs().max())


def test_ddp_koleo_is_each_ranks_own_and_the_centre_is_that_of_the_global_batch(ranks):
    """DINOv2's KoLeo per rank: each rank's loss (and its parts) equals one process's on the rank's own shard,
    whatever the world size, so DDP's averaged gradient is the mean of the shards' gradients; the DINO centre is
    still updated with the mean over all ranks (DINO), the centre of one process on the global batch."""
    shards = [_one_process(slice(2 * rank, 2 * rank + 2)) for rank in range(WORLD)]
    whole = _one_process(slice(0, 4))
    mean_grads = {name: torch.stack([s["grads"][name] for s in shards]).mean(0) for name in whole["grads"]}
    for rank, result in enumerate(ranks):
        for step in (result["step"], result["equal_step"]):
            torch.testing.assert_close(step["total"], shards[rank]["total"], rtol=1e-5, atol=1e-6)
            assert step["parts"].keys() == {"dino", "koleo"}
            for key, part in shards[rank]["parts"].items():
                torch.testing.assert_close(step["parts"][key], part, rtol=1e-5, atol=1e-6)
            assert step["grads"].keys() == mean_grads.keys()
            for name, grad in mean_grads.items():
                # atol 5e-7: float32 sums in another order across ranks (an AVX2-only CPU left 1.2e-7 on 2 of 36864)
                torch.testing.assert_close(step["grads"][name], grad, rtol=1e-4, atol=5e-7, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(step["center"], whole["center"], rtol=1e-6, atol=1e-8)
    assert not torch.equal(whole["center"], torch.zeros_like(whole["center"]))
    assert not torch.equal(shards[0]["center"], whole["center"])  # a shard alone would give another centre
    # the ranks' KoLeo differ from each other and from the global batch's: no gathering
    koleo = [float(r["step"]["parts"]["koleo"]) for r in ranks]
    assert abs(koleo[0] - koleo[1]) > 1e-3 and all(abs(k - float(whole["parts"]["koleo"])) > 1e-3 for k in koleo)


def test_ddp_teacher_is_identical_on_every_rank_after_every_step_and_never_gets_gradients(ranks):
    first, second = ranks
    assert len(first["teachers"]) == len(second["teachers"]) == 2
    for a, b in zip(first["teachers"], second["teachers"]):
        assert torch.equal(a, b)
    assert not torch.equal(first["teachers"][0], first["teachers"][-1])  # it did move
    assert torch.equal(first["center"], second["center"])
    for rank in ranks:
        assert rank["teacher_grads"] == [] and rank["teacher_wrapped"] is False
