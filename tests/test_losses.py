"""Single-process tests of components.recipes.inpainting_contrast.loss.SSLLoss against independent straightforward implementations."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from components.recipes.inpainting_contrast.loss import SSLLoss, nt_xent_loss


def reference_nt_xent(emb_1: torch.Tensor, emb_2: torch.Tensor, temperature: float) -> torch.Tensor:
    """recipe.md s1 written out literally: explicit loop over anchors, float64, log of a ratio of sums."""
    z = torch.cat([emb_1, emb_2]).double()
    z = z / z.norm(dim=1, keepdim=True)
    n = z.shape[0]
    b = n // 2
    losses = []
    for i in range(n):
        pos = i + b if i < b else i - b
        numerator = torch.exp(torch.dot(z[i], z[pos]) / temperature)
        denominator = sum(torch.exp(torch.dot(z[i], z[j]) / temperature) for j in range(n) if j != i)
        losses.append(-torch.log(numerator / denominator))
    return torch.stack(losses).mean()


def make_inputs(b: int = 4, feat: int = 32, classes: int = 4, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rot_logits = torch.randn(2 * b, classes, generator=g, dtype=dtype)
    rot_labels = torch.randint(0, classes, (2 * b,), generator=g)
    emb_1 = torch.randn(b, feat, generator=g, dtype=dtype)
    emb_2 = emb_1 + 0.5 * torch.randn(b, feat, generator=g, dtype=dtype)  # correlated views
    recon = torch.rand(2 * b, 1, 6, 6, 6, generator=g, dtype=dtype)
    target = torch.rand(2 * b, 1, 6, 6, 6, generator=g, dtype=dtype)
    return rot_logits, rot_labels, emb_1, emb_2, recon, target


@pytest.mark.parametrize("b,feat,temperature", [(1, 8, 0.5), (2, 16, 0.5), (4, 32, 0.5), (7, 5, 0.1), (3, 64, 1.0)])
def test_parts_and_total_match_reference(b, feat, temperature):
    inputs = make_inputs(b, feat, seed=b)
    rot_logits, rot_labels, emb_1, emb_2, recon, target = inputs
    total, parts = SSLLoss(temperature=temperature)(*inputs)

    assert set(parts) == {"rot", "contrast", "recon"}
    assert all(p.dim() == 0 for p in parts.values()) and total.dim() == 0
    torch.testing.assert_close(parts["rot"], F.cross_entropy(rot_logits, rot_labels))
    torch.testing.assert_close(parts["recon"], F.l1_loss(recon, target))
    torch.testing.assert_close(parts["recon"], (recon - target).abs().mean())
    ref_contrast = reference_nt_xent(emb_1, emb_2, temperature)
    torch.testing.assert_close(parts["contrast"].double(), ref_contrast, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(total, parts["rot"] + parts["contrast"] + parts["recon"])
    if b == 1:  # the only candidate of each anchor is its positive
        assert parts["contrast"].abs().item() < 1e-6


@pytest.mark.parametrize("temperature", [0.5, 0.2, 1.0])
def test_contrast_matches_monai(temperature):
    from monai.losses import ContrastiveLoss

    for seed, (b, feat) in enumerate([(2, 8), (4, 512), (8, 48)]):
        _, _, emb_1, emb_2, _, _ = make_inputs(b, feat, seed=seed)
        ours = SSLLoss(temperature=temperature)(*make_inputs(b, feat, seed=seed))[1]["contrast"]
        monai_value = ContrastiveLoss(temperature=temperature)(emb_1, emb_2)
        torch.testing.assert_close(ours, monai_value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(nt_xent_loss(emb_1, emb_2, temperature), monai_value, rtol=1e-5, atol=1e-6)


def test_alpha_weighting():
    inputs = make_inputs(3, 16)
    _, parts = SSLLoss()(*inputs)
    alpha = (0.3, 2.0, 0.0)
    total, weighted_parts = SSLLoss(alpha=alpha)(*inputs)
    for key in parts:  # the parts are unweighted
        torch.testing.assert_close(weighted_parts[key], parts[key])
    torch.testing.assert_close(total, 0.3 * parts["rot"] + 2.0 * parts["contrast"] + 0.0 * parts["recon"])
    total_list, _ = SSLLoss(alpha=[0.3, 2.0, 0.0])(*inputs)
    torch.testing.assert_close(total_list, total)


@pytest.mark.parametrize("temperature", [0.05, 0.005])
def test_stable_at_low_temperature_with_large_norms(temperature):
    g = torch.Generator().manual_seed(3)
    b, feat = 8, 64
    emb_1 = 1e15 * torch.randn(b, feat, generator=g)  # huge norms: only the direction may matter
    emb_2 = emb_1 + 1e14 * torch.randn(b, feat, generator=g)
    emb_1.requires_grad_(True)
    emb_2.requires_grad_(True)
    inputs = make_inputs(b, feat)
    total, parts = SSLLoss(temperature=temperature)(inputs[0], inputs[1], emb_1, emb_2, inputs[4], inputs[5])
    assert torch.isfinite(total) and torch.isfinite(parts["contrast"])
    ref = reference_nt_xent(emb_1.detach(), emb_2.detach(), temperature)  # float64: exp(1/t) fits
    assert math.isfinite(ref.item())
    torch.testing.assert_close(parts["contrast"].double(), ref, rtol=1e-5, atol=1e-5)
    total.backward()
    assert torch.isfinite(emb_1.grad).all() and torch.isfinite(emb_2.grad).all()
    if temperature == 0.005:  # exp(1/t) = exp(200) overflows float32: the exp / sum / log form breaks down
        from monai.losses import ContrastiveLoss

        assert not torch.isfinite(ContrastiveLoss(temperature=temperature)(emb_1.detach(), emb_2.detach()))


def test_gradients_match_float64_reference():
    rot_logits, rot_labels, emb_1, emb_2, recon, target = make_inputs(5, 12, seed=7)
    leaves = [t.clone().requires_grad_(True) for t in (rot_logits, emb_1, emb_2, recon)]
    total, _ = SSLLoss(temperature=0.2, alpha=(0.5, 1.5, 2.0))(
        leaves[0], rot_labels, leaves[1], leaves[2], leaves[3], target
    )
    total.backward()

    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref_total = (
        0.5 * F.cross_entropy(ref_leaves[0], rot_labels)
        + 1.5 * reference_nt_xent(ref_leaves[1], ref_leaves[2], 0.2)
        + 2.0 * F.l1_loss(ref_leaves[3], target.double())
    )
    ref_total.backward()
    torch.testing.assert_close(total.double(), ref_total, rtol=1e-6, atol=1e-6)
    for ours, ref in zip(leaves, ref_leaves):
        assert torch.isfinite(ours.grad).all()
        torch.testing.assert_close(ours.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)


def test_gather_without_process_group_is_local():
    inputs = make_inputs(4, 16)
    local_total, local_parts = SSLLoss(gather_distributed=False)(*inputs)
    for flag in (True, None):
        total, parts = SSLLoss(gather_distributed=flag)(*inputs)
        torch.testing.assert_close(total, local_total, rtol=0, atol=0)
        for key in parts:
            torch.testing.assert_close(parts[key], local_parts[key], rtol=0, atol=0)


def test_integer_label_dtypes_and_low_precision_inputs():
    rot_logits, rot_labels, emb_1, emb_2, recon, target = make_inputs(4, 16)
    ref_total, _ = SSLLoss()(rot_logits, rot_labels, emb_1, emb_2, recon, target)
    total32, _ = SSLLoss()(rot_logits, rot_labels.int(), emb_1, emb_2, recon, target)
    torch.testing.assert_close(total32, ref_total)
    # half / bfloat16 embeddings: the contrastive term is computed in float32
    contrast_bf16 = SSLLoss()(rot_logits, rot_labels, emb_1.bfloat16(), emb_2.bfloat16(), recon, target)[1]
    assert contrast_bf16["contrast"].dtype == torch.float32
    torch.testing.assert_close(
        contrast_bf16["contrast"], reference_nt_xent(emb_1.bfloat16(), emb_2.bfloat16(), 0.5).float()
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, parts = SSLLoss()(rot_logits, rot_labels, emb_1, emb_2, recon, target)
    assert torch.isfinite(total)
    assert parts["contrast"].dtype == torch.float32
    torch.testing.assert_close(parts["contrast"], reference_nt_xent(emb_1, emb_2, 0.5).float())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": "warm"}, "temperature"),
        ({"alpha": (1.0, 1.0)}, "alpha"),
        ({"alpha": (1.0, 1.0, 1.0, 1.0)}, "alpha"),
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": (1.0, -1.0, 1.0)}, "alpha"),
        ({"alpha": (1.0, float("inf"), 1.0)}, "alpha"),
        ({"alpha": (1.0, "x", 1.0)}, "alpha"),
        ({"gather_distributed": "yes"}, "gather_distributed"),
    ],
)
def test_constructor_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SSLLoss(**kwargs)


def _replace(inputs, index, value):
    inputs = list(inputs)
    inputs[index] = value
    return inputs


@pytest.mark.parametrize(
    "index,make_bad,match",
    [
        (0, lambda t: t[:, 0], "rot_logits"),  # 1-D logits
        (0, lambda t: t.long(), "rot_logits"),  # integer logits
        (1, lambda t: t.float(), "rot_labels must be an integer"),
        (1, lambda t: t > 1, "rot_labels must be an integer"),
        (1, lambda t: t[:-1], "rot_labels must have shape"),
        (2, lambda t: t[:-1], "emb_1 and emb_2"),  # batch mismatch
        (3, lambda t: t[:, :-1], "emb_1 and emb_2"),  # feature mismatch
        (2, lambda t: t[:, :, None], "emb_1 must have shape"),
        (3, lambda t: t.long(), "emb_2 must be a floating-point"),
        (5, lambda t: t[:, :, :-1], "recon and recon_target shapes differ"),
        (5, lambda t: t.long(), "recon_target must be a floating-point"),
    ],
)
def test_input_errors_name_the_argument(index, make_bad, match):
    inputs = make_inputs(3, 8)
    bad = _replace(inputs, index, make_bad(inputs[index]))
    with pytest.raises(ValueError, match=match):
        SSLLoss()(*bad)


def test_non_tensor_input_is_a_type_error():
    inputs = make_inputs(3, 8)
    with pytest.raises(TypeError, match="recon must be a torch.Tensor"):
        SSLLoss()(*_replace(inputs, 4, inputs[4].numpy()))
