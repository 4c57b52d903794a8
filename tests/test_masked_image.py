"""Masked image modelling (components.recipes.masked_image): masks, the mask token, the decoder and the masked-voxel
loss, exact under DDP."""

from __future__ import annotations

import math

import pytest
import torch

from components.recipes.masked_image import (
    MaskedImageModel,
    MaskedImageRecipe,
    MaskedReconstructionLoss,
    block_grid,
    block_masks,
    masked_views,
    normalise_blocks,
    voxel_shuffle,
)
from components.training.health import visible_fill_errors
from tests.ranks import run_scenario

TINY = {"feature_size": 12, "window_size": 4}


def test_every_volume_has_the_same_number_of_masked_blocks_drawn_from_the_generator():
    grid = (4, 4, 2)
    first = block_masks(5, grid, 0.6, torch.Generator().manual_seed(3), "cpu")
    again = block_masks(5, grid, 0.6, torch.Generator().manual_seed(3), "cpu")
    other = block_masks(5, grid, 0.6, torch.Generator().manual_seed(4), "cpu")
    assert first.shape == (5, *grid) and first.dtype == torch.bool
    assert first.flatten(1).sum(1).tolist() == [round(0.6 * 32)] * 5
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert len({tuple(m.flatten().tolist()) for m in first}) == 5  # each volume its own mask


def test_masks_at_token_and_voxel_resolution_agree():
    image = torch.rand(2, 1, 64, 32, 32)
    views = masked_views(image, torch.Generator().manual_seed(0), ratio=0.5, block_size=16, patch_size=2)
    assert views.token_mask.shape == (2, 32, 16, 16) and views.voxel_mask.shape == (2, 1, 64, 32, 32)
    # a voxel is masked exactly when its patch is
    patch_of_voxel = views.token_mask.repeat_interleave(2, 1).repeat_interleave(2, 2).repeat_interleave(2, 3)
    assert torch.equal(views.voxel_mask[:, 0], patch_of_voxel)
    assert views.voxel_mask.float().mean().item() == 0.5


@pytest.mark.parametrize("spatial, block", [((96, 96, 96), 20), ((64, 64, 40), 16), ((64, 64, 64), 3)])
def test_a_block_that_does_not_tile_the_crop_is_refused(spatial, block):
    with pytest.raises(ValueError, match="mask block size"):
        block_grid(spatial, block)


def test_voxel_shuffle_places_each_channel_at_its_voxel():
    f = 2
    x = torch.arange(2 * f**3 * 3).float().reshape(1, 2 * f**3, 3, 1, 1)  # 2 output channels, 3 tokens in a row
    out = voxel_shuffle(x, f)
    assert out.shape == (1, 2, 3 * f, f, f)
    for c in range(2):
        for token in range(3):
            for i in range(f):
                for j in range(f):
                    for k in range(f):
                        channel = c * f**3 + (i * f + j) * f + k
                        assert out[0, c, token * f + i, j, k] == x[0, channel, token, 0, 0]


