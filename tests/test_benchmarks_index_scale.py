"""benchmarks/index_scale.py: a small run reads, on every rank, its shard's entries of the index and no more (the
datalist's all), the 0.4.0 layout every entry; docs/scale.md shows the table of the committed result. No timing is
asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))


@pytest.mark.slow
def test_a_small_run_reads_each_ranks_shard_of_the_index(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "index_scale.py"), "--work", str(tmp_path),
                           "--sizes", "3000", "--old_sizes", "3000", "--ranks", "3", "--parts", "2", "--out", "-"],
                          capture_output=True, text=True, timeout=900, cwd=REPO, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # exactly one JSON object on stdout
    size = result["sizes"]["3000"]
    assert size["bytes"]["index.json"] < 10_000 < size["bytes"]["entries.jsonl"]
    assert [r["rank"] for r in size["index"]["ranks"]] == [0, 1, 2]
    for rank in size["index"]["ranks"]:
        assert rank["store_dataset"]["entries_read"] == rank["store_dataset"]["entries_held"] == 1000
    for rank in size["datalist"]["ranks"]:
        assert rank["load_datalist"]["entries"] == 3000
        assert rank["training_store"]["entries_read"] == rank["training_store"]["entries_held"] == 1000
    assert size["old"]["ranks"][0]["old_index"]["entries_read"] == 3000
    assert len(result["machine"]["load_avg_1_5_15_at_end"]) == 3


def test_docs_show_the_table_of_the_committed_result():
    from index_scale import DOC_BLOCK, DOC_BLOCK_END, markdown

    result = json.loads((REPO / "benchmarks" / "results" / "index_scale.json").read_text())
    assert "not a clean measurement" in result["caveat"]
    doc = (REPO / "docs" / "scale.md").read_text()
    block = doc.split(DOC_BLOCK, 1)[1].split(DOC_BLOCK_END, 1)[0]
    assert block.strip() == markdown(result).strip(), "python benchmarks/index_scale.py --markdown ... into docs/scale.md"
    for size, entry in result["sizes"].items():
        for rank in entry["index"]["ranks"]:
            assert rank["store_dataset"]["entries_read"] == -(-int(size) // result["settings"]["ranks"])
