"""Fixtures that several test modules share: made once per session where each module would make its own."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import NamedTuple

import pytest
import torch


class ExportedBundle(NamedTuple):
    bundle: Path  # the bundle folder: its release files, models/model.pt and models/model.pt2
    stdout: str  # what the export command printed


@pytest.fixture(scope="session")
def exported_btcv(tmp_path_factory) -> ExportedBundle:
    """The CT bundle's release files with tiny weights (SwinUNETR of feature size 12, every parameter shifted away
    from its initialisation, as if trained) in ``models/model.pt``, exported by ``python -m components export
    --roi_size 64,32,32`` beside them. Exporting takes seconds: test_export and test_package share it, and neither
    writes into it."""
    from monai.networks.nets import SwinUNETR

    from components.__main__ import main
    from components.demo.runner import BUNDLES_DIR
    from components.release.package import bundle_files

    name = "swin_unetr_btcv_finetune"
    bundle = tmp_path_factory.mktemp("exported_btcv") / name
    for rel in bundle_files(BUNDLES_DIR / name, include_weights=False):
        (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
        (bundle / rel).write_bytes((BUNDLES_DIR / name / rel).read_bytes())
    network = SwinUNETR(in_channels=1, out_channels=14, feature_size=12)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    (bundle / "models").mkdir()
    torch.save(network.state_dict(), bundle / "models" / "model.pt")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        status = main(["export", str(bundle), "--roi_size", "64,32,32", "--overrides", '{"feature_size": 12}'])
    assert status == 0, stdout.getvalue()
    return ExportedBundle(bundle, stdout.getvalue())
