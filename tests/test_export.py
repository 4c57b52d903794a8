"""The deployable model of the two finetuning bundles (components.release.export, ``python -m components export``).

Each bundle's configs are copied to tmp_path with a random-weight ``models/model.pt`` of a tiny network (feature
size 12; ROIs of 64x32x32 and 32x64x32, the smallest SwinUNETR takes: 32^3 leaves one voxel at the bottleneck,
whose InstanceNorm needs more). The BTCV model is exported through the command line (the session's
``exported_btcv`` of tests/conftest.py, which test_package packages too), the BraTS one through
:func:`export_network`, so two exports cover both routes. The ``.pt2`` is loaded once per bundle (loading takes
seconds) and compared with the trained network, built as ``configs/inference.json`` builds it, on an ROI batch
and through sliding-window inference.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from monai.bundle import ConfigParser
from monai.inferers import sliding_window_inference
from torch import nn

from components.checkpoint import CheckpointLoadError
from components.release.export import export_network, load_exported

pytestmark = pytest.mark.filterwarnings("ignore:parsing config_file:UserWarning")

BUNDLES = Path(__file__).resolve().parents[1] / "bundles"
TINY = {"feature_size": 12}
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


@dataclass(frozen=True)
class Case:
    bundle: str
    in_channels: int
    out_channels: int
    roi: tuple[int, int, int]
    overrides: dict = field(default_factory=lambda: dict(TINY))


# a 50x45x40 volume at overlap 0.25 is 4 windows of either ROI (one axis padded up to the ROI, two axes of two
# windows); in batches of 3 the last one is smaller
VOLUME = (50, 45, 40)
SW_BATCH_SIZE = 3
CASES = {
    "btcv": Case("swin_unetr_btcv_finetune", 1, 14, (64, 32, 32)),
    # windows of 4: the ROI's tokens fill whole windows, so the program (and the sliding windows through it) computes
    # several times faster than at the bundles' 7, which the BTCV case keeps: its tokens are padded to whole windows,
    # as those of the shipped 96^3 ROI are
    "brats": Case("swin_unetr_brats_finetune", 4, 3, (32, 64, 32), {**TINY, "network_def#window_size": 4}),
    # SwinUNETR v2 (a residual block after each stage, as VoCo's encoders): the same route, the same equality
    "btcv_v2": Case("swin_unetr_btcv_finetune", 1, 14, (64, 32, 32),
                    {**TINY, "network_def#window_size": 4, "network_def#use_v2": True}),
}


@dataclass(frozen=True)
class Exported:
    case: Case
    bundle: Path
    network: nn.Module  # the trained network, as the inference config builds it
    path: Path
    program: nn.Module  # the .pt2 loaded again
    stdout: str


def _bundle_copy(root: Path, case: Case) -> Path:
    bundle = root / case.bundle
    shutil.copytree(BUNDLES / case.bundle / "configs", bundle / "configs")
    return bundle


def _network(bundle: Path, roi: tuple[int, ...], overrides: dict, seed: int | None = None) -> nn.Module:
    """The inference config's ``network`` on the CPU; with ``seed``: random weights, shifted away from any default
    initialisation so that a program built without loading the file would differ."""
    parser = ConfigParser()
    parser.read_config(bundle / "configs" / "inference.json")
    parser.update({"bundle_root": str(bundle), "device": "cpu", "roi_size": list(roi), **overrides})
    network = parser.get_parsed_content("network")
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for value in network.state_dict().values():
                if value.is_floating_point():
                    value.add_(0.05 * torch.randn(value.shape, generator=generator))
    return network.eval()


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory) -> Exported:
    case = CASES[request.param]
    if request.param == "btcv":  # the command line, with the default checkpoint and output path (tests/conftest.py)
        bundle, stdout = request.getfixturevalue("exported_btcv")
        network = _network(bundle, case.roi, case.overrides)
        network.load_state_dict(torch.load(bundle / "models" / "model.pt", weights_only=True))
        path = bundle / "models" / "model.pt2"
    else:
        bundle = _bundle_copy(tmp_path_factory.mktemp(request.param), case)
        network = _network(bundle, case.roi, case.overrides, seed=7)
        (bundle / "models").mkdir()
        torch.save(network.state_dict(), bundle / "models" / "model.pt")
        path = export_network(bundle, bundle / "exported" / f"{request.param}.pt2", roi_size=case.roi, overrides=case.overrides)
        stdout = ""
    assert hasattr(network.swinViT, "layers1c") == bool(case.overrides.get("network_def#use_v2"))  # v2 when asked
    program = load_exported(path).eval()  # as MONAI's evaluators switch their network
    return Exported(case, bundle, network, path, program, stdout)


def test_exported_program_equals_the_trained_network_on_an_roi_batch(exported):
    program, case = exported.program, exported.case
    x = torch.randn(3, case.in_channels, *case.roi, generator=torch.Generator().manual_seed(1))  # not the example's 2
    with torch.no_grad():
        expected, actual = exported.network(x), program(x)
    assert actual.shape == (3, case.out_channels, *case.roi)
    torch.testing.assert_close(actual, expected, **TOLERANCE)
    assert expected.abs().max() > 0.1  # a real output, not zeros on both sides


def test_exported_program_equals_the_trained_network_in_sliding_window_inference(exported):
    program, case = exported.program, exported.case
    volume = torch.randn(1, case.in_channels, *VOLUME, generator=torch.Generator().manual_seed(2))
    batches: list[int] = []

    def recorded(patches: torch.Tensor) -> torch.Tensor:
        batches.append(patches.shape[0])
        return program(patches)

    with torch.no_grad():
        expected = sliding_window_inference(volume, case.roi, SW_BATCH_SIZE, exported.network, overlap=0.25)
        actual = sliding_window_inference(volume, case.roi, SW_BATCH_SIZE, recorded, overlap=0.25)
    assert actual.shape == (1, case.out_channels, *VOLUME)
    assert batches == [3, 1]  # the last batch of patches is smaller
    torch.testing.assert_close(actual, expected, **TOLERANCE)


def test_exported_program_refuses_another_spatial_size(exported):
    """The ROI is fixed (see components.release.export): a patch of another size fails instead of computing."""
    other = tuple(s + 32 for s in exported.case.roi)
    with pytest.raises((AssertionError, RuntimeError), match="size|shape"):
        exported.program(torch.zeros(1, exported.case.in_channels, *other))


@pytest.mark.parametrize("exported", ["btcv"], indirect=True)  # the model exported through the command line
def test_export_command_writes_the_program_beside_the_checkpoint(exported):
    models = exported.bundle / "models"
    assert f"wrote {models / 'model.pt2'}" in exported.stdout
    assert sorted(p.name for p in models.iterdir()) == ["model.pt", "model.pt2"]  # no temporary file left


@pytest.mark.parametrize("exported", ["brats"], indirect=True)
def test_the_program_records_its_input_and_the_weights_it_came_from(exported):
    """Read from the program itself: its input shape (the batch dynamic, the ROI fixed) and dtype, and the SHA-256 of
    the checkpoint it was exported from (saved in the .pt2 at export), which packaging compares with model.pt."""
    from components.release.export import exported_program_record

    weights = hashlib.sha256((exported.bundle / "models" / "model.pt").read_bytes()).hexdigest()
    assert exported_program_record(exported.path) == {
        "input_shape": ["dynamic", 4, 32, 64, 32],
        "dtype": "float32",
        "exported_from_sha256": weights,
    }


def test_checkpoint_with_a_missing_key_fails_naming_the_file_and_keys(tmp_path):
    case = CASES["btcv"]
    bundle = _bundle_copy(tmp_path, case)
    state = _network(bundle, case.roi, case.overrides, seed=7).state_dict()
    del state["out.conv.conv.weight"]
    state["head.extra"] = torch.zeros(1)
    checkpoint = tmp_path / "partial.pt"
    torch.save(state, checkpoint)
    with pytest.raises(CheckpointLoadError) as error:
        export_network(bundle, tmp_path / "out.pt2", checkpoint=checkpoint, roi_size=case.roi, overrides=TINY)
    message = str(error.value)
    assert str(checkpoint) in message and "'out.conv.conv.weight'" in message and "'head.extra'" in message
    assert not (tmp_path / "out.pt2").exists()


@pytest.mark.parametrize("roi", [(50, 32, 32), (32, 32, 32), (64, 32)])
def test_roi_size_that_swinunetr_cannot_take_fails_before_any_work(tmp_path, roi):
    bundle = _bundle_copy(tmp_path, CASES["brats"])
    with pytest.raises(ValueError, match="roi_size"):
        export_network(bundle, checkpoint=tmp_path / "absent.pt", roi_size=roi, overrides=TINY)
