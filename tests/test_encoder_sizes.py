"""benchmarks/encoder_sizes.py: the JSON it prints at a tiny size, and the parameters that ``use_v2`` adds.

No timing is asserted (the machine is shared); the parameter counts and the structure of the estimate are exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "encoder_sizes.py"


@pytest.fixture(scope="module")
def benchmarks_on_path():
    """The benchmark imports its neighbours (``machine``, ``ssl_step``) as top-level modules, as when run as a script."""
    sys.path.insert(0, str(SCRIPT.parent))
    yield
    sys.path.remove(str(SCRIPT.parent))


def _v2_block_weights(feature_size: int) -> int:
    """MONAI's ``UnetrBasicBlock`` before each stage (``layers1c`` .. ``layers4c``): two bias-free 3x3x3 convolutions
    on the stage's ``c`` = f, 2f, 4f, 8f channels, instance norms without parameters."""
    return sum(2 * 27 * (feature_size * 2**stage) ** 2 for stage in range(4))


@pytest.mark.parametrize("feature_size", [12, 48, 192])
def test_v2_adds_the_residual_blocks_parameters(feature_size, benchmarks_on_path):
    """Counted with the parameters on ``meta``: feature 192 costs no memory."""
    from encoder_sizes import parameter_counts

    counts = parameter_counts(feature_size)
    assert counts["v2_blocks"] == counts["encoder"] - counts["encoder_v1"] == _v2_block_weights(feature_size)
    assert counts["v2_blocks"] == 4590 * feature_size**2
    if feature_size == 48:  # SwinUNETR v1 at feature 48: 62.19 M, its encoder 8.06 M (as SSLHead's, test_networks)
        assert (counts["swinunetr"] - counts["v2_blocks"], counts["encoder_v1"]) == (62_187_296, 8_062_002)


def test_json_at_a_tiny_size():
    """The script's JSON at features 12 and 24 (estimates at 64^3), the CPU step (64x32x32, one step after the
    warm-up) at 12 only, as asked."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--sizes", "12,24", "--roi", "64", "--cpu_step", "--cpu_sizes", "12",
         "--iters", "1", "--threads", "1"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # one JSON object, nothing else on stdout
    assert result["benchmark"] == "encoder_sizes" and result["use_v2"] is True and result["window_size"] == 7
    assert len(result["machine"]["load_avg_1_5_15_at_end"]) == 3 and result["wall_s"] > 0
    assert list(result["sizes"]) == ["12", "24"]
    assert result["sizes"]["24"]["cpu_step"] == "not measured"
    assert result["sizes"]["24"]["parameters"]["v2_blocks"] == _v2_block_weights(24)
    assert result["sizes"]["24"]["step_estimate"]["attention"] == {"fused kernel": 8}  # head size 8
    entry = result["sizes"]["12"]
    assert entry["parameters"]["v2_blocks"] == _v2_block_weights(12) == 660_960
    assert entry["parameters"]["encoder"] - entry["parameters"]["encoder_v1"] == 660_960
    estimate = entry["step_estimate"]
    assert estimate["step_inputs"] == [[4, 1, 64, 64, 64]] and estimate["free_gib"] == 80.0
    assert estimate["attention"] == {"explicit": 8}  # head size 4 at feature 12: the fused kernels refuse it
    assert 0 < estimate["weights_grads_adamw_gib"] < estimate["total_gib"] < 80
    assert estimate["auto_checkpointing"] is False  # 2 GiB with the margin fits in 80
    # the step's states: weights, gradients and two AdamW moments in float32
    assert estimate["weights_grads_adamw_gib"] == round(16 * entry["parameters"]["swinunetr"] / 2**30, 2)
    step = entry["cpu_step"]
    assert step["roi_size"] == [64, 32, 32] and len(step["s_per_step"]) == 1 and step["s_per_step_median"] > 0
    assert step["loss_finite"] is True
    assert step["peak_rss_gib"] > step["rss_before_network_gib"] > 0
    assert step["optimizer"] == "adamw" and step["estimate_cpu_gib"] == step["adamw_estimate_gib"]
    assert step["mem_available_gib"] > step["adamw_estimate_gib"]


def test_a_step_whose_adamw_states_do_not_fit_is_timed_with_sgd(benchmarks_on_path):
    """Where AdamW's estimate exceeds the memory available (H on a 23 GB host), the step runs with SGD and the entry
    says so; the estimate beside it drops AdamW's two moments (8 bytes per weight)."""
    from encoder_sizes import cpu_step, parameter_counts

    step = cpu_step(12, [64, 32, 32], iters=1, threads=1, available_bytes=2**20)
    assert step["optimizer"] == "sgd" and step["mem_available_gib"] == 0.0 and step["loss_finite"] is True
    dropped_gib = 8 * parameter_counts(12)["swinunetr"] / 2**30
    assert step["adamw_estimate_gib"] - step["estimate_cpu_gib"] == pytest.approx(dropped_gib, abs=0.011)


def test_bad_sizes_fail_before_any_work(benchmarks_on_path, capsys):
    from encoder_sizes import main

    for argv, fragment in ((["--sizes", "40"], "multiples of 12 (got [40])"), (["--roi", "32"], "--roi 32")):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2 and fragment in capsys.readouterr().err