def test_the_mask_token_replaces_exactly_the_masked_patch_embeddings():
    torch.manual_seed(0)
    net = MaskedImageModel(**TINY)
    image = torch.rand(1, 1, 32, 32, 32)
    mask = torch.zeros(1, 16, 16, 16, dtype=torch.bool)
    mask[0, :8] = True
    seen = []
    net.swinViT.layers1[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    net(image, mask)
    net(image, None)
    masked, plain = seen
    token = net.mask_token.detach().reshape(-1)
    assert torch.equal(masked[0, :, :8], token[:, None, None, None].expand(-1, 8, 16, 16))
    assert torch.equal(masked[0, :, 8:], plain[0, :, 8:])
    assert not torch.equal(plain[0, :, :8], masked[0, :, :8])


@pytest.mark.parametrize("decoder", ["linear", "deconv"])
def test_the_reconstruction_has_the_input_shape_and_trains_the_mask_token(decoder):
    net = MaskedImageModel(**TINY, decoder=decoder)
    recipe = MaskedImageRecipe(MaskedReconstructionLoss(), mask_ratio=0.6, mask_block=16)
    views = recipe.views(torch.rand(2, 1, 64, 32, 32), torch.Generator().manual_seed(0))
    out = recipe.forward(net, views)
    assert out.shape == (2, 1, 64, 32, 32)
    total, parts = recipe.loss(out, views)
    total.backward()
    assert set(parts) == {"recon"} and parts["recon"] is total
    assert net.mask_token.grad.abs().sum() > 0 and net.swinViT.patch_embed.proj.weight.grad.abs().sum() > 0


def test_only_masked_voxels_count():
    loss = MaskedReconstructionLoss("l1")
    target = torch.zeros(1, 1, 4, 4, 4)
    mask = torch.zeros(1, 1, 4, 4, 4, dtype=torch.bool)
    mask[..., :1] = True  # 16 of 64 voxels
    pred = torch.zeros(1, 1, 4, 4, 4)
    pred[..., 1:] = 100.0  # large errors where nothing is masked
    pred[..., :1] = 0.5
    assert float(loss(pred, target, mask)[0]) == 0.5
    assert float(MaskedReconstructionLoss("mse")(pred, target, mask)[0]) == 0.25


def test_normalised_targets_have_zero_mean_and_unit_variance_per_block():
    target = torch.rand(2, 1, 32, 16, 16) * 7 + 3
    normalised = normalise_blocks(target, 16)
    blocks = normalised.reshape(2, 1, 2, 16, 1, 16, 1, 16)
    assert torch.allclose(blocks.mean(dim=(3, 5, 7)), torch.zeros(2, 1, 2, 1, 1), atol=1e-5)
    assert torch.allclose(blocks.var(dim=(3, 5, 7), unbiased=False), torch.ones(2, 1, 2, 1, 1), atol=1e-3)
    with pytest.raises(ValueError, match="same size"):
        MaskedImageRecipe(MaskedReconstructionLoss(norm_target=True, block_size=8), mask_block=16)


# ---------------------------------------------------------------- DDP: the global masked-voxel mean


def _batches() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Predictions, targets and masks of 3 volumes; the masks hold different numbers of voxels per volume, so a mean
    of per-rank means differs from the global mean."""
    g = torch.Generator().manual_seed(7)
    pred = torch.rand(3, 1, 8, 8, 8, generator=g)
    target = torch.rand(3, 1, 8, 8, 8, generator=g)
    mask = torch.rand(3, 1, 8, 8, 8, generator=g) < torch.tensor([0.2, 0.5, 0.8]).reshape(3, 1, 1, 1, 1)
    return pred, target, mask


def _rank_share(rank: int) -> dict:
    from components import distributed

    pred, target, mask = _batches()
    rows = slice(0, 1) if rank == 0 else slice(1, 3)  # unequal batches: 1 and 2 volumes
    pred = pred[rows].clone().requires_grad_(True)
    total, _ = MaskedReconstructionLoss(equal_rank_batches=False)(pred, target[rows], mask[rows])
    total.backward()
    grad = pred.grad.clone()
    distributed.barrier()
    return {"loss": float(distributed.all_reduce_mean(total)), "grad": grad}


def test_two_ranks_give_the_global_mean_and_its_gradient(tmp_path):
    """Two gloo ranks with 1 and 2 volumes: the logged (rank-averaged) loss is the mean over every masked voxel of
    the 3 volumes, and each rank's gradient averaged as DDP does (divided by 2) equals one process's gradient."""
    pred, target, mask = _batches()
    whole = pred.clone().requires_grad_(True)
    reference, _ = MaskedReconstructionLoss()(whole, target, mask)
    reference.backward()
    first, second = run_scenario(_rank_share, tmp_path, world=2, timeout=120)
    expected = float(reference.detach())
    assert abs(first["loss"] - expected) < 1e-6 and abs(second["loss"] - expected) < 1e-6
    ddp_grad = torch.cat([first["grad"], second["grad"]]) / 2
    assert torch.allclose(ddp_grad, whole.grad, atol=1e-8)
    per_rank_means = (float((pred[0:1] - target[0:1]).abs()[mask[0:1]].mean()) +
                      float((pred[1:3] - target[1:3]).abs()[mask[1:3]].mean())) / 2  # fmt: skip
    assert abs(per_rank_means - expected) > 1e-3  # what a mean of per-rank means would have logged


# ---------------------------------------------------------------- the masked-token self-distillation


def _distilled(**kwargs) -> tuple[MaskedImageModel, MaskedImageRecipe]:
    from components.recipes.masked_image import MaskedTokenDistillation

    torch.manual_seed(0)
    net = MaskedImageModel(**TINY, distill_prototypes=16, head_hidden_dim=24, head_bottleneck_dim=8)
    distillation = MaskedTokenDistillation(net, total_iterations=10, **kwargs)
    return net, MaskedImageRecipe(MaskedReconstructionLoss(), mask_ratio=0.5, mask_block=16, distillation=distillation)


def test_the_distillation_term_is_the_cross_entropy_at_the_masked_third_stage_tokens():
    """Recomputed here from the two networks' logits: the teacher's centred, sharpened softmax against the student's
    log-softmax, averaged over the tokens whose 16^3 voxels are masked; the unmasked tokens do not count."""
    import torch.nn.functional as F

    from components.recipes.masked_image import stage_tokens

    net, recipe = _distilled(teacher_temperature=0.07, warmup_teacher_temperature=0.04,
                             teacher_temperature_warmup_iterations=4)  # fmt: skip
    recipe.distillation.step = 2  # halfway through the warm-up: 0.055
    recipe.distillation.center.fill_(0.01)
    views = recipe.views(torch.rand(2, 1, 64, 32, 32), torch.Generator().manual_seed(1))
    reconstruction, student, teacher = recipe.forward(net, views)
    center = recipe.distillation.center.clone()
    total, parts = recipe.loss((reconstruction, student, teacher), views)
    mask = views.voxel_mask[:, 0, ::16, ::16, ::16].flatten(1)
    assert mask.shape == (2, 16) and 0 < int(mask.sum()) < 32  # 4 x 2 x 2 tokens of 16^3 voxels per crop
    targets = F.softmax((teacher - center) / 0.055, dim=-1)
    expected = (-(targets * F.log_softmax(student / 0.1, dim=-1)).sum(-1))[mask].mean()
    assert torch.allclose(parts["distill"], expected, atol=1e-6)
    assert torch.allclose(total, parts["recon"] + parts["distill"])
    with torch.no_grad():  # the teacher's logits are those of the whole crop through its own encoder and head
        own = recipe.distillation.teacher["token_head"](stage_tokens(recipe.distillation.teacher["swinViT"], views.image))
    assert torch.allclose(teacher, own)


def test_the_teacher_follows_the_student_by_ema_and_the_schedules_run():
    net, recipe = _distilled(momentum=(0.9, 1.0))
    distillation = recipe.distillation
    before = [p.clone() for p in distillation.teacher["swinViT"].parameters()]
    with torch.no_grad():
        for p in net.swinViT.parameters():
            p.add_(1.0)
    distillation.step = 0
    distillation.update_teacher(net)
    after = list(distillation.teacher["swinViT"].parameters())
    student = list(net.swinViT.parameters())
    assert all(torch.allclose(a, 0.9 * b + 0.1 * s) for a, b, s in zip(after, before, student))
    assert distillation.momentum_at(0) == 0.9 and distillation.momentum_at(10) == 1.0
    views = recipe.views(torch.rand(2, 1, 64, 32, 32, generator=torch.Generator().manual_seed(1)), torch.Generator().manual_seed(0))
    with torch.no_grad():
        outputs = recipe.forward(net, views)
    monitor = recipe.monitor(outputs, views)
    fill, _ = visible_fill_errors(views.image, ~views.voxel_mask, views.voxel_mask)  # the trivial reconstruction's L1
    assert float(monitor.pop("loss_recon_trivial")) == pytest.approx(float(fill))
    assert monitor == {"loss_distill_trivial": pytest.approx(math.log(outputs[2].shape[-1])), "teacher_temperature": 0.07, "momentum": 0.9}


def test_the_distillation_needs_whole_tokens_masked_and_a_token_head():
    from components.recipes.masked_image import MaskedTokenDistillation

    net, recipe = _distilled()
    with pytest.raises(ValueError, match="masking#block_size must be a multiple of 16, got 8"):
        MaskedImageRecipe(MaskedReconstructionLoss(), mask_block=8, distillation=recipe.distillation)
    with pytest.raises(ValueError, match="distill_prototypes > 0"):
        MaskedTokenDistillation(MaskedImageModel(**TINY), total_iterations=10)


def test_the_recipe_state_holds_the_teacher_and_centre_only_with_a_distillation():
    _, recipe = _distilled()
    keys = set(recipe.state_dict())
    assert "distillation.center" in keys and any(k.startswith("distillation.teacher.swinViT.") for k in keys)
    assert MaskedImageRecipe(MaskedReconstructionLoss()).state_dict() == {}
