"""The inpainting / contrastive views are bit for bit those of the recorded implementation for fixed seeds.

``tests/golden/inpainting_views.json`` holds, per case, the SHA-256 of every tensor the views return (and of the
input), written by the implementation these views replaced (0.4.0's batched box rasteriser). A refactor of
``components.recipes.inpainting_contrast.views`` must keep every hash: the SSL bundle's trained weights depend on them.
The cases cover the CPU path, the accelerator's draw (``sync=False``), host-drawn boxes, several channels and dtypes,
heavy overlap with hundreds of boxes a sample, one-voxel boxes, torch's default generator and the SSL bundle's step
(4 crops of 96^3).

An input hash that differs means torch's random streams changed (a new torch), not the views: regenerate the file
with ``python tests/test_views_golden.py --write`` only after checking the views against an implementation known to be
right on that torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest
import torch

from components.recipes.inpainting_contrast.views import aug_rand, ssl_views
from tests.test_engine import _one_thread  # noqa: F401 (autouse fixture: one thread here too)

GOLDEN = Path(__file__).resolve().parent / "golden" / "inpainting_views.json"

#: name -> (function, shape, dtype, seed, options); ``box_seed`` adds a CPU box_generator seeded with it,
#: ``default_generator`` seeds torch's default generator instead of passing one
CASES: dict[str, tuple[str, tuple[int, ...], str, int, dict]] = {
    "aug_cpu": ("aug_rand", (4, 1, 32, 32, 32), "float32", 0, {}),
    "aug_channels_anisotropic": ("aug_rand", (3, 2, 24, 32, 40), "float32", 1, {}),
    "aug_accelerator_draw": ("aug_rand", (3, 2, 32, 32, 32), "float32", 2, {"sync": False}),
    "aug_host_boxes": ("aug_rand", (4, 1, 32, 32, 32), "float32", 3, {"sync": False, "box_seed": 4}),
    "aug_heavy_overlap": ("aug_rand", (3, 2, 20, 24, 16), "float32", 5,
                          {"max_drop": 1.0, "max_block": 0.25, "min_block": 0.1}),  # fmt: skip
    "aug_one_voxel_boxes": ("aug_rand", (2, 1, 20, 20, 20), "float32", 6, {"max_block": 0.1}),
    "aug_bfloat16": ("aug_rand", (2, 1, 32, 32, 32), "bfloat16", 7, {}),
    "aug_float64": ("aug_rand", (2, 2, 24, 24, 24), "float64", 8, {}),
    "aug_one_sample": ("aug_rand", (1, 1, 32, 32, 32), "float32", 9, {}),
    "aug_default_generator": ("aug_rand", (3, 1, 32, 32, 32), "float32", 10, {"default_generator": True}),
    "ssl_small_accelerator_draw": ("ssl_views", (3, 1, 32, 32, 32), "float32", 11, {"sync": False}),
    "ssl_bundle_step": ("ssl_views", (4, 1, 96, 96, 96), "float32", 12, {}),
    "ssl_bundle_step_host_boxes": ("ssl_views", (4, 1, 96, 96, 96), "float32", 13, {"box_seed": 14}),
}


def _sha(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's dtype, shape and bytes."""
    data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode() + data).hexdigest()


def run_case(name: str) -> dict[str, str]:
    """The case's input and output hashes, and how many voxels the views changed (a readable clue on failure)."""
    function, shape, dtype, seed, options = CASES[name]
    options = dict(options)
    x = (torch.rand(shape, generator=torch.Generator().manual_seed(1000 + seed)) * 3 + 2).to(getattr(torch, dtype))
    box_seed = options.pop("box_seed", None)
    if box_seed is not None:
        options["box_generator"] = torch.Generator().manual_seed(box_seed)
    if options.pop("default_generator", False):
        torch.manual_seed(seed)
        generator = None
    else:
        generator = torch.Generator().manual_seed(seed)
    if function == "aug_rand":
        out = aug_rand(x, generator, **options)
        return {"input": _sha(x), "output": _sha(out), "changed": int((out != x).sum())}
    views = ssl_views(x, generator, **options)
    return {"input": _sha(x), "inputs": _sha(views.inputs), "rot_labels": _sha(views.rot_labels),
            "targets": _sha(views.targets), "changed": int((views.inputs != views.targets).sum())}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_views_equal_the_recorded_views(name):
    recorded = json.loads(GOLDEN.read_text())["cases"][name]
    found = run_case(name)
    assert found["input"] == recorded["input"], "torch's random stream changed (see the module docstring)"
    assert found == recorded


def test_one_ulp_in_one_voxel_changes_the_hash():
    """The check can fail: views that differ by one ulp in one voxel hash differently."""
    out = aug_rand(torch.rand(2, 1, 32, 32, 32), torch.Generator().manual_seed(0))
    nudged = out.clone()
    nudged[1, 0, 5, 6, 7] = torch.nextafter(out[1, 0, 5, 6, 7], torch.tensor(2.0))
    assert _sha(nudged) != _sha(out) and _sha(out.clone()) == _sha(out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write tests/golden/inpainting_views.json from the current views.")
    parser.add_argument("--write", action="store_true", required=True)
    parser.parse_args()
    torch.set_num_threads(1)
    GOLDEN.parent.mkdir(exist_ok=True)
    cases = {name: run_case(name) for name in CASES}
    GOLDEN.write_text(json.dumps({"torch": torch.__version__, "cases": cases}, indent=4) + "\n")
