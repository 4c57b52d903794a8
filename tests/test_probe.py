"""components.LinearProbe: a frozen pretrained encoder read by one 1x1x1 convolution per scale, the representation test
of the finetuning bundles (``--network_def#network "$components.LinearProbe"``).

What it must guarantee: only the convolutions learn (the encoder's weights stay bit-identical under the CT bundle's own
optimizer, and no gradient reaches them), the logits have the input's spatial size, every encoder tensor of each
pretraining bundle's checkpoint loads into it through the bundle's ``network_def`` and ``PretrainedLoader``, and a real
CT bundle run trains it, evaluates it and segments with it (evaluate.json and inference.json with the same override).
"""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import pytest
import torch
from monai.bundle import ConfigParser

import components
from components.checkpoint import PATCH_EMBED_WEIGHT
from components.config.running import run_config_files
from tests.test_finetune_bundles import CT, CT_TINY, MRI, TRAIN_TINY, _ok, _run, _run_at_once, _summary

PROBE = "$components.LinearProbe"
FS = 12
WINDOW = CT_TINY["network_def#window_size"]


def _probe(**kwargs) -> components.LinearProbe:
    torch.manual_seed(0)
    return components.LinearProbe(**{"in_channels": 1, "out_channels": 3, "feature_size": FS, "window_size": WINDOW, **kwargs})


def _ct_parser(bundle: Path = CT, **overrides) -> ConfigParser:
    """A finetuning bundle's train.json (CT unless told) with the probe as its network, tiny, on the CPU, from scratch
    unless told."""
    parser = ConfigParser()
    parser.read_config([str(f) for f in run_config_files(bundle, ["train.json"])])
    parser.update({"network_def#network": PROBE, "feature_size": FS, "network_def#window_size": WINDOW, "device": "cpu",
                   "pretrained_path": None, "speed#use_checkpoint": False, "speed#amp": False, **overrides})  # fmt: skip
    parser.get_parsed_content("imports")
    return parser


def test_the_logits_have_the_input_size_and_out_channels():
    probe = _probe()
    for size in ((64, 32, 32), (32, 32, 32)):
        assert tuple(probe(torch.rand(2, 1, *size)).shape) == (2, 3, *size)
    # one convolution per feature map the encoder returns: f, 2f, 4f, 8f, 16f channels
    assert [head.in_channels for head in probe.heads] == [FS, 2 * FS, 4 * FS, 8 * FS, 16 * FS]
    assert all(head.kernel_size == (1, 1, 1) and head.out_channels == 3 for head in probe.heads)


def test_only_the_convolutions_require_and_receive_gradients():
    probe = _probe()
    trainable = {name for name, p in probe.named_parameters() if p.requires_grad}
    assert trainable and all(name.startswith("heads.") for name in trainable)
    probe.train()  # as MONAI's SupervisedTrainer does every iteration
    assert probe.training and not any(m.training for m in probe.swinViT.modules())
    probe(torch.rand(2, 1, 32, 32, 32)).square().mean().backward()
    for name, param in probe.named_parameters():
        if name.startswith("heads."):
            assert param.grad is not None and param.grad.abs().sum() > 0, name
        else:
            assert param.grad is None, name


def test_each_scale_is_standardised_before_its_convolution_and_norms_learn_nothing():
    probe = _probe()
    seen: list[torch.Tensor] = []
    for head in probe.heads:
        head.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0]))
    probe.train()
    probe(torch.rand(2, 1, 64, 64, 64, generator=torch.Generator().manual_seed(0)))
    assert len(seen) == 5
    for features in seen:  # per channel over the batch and the voxels: mean 0, variance 1 (biased, as batch norm)
        dims = [0, *range(2, features.ndim)]
        torch.testing.assert_close(features.mean(dims), torch.zeros(features.shape[1]), atol=1e-4, rtol=0)
        torch.testing.assert_close(features.var(dims, unbiased=False), torch.ones(features.shape[1]), atol=2e-3, rtol=0)
    assert not any(p.requires_grad for p in probe.norms.parameters()) and not list(probe.norms.parameters())
    assert all(norm.running_mean.abs().sum() > 0 for norm in probe.norms)  # the statistics eval mode will use


def test_the_raw_probe_keeps_the_earlier_layout():
    standardised, raw = _probe(), _probe(standardise=False)
    assert not any(key.startswith("norms.") for key in raw.state_dict())
    assert {key for key in standardised.state_dict() if key.startswith("norms.")} == {
        f"norms.{i}.{buffer}" for i in range(5) for buffer in ("running_mean", "running_var", "num_batches_tracked")
    }
    x = torch.rand(1, 1, 32, 32, 32)
    raw.eval()
    features = raw.swinViT(x, normalize=True)
    expected = sum(torch.nn.functional.interpolate(head(f), size=x.shape[2:], mode="trilinear") for head, f in zip(raw.heads, features))
    torch.testing.assert_close(raw(x), expected)


