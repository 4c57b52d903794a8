"""The low-data protocol's generated doc blocks (benchmarks/low_data_docs.py): tables of both models, the coverage of
the intervals, and the sentence a block shows while its summary has not been measured."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import low_data  # noqa: E402
import low_data_docs as docs  # noqa: E402
import low_data_stats as stats  # noqa: E402


def test_a_coverage_block_shows_the_summarys_coverage_table(tmp_path):
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"coverage": stats.coverage([[-1.0, 0.0, 1.0]], ns=(3, 5), draws=400, resamples=50)}))
    begin = docs.COVERAGE_BLOCK.format(summary=summary.as_posix())
    doc = tmp_path / "doc.md"
    doc.write_text(f"Before.\n\n{begin}\nstale\n{docs.block_end('coverage')}\n\nAfter.\n")
    assert docs.write_doc_tables(doc, summary) and not docs.write_doc_tables(doc, summary)
    text = doc.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    range_3 = json.loads(summary.read_text())["coverage"]["by_n"]["3"]["range"]
    assert rows[0] == "| interval | n = 3 | n = 5 |" and len(rows) == 2 + 3
    assert rows[4].startswith(f"| range [min, max] (below 5 pairs; never called 95 %) | {range_3['mean']:.3f} ({range_3['min']:.3f}) |")
    assert text.startswith("Before.\n\n") and text.endswith("\n\nAfter.\n") and "stale" not in text


def test_coverage_is_written_into_a_summary_from_its_records(tmp_path, monkeypatch, capsys):
    """``--coverage`` recomputes the populations from the records and adds ``coverage`` to the summary, nothing else.
    Its simulation is made smaller here (test_low_data_stats recomputes the committed one at its full size)."""
    original = json.loads((REPO / "benchmarks/results/low_data_cpu_9seeds.json").read_text())
    original.pop("coverage", None)
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(original))
    monkeypatch.setattr(stats, "coverage", functools.partial(stats.coverage, draws=200, resamples=100))
    low_data.main(["--coverage", str(summary), "--results", str(REPO / "benchmarks/results/low_data_cpu")])
    written = json.loads(summary.read_text())
    assert {k: v for k, v in written.items() if k != "coverage"} == original
    populations = stats.summary_populations(original, REPO / "benchmarks/results/low_data_cpu")
    assert written["coverage"] == stats.coverage(populations) and written["coverage"]["draws"] == 200
    assert written["coverage"]["populations"] == 32 and json.loads(capsys.readouterr().out) == written["coverage"]


def _summary_of(entry: dict) -> dict:
    """A summary with one arm's table and one contrast's entry, for both models (the last model 0.1 lower)."""
    table = {h: {m: {"ssl": {"1": {"mean": 0.5 - 0.1 * (m == "last"), "sd": 0.1, "n": 9}}} for m in ("selected", "last")}
             for h in ("in_domain", "shifted")}  # fmt: skip
    last = {**entry, "mean": entry["mean"] - 0.1}
    numerics = {"device": "cpu", "torch": "2.13.0+cpu", "monai": "1.6.1", "cpu_capability": "AVX512"}
    rankme = {"crops": 256, "bound": 192, "encoders": {"random": {"rankme": 6.39, "rankme_centred": 17.46, "mean_share": 0.904},
                                                       "ssl": {"rankme": 14.04, "rankme_centred": 4.44, "mean_share": 0.2285}},
              "agreement_with_probe_arms": {"1": {"rankme_order": ["ssl", "random"], "probe_dice_order": ["random", "ssl"]}}}
    return {"settings": {"ks": [1], "target_half_width": 0.03, "numerics": numerics}, "table": table, "complete": True,
            "missing_runs": [], "commits": ["97b568a647a103cd78936910f3bf824e58115691"], "pretraining": {"ssl": {}},
            "runs": [{}] * 18, "machine": {"cpu_model": "AMD EPYC", "cpu_count": 2, "parallel_runs": 2, "threads_per_run": 1},
            "rankme": rankme, "paired": {h: {"selected": {"ssl - scratch": {"1": entry}}, "last": {"ssl - scratch": {"1": last}}}
                                         for h in ("in_domain", "shifted")}}  # fmt: skip


def test_the_tables_say_where_and_with_what_code_they_were_measured_and_the_encoders_rankme():
    summary = _summary_of(stats.paired_entry([0.01, 0.02, 0.03, 0.04, 0.05]))
    assert docs.measured_markdown(summary) == ("Measured at commit 97b568a on AMD EPYC, 2 CPUs (AVX512), torch 2.13.0+cpu, MONAI 1.6.1: 1 pretraining "
                     "and 18 finetuning runs, 2 side by side with 1 thread each; the record of every run is committed "
                     "beside the summary. RankMe of the encoders on 256 held-out crops (at most 192): random 6.4, ssl 14.0; with "
                     "the embeddings' mean removed (it holds 90 %, 23 % of their squared norm): 17.5, 4.4. Highest RankMe "
                     "first, k = 1: ssl, random by RankMe, random, ssl by the probes' Dice.\n")  # fmt: skip
    dirty = {**summary, "commits": [*summary["commits"], summary["commits"][0] + "+changes"]}  # tracked files differed
    assert docs.measured_markdown(dirty).startswith("Measured at commit 97b568a, 97b568a+changes on AMD EPYC")
    gpu = {**summary, "settings": {**summary["settings"], "numerics": {"device": "cuda", "torch": "2.13.0", "monai": "1.6.1"}},
           "rankme": {"crops": 0, "encoders": {}}}  # fmt: skip
    assert docs.measured_markdown(gpu) == ("Measured at commit 97b568a on CUDA, torch 2.13.0, MONAI 1.6.1: 1 pretraining and 18 "
                                           "finetuning runs, 2 side by side with 1 thread each; the record of every run is "
                                           "committed beside the summary.\n")  # fmt: skip


def test_every_table_is_shown_for_the_selected_and_the_last_model():
    entry = stats.paired_entry([0.01, 0.02, 0.03, 0.04, 0.05])
    text = docs.markdown_tables(_summary_of(entry))
    titles = [line for line in text.splitlines() if line.endswith(":")]
    assert [t.split(",")[1].strip() + ", " + t.split(",")[2].split(" models")[0].strip() for t in titles] == [
        "in-domain set, selected", "in-domain set, selected", "shifted set, selected", "shifted set, selected",
        "in-domain set, last", "in-domain set, last", "shifted set, last", "shifted set, last"]
    rows = [line for line in text.splitlines() if line.startswith("| ssl")]
    assert rows[0] == "| ssl | 0.500 +- 0.100 (9) |" and rows[-2] == "| ssl | 0.400 +- 0.100 (9) |"
    assert rows[1].startswith("| ssl - scratch | +0.030 [") and rows[-1].startswith("| ssl - scratch | -0.070 [")


def test_a_tables_block_shows_both_models_or_says_the_summary_is_not_measured(tmp_path):
    summary = tmp_path / "results" / "plan.json"
    begin = docs.TABLES_BLOCK.format(summary=summary.as_posix())
    doc = tmp_path / "doc.md"
    doc.write_text(f"{begin}\nold\n{docs.block_end('tables')}\n")
    docs.write_doc_tables(doc, summary)
    assert doc.read_text() == f"{begin}\n\n{docs.not_measured(summary.as_posix())}\n\n{docs.block_end('tables')}\n"
    assert docs.not_measured("x.json").count(".") == 2 and "has not been measured at this commit" in docs.not_measured("x.json")
    summary.parent.mkdir()
    summary.write_text(json.dumps(_summary_of(stats.paired_entry([0.01, 0.02, 0.03, 0.04, 0.05]))))
    assert docs.write_doc_tables(doc, summary)
    written = json.loads(summary.read_text())
    assert f"{docs.measured_markdown(written)}\n{docs.markdown_tables(written)}" in doc.read_text()
    summary.write_text(json.dumps({**written, "complete": False, "missing_runs": ["ssl k=1 seed=8"]}))
    with pytest.raises(ValueError, match="is not complete \\(1 runs missing\\)"):
        docs.write_doc_tables(doc, summary)
    summary.write_text(json.dumps({**written, "superseded": "by the protocol of a later commit"}))
    with pytest.raises(ValueError, match="superseded \\(by the protocol of a later commit\\)"):
        docs.write_doc_tables(doc, summary)


def _findings_summary() -> dict:
    """Two contrasts per baseline at k = 1 and 2: ssl above scratch (t-interval above 0) on the in-domain set's
    selected models only, mim below it on the shifted set's last models, the probes within their intervals but for
    three pairs at k = 2 (a range: no stated coverage)."""
    above, below = stats.paired_entry([0.04, 0.05, 0.06, 0.05, 0.05]), stats.paired_entry([-0.04, -0.05, -0.06, -0.05, -0.05])
    within, short = stats.paired_entry([-0.05, 0.05, 0.0, 0.02, -0.02]), stats.paired_entry([0.04, 0.05, 0.06])
    paired = {}
    for held_out in ("in_domain", "shifted"):
        for model in ("selected", "last"):
            ssl = above if (held_out, model) == ("in_domain", "selected") else within
            mim = below if (held_out, model) == ("shifted", "last") else within
            paired.setdefault(held_out, {})[model] = {
                "ssl - scratch": {"1": ssl, "2": within}, "mim - scratch": {"1": within, "2": mim},
                "probe_ssl - probe_random": {"1": within, "2": short}, "probe_mim - probe_random": {"1": within, "2": within}}
    return {"paired": paired}


def test_the_findings_name_the_arms_beyond_their_interval_and_count_the_rest():
    text = docs.findings_markdown(_findings_summary())
    assert text == (
        "ssl beats scratch beyond the 95 % t-interval (3-5 paired seeds per cell): ssl above in 1 of 8 cells "
        "(k = 1: in-domain selected); mim below in 1 of 8 cells (k = 2: shifted last). "
        "No arm beats probe_random beyond its 95 % t-interval (3-5 paired seeds per cell): probe_ssl within its interval "
        "in 4 of 8 cells, 4 without a t-interval; probe_mim within its interval in all 8 cells.\n")
    everywhere = {h: {m: {"ssl - scratch": {"1": stats.paired_entry([0.05] * 4 + [0.06])}} for m in ("selected", "last")}
                  for h in ("in_domain", "shifted")}  # fmt: skip
    assert docs.findings_markdown({"paired": everywhere}).startswith("ssl beats scratch beyond the 95 % t-interval "
                                                                     "(5 paired seeds per cell): ssl above in all 4 cells.")


def test_a_findings_block_says_not_measured_then_shows_the_summarys_findings(tmp_path):
    summary = tmp_path / "plan.json"
    begin = docs.FINDINGS_BLOCK.format(summary=summary.as_posix())
    doc = tmp_path / "README.md"
    doc.write_text(f"## What pretraining buys\n\n{begin}\nold\n{docs.block_end('findings')}\n")
    docs.write_doc_tables(doc, summary)
    assert doc.read_text().count(docs.not_measured(summary.as_posix())) == 1
    summary.write_text(json.dumps({**_findings_summary(), "complete": True, "missing_runs": []}))
    assert docs.write_doc_tables(doc, summary)
    assert f"{begin}\n\n{docs.findings_markdown(_findings_summary()).rstrip()}\n\n{docs.block_end('findings')}" in doc.read_text()


def test_write_docs_names_a_missing_document_before_writing_any(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text(f"{docs.TABLES_BLOCK.format(summary='x.json')}\nold\n{docs.block_end('tables')}\n")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "low_data.py"), "--markdown", "x.json", "--write_docs",
                           str(doc), str(tmp_path / "README.md")], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(f"--write_docs: no such file: {tmp_path / 'README.md'}")
    assert "old" in doc.read_text()  # nothing written
