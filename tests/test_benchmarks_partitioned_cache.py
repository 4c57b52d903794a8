"""The partitioned-cache benchmark runs in its --small mode and reports what it promises (no timing assertions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "partitioned_cache.py"


def test_small_mode_reports_partitioned_vs_full(tmp_path):
    out = tmp_path / "partitioned_cache.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--small", "--out", str(out), "--timeout", "240"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout[proc.stdout.index("{") :]) == result  # the same JSON on stdout
    assert result["benchmark"] == "partitioned_cache" and result["num"] == 4 and result["world_size"] == 2
    assert set(result["variants"]) == {"full", "partitioned"}
    keys = {"volumes_per_rank", "cache_seconds", "cached_bytes_per_rank", "rss_growth_bytes_per_rank",
            "peak_rss_growth_bytes_per_rank", "per_rank"}  # fmt: skip
    for variant in result["variants"].values():
        assert keys <= set(variant)
        assert len(variant["per_rank"]) == 2 and all(r["cache_seconds"] > 0 for r in variant["per_rank"])
    full, part = result["variants"]["full"], result["variants"]["partitioned"]
    # pitfall a: every rank of the plain variant caches all 4 volumes, a partitioned rank its 2
    assert full["volumes_per_rank"] == 4 and part["volumes_per_rank"] == 2
    assert 0 < part["cached_bytes_per_rank"] < full["cached_bytes_per_rank"]
    assert set(result["ratios"]) >= {"memory_ratio", "peak_memory_ratio", "cached_bytes_ratio", "time_ratio"}
    assert set(result["meets_targets"]) == set(result["targets"]) == {"memory_ratio", "time_ratio"}