def test_training_mode_draws_nothing_at_random():
    probe = _probe()
    x = torch.rand(2, 1, 32, 32, 32)  # batch norm in training mode needs two values per channel at the 1^3 scale
    probe.train()
    assert torch.equal(probe(x), probe(x))


@pytest.mark.parametrize("bad, match", [({"out_channels": 0}, "out_channels"), ({"feature_size": 0}, "feature_size"),
                                        ({"spatial_dims": 4}, "spatial_dims")])  # fmt: skip
def test_bad_arguments_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        _probe(**bad)


def test_an_input_of_other_channels_is_named():
    with pytest.raises(ValueError, match=r"expected an input \(B, 1, S, S, S\), got shape \(1, 2, 32, 32, 32\)"):
        _probe()(torch.rand(1, 2, 32, 32, 32))


def test_the_encoder_is_bit_identical_after_steps_of_the_ct_bundles_optimizer():
    parser = _ct_parser()
    optimizer = parser.get_parsed_content("train#optimizer")
    network = parser.get_parsed_content("train#network")
    loss_function = parser.get_parsed_content("train#loss")
    assert isinstance(network, components.LinearProbe)
    before = {k: v.clone() for k, v in network.state_dict().items()}
    network.train()
    for step in range(3):
        torch.manual_seed(step)
        image, label = torch.rand(1, 1, 64, 32, 32), torch.randint(0, 14, (1, 1, 64, 32, 32))
        optimizer.zero_grad()
        loss_function(network(image), label).backward()
        optimizer.step()
    after = network.state_dict()
    encoder = [k for k in before if k.startswith("swinViT.")]
    assert encoder and all(torch.equal(after[k], before[k]) for k in encoder)
    assert all(not torch.equal(after[k], before[k]) for k in before if k.startswith("heads.") and k.endswith("weight"))


@pytest.mark.parametrize("bundle", [CT, MRI], ids=["ct", "mri"])
def test_both_finetuning_bundles_build_the_probe_from_their_shipped_network_def(bundle, tmp_path):
    """The override alone: network_def passes SwinUNETR's arguments of the shipped config, the probe takes them (the
    MRI bundle's 4 channels get the 1-channel SSL patch embedding through its channel policy, as SwinUNETR does)."""
    torch.manual_seed(2)
    source = tmp_path / "ssl.pt"
    torch.save(components.SSLHead(feature_size=FS, window_size=WINDOW).state_dict(), source)
    parser = _ct_parser(bundle, pretrained_path=str(source))
    config = json.loads((bundle / "configs" / "train.json").read_text())
    loader = parser.get_parsed_content("train#handlers#0")
    probe = loader.network
    assert isinstance(probe, components.LinearProbe)
    report = loader()
    assert report.encoder_loaded == report.encoder_keys and list(report.adapted) == (
        [PATCH_EMBED_WEIGHT] if config["in_channels"] > 1 else [])
    image = torch.rand(1, config["in_channels"], 64, 32, 32)
    assert tuple(probe(image).shape) == (1, len(config["label_names"]), 64, 32, 32)


def _pretraining_checkpoints(folder: Path) -> dict[str, Path]:
    """A tiny (feature 12, window 4) model of each pretraining bundle's network, saved as its bundle saves it."""
    torch.manual_seed(1)
    networks = {
        "ssl": components.SSLHead(feature_size=FS, window_size=WINDOW),
        "dino_student": components.SelfDistillationNetwork(feature_size=FS, window_size=WINDOW, out_dim=32, hidden_dim=24,
                                                           bottleneck_dim=8),  # fmt: skip
        "dino_teacher": components.SwinViTEmbedding(feature_size=FS, window_size=WINDOW),
        "mim": components.MaskedImageModel(feature_size=FS, window_size=WINDOW),
    }
    paths = {}
    for name, network in networks.items():
        paths[name] = folder / f"{name}.pt"
        torch.save(network.state_dict(), paths[name])
    return paths


@pytest.mark.parametrize("name, layout", [("ssl", "ssl_collection"), ("dino_student", "dino_collection"),
                                          ("dino_teacher", "swinvit_encoder"), ("mim", "mim_collection")])  # fmt: skip
def test_every_encoder_tensor_of_each_pretraining_bundle_loads_through_the_ct_network_def(name, layout, tmp_path):
    source = _pretraining_checkpoints(tmp_path)[name]
    parser = _ct_parser(pretrained_path=str(source))
    loader = parser.get_parsed_content("train#handlers#0")
    assert isinstance(loader, components.PretrainedLoader) and isinstance(loader.network, components.LinearProbe)
    report = loader()
    assert (report.layout, report.target) == (layout, "encoder")
    assert report.encoder_keys and report.encoder_loaded == report.encoder_keys and not report.encoder_missing
    assert sorted(report.missing) == sorted(k for k in loader.network.state_dict() if k.startswith(("heads.", "norms.")))
    assert not report.unknown and not report.shape_mismatched
    state = torch.load(source, weights_only=True)
    loaded = loader.network.state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in report.encoder_keys)


# ---------------------------------------------------------------------------------------------------------------
# a real CT bundle run with the probe: train, evaluate, infer
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("probe")


@pytest.fixture(scope="module")
def ct_data(work) -> Path:
    root = work / "ct"
    components.write_dataset(root, kind="ct", num=5, seed=0)  # 3 training, 1 validation, 1 test volume
    return root


@pytest.fixture(scope="module")
def ssl_checkpoint(work) -> Path:
    torch.manual_seed(12)
    path = work / "ssl_f12.pt"
    torch.save(components.SSLHead(feature_size=FS, window_size=WINDOW).state_dict(), path)
    return path


@pytest.fixture(scope="module")
def probe_run(work, ct_data, ssl_checkpoint):
    out = work / "probe_run"
    overrides = {**CT_TINY, **TRAIN_TINY, "network_def#network": PROBE, "dataset_dir": str(ct_data),
                 "output_dir": str(out / "eval"), "ckpt_dir": str(out / "models"), "pretrained_path": str(ssl_checkpoint)}  # fmt: skip
    return _run(CT, ["train.json"], overrides, work / "probe_train.log"), out


def test_the_ct_bundle_trains_a_probe_of_the_ssl_encoder_and_leaves_the_encoder_as_loaded(probe_run, ssl_checkpoint):
    result, out_dir = probe_run
    out = _ok(result, "CT training of the probe")
    layout, target, loaded, total, encoder_missing, adapted = _summary(out)
    assert (layout, target) == ("ssl_collection", "encoder")
    assert loaded == total > 100 and encoder_missing == 0 and adapted == 0
    assert "val_mean_dice" in out
    ssl = torch.load(ssl_checkpoint, weights_only=True)
    trained = torch.load(out_dir / "models" / "model.pt", weights_only=True)
    encoder = [k for k in trained if k.startswith("swinViT.")]
    assert len(encoder) == total and all(torch.equal(trained[k], ssl[k]) for k in encoder)
    assert {k.split(".")[0] for k in trained} == {"swinViT", "norms", "heads"}
    resumable = torch.load(out_dir / "models" / "checkpoint.pt", weights_only=True)
    assert resumable["trainer"]["iteration"] == 3


def test_evaluation_and_inference_of_a_probe_take_the_same_override(probe_run, work, ct_data):
    _ok(probe_run[0], "CT training of the probe")
    models = probe_run[1] / "models"
    evaluated, segmented = work / "probe_eval", work / "probe_seg"
    overrides = {**CT_TINY, "network_def#network": PROBE, "dataset_dir": str(ct_data), "output_dir": str(evaluated),
                 "ckpt_dir": str(models)}  # fmt: skip
    inference_ids = ("roi_size", "spacing", "feature_size", "network_def#window_size", "loader#num_workers", "speed#amp",
                     "device")  # fmt: skip
    inference = {**{k: CT_TINY[k] for k in inference_ids}, "network_def#network": PROBE, "dataset_dir": str(ct_data),
                 "output_dir": str(segmented), "ckpt_dir": str(models)}  # fmt: skip
    runs = _run_at_once({"eval": (CT, ["train.json", "evaluate.json"], overrides, work / "probe_eval.log"),
                         "infer": (CT, ["inference.json"], inference, work / "probe_infer.log")})  # fmt: skip
    _ok(runs["eval"], "evaluation of the probe")
    summary = json.loads((evaluated / "metrics.json").read_text())
    assert summary["metric"] == "val_mean_dice" and summary["num_images"] == 1

    _ok(runs["infer"], "inference of the probe")
    case = json.loads((ct_data / "dataset.json").read_text())["test"][0]
    source = nib.load(ct_data / case["image"])
    seg = nib.load(segmented / f"{Path(case['image']).name.split('.')[0]}_seg.nii.gz")
    assert seg.shape == source.shape
