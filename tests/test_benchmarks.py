"""The benchmarks (benchmarks/*.py) run in their CI-sized ``--small`` form and print what they promise.

Only shapes and sanity are asserted, never timings: CI machines are shared and noisy. The one figure asserted is
the cache's bytes, which do not depend on the machine.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"


def _run(script: str, *args: str, timeout: int = 600) -> dict:
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)  # exactly one JSON object on stdout, nothing else


def _machine_ok(machine: dict) -> None:
    assert machine["cpu_count"] >= 1 and len(machine["load_avg_1_5_15"]) == 3
    assert len(machine["load_avg_1_5_15_at_end"]) == 3


@pytest.mark.slow
def test_ssl_step_small():
    result = _run("ssl_step.py", "--small")
    assert result["benchmark"] == "ssl_step"
    _machine_ok(result["machine"])
    ci = result["sizes"]["ci"]
    assert ci["roi_size"] == [64, 32, 32] and ci["feature_size"] == 12 and ci["views_per_step"] == 2
    phases = {"data", "views", "forward", "loss", "backward", "optimizer", "gather", "logging", "other"}
    for key in ("phase_median_s", "cpu_phase_median_s"):
        assert set(ci[key]) == phases | {"total"}
        assert all(ci[key][p] >= 0 for p in phases - {"other"})  # "other" = total - the rest, per iteration
        assert ci[key]["total"] >= max(ci[key][p] for p in phases)  # medians are not additive, maxima are bounded
    assert set(ci["phase_share_of_iteration"]) == phases
    assert ci["iterations_measured"] == len(ci["pair_ratios"]) == len(ci["cpu_pair_ratios"]) >= 2
    assert ci["overhead_ratio"] > 0 and ci["overhead_ratio_cpu"] > 0 and ci["bare_iteration_median_s"] > 0
    allocator = result["allocator"]
    for mode in ("plain", "tuned"):
        stats = allocator[mode]
        assert stats["iteration_median_s"] > 0
        assert stats["user_s_per_iteration"] >= 0 and stats["system_s_per_iteration"] >= 0
    assert allocator["plain"]["applied"] is False
    assert allocator["tuned"]["applied"] is (sys.platform == "linux")
    assert allocator["tuned_over_plain"] > 0
    assert set(result["targets"]) >= {"overhead_ratio_met", "overhead_ratio_cpu_met", "allocator_ratio_met"}
    # throughput and FLOPs of the bundle and of the research code's configuration, measured in the same run
    reference = result["reference_style"]["ci"]
    assert ci["configuration"] == {"fused_attention": True, "amp": False, "amp_dtype": None, "use_checkpoint": False,
                                   "compile": False, "views": "batched"}  # fmt: skip
    assert reference["configuration"] == {"fused_attention": False, "amp": True, "amp_dtype": "float16",
                                          "use_checkpoint": True, "compile": False, "views": "per_box"}  # fmt: skip
    assert reference["use_checkpoint_applied"] is True and ci["use_checkpoint_applied"] is False
    for run in (ci, reference):
        # one crop per step; crops_per_s is rounded to 3 decimals (0.032 for a 30 s step on a loaded machine)
        assert run["crops_per_s"] == pytest.approx(1000 / run["ms_per_step"], rel=0.01, abs=5e-4)
        assert run["tflops_per_s"] == pytest.approx(run["flops_per_step"] / run["ms_per_step"] / 1e9, rel=0.01, abs=1e-4)
        assert run["share_of_bf16_peak"] is None and run["peak_gpu_memory_gib"] is None  # no GPU here
    # checkpointing recomputes the forward: more FLOPs for the same step
    assert 1.1 < reference["flops_per_step"] / ci["flops_per_step"] < 2.0
    assert ci["reference_over_bundle"] == pytest.approx(reference["ms_per_step"] / ci["ms_per_step"], rel=0.01)


def test_finetune_step_small():
    """Both configurations run the BTCV trainer: before (fresh workers, a checkpoint every epoch) and the bundle's
    defaults (persistent workers, checkpoints by time: only the final one in a run this short)."""
    result = _run("finetune_step.py", "--small")
    assert result["benchmark"] == "finetune_step" and result["size"] == "ci"
    _machine_ok(result["machine"])
    before, bundle = result["configurations"]["fresh_workers_epoch_checkpoints"], result["configurations"]["bundle"]
    assert (before["persistent_workers"], bundle["persistent_workers"]) == (False, True)
    assert before["checkpoint_saves_at_iterations"] == [2, 4, 6, 8] and bundle["checkpoint_saves_at_iterations"] == [8]
    for run in (before, bundle):
        assert run["epochs"] == 4 and run["iterations_per_epoch"] == 2 and run["num_workers"] == 1
        assert run["ms_per_iteration"] > 0 and run["epoch_s_median"] > run["epoch_overhead_s_median"] >= 0
        assert run["crops_per_s"] == pytest.approx(1000 / run["ms_per_iteration"], rel=0.01)


def test_augment_small():
    result = _run("augment.py", "--small")
    assert result["benchmark"] == "augment" and result["size"] == 32 and result["batch"] == 4
    _machine_ok(result["machine"])
    timing = result["timing"]
    for kind in ("one_view", "ssl_views_two_views"):
        assert timing[kind]["ours"]["median_s"] > 0 and timing[kind]["reference"]["median_s"] > 0
    assert timing["speedup_one_view"] > 0 and timing["speedup_two_views"] > 0
    traffic = result["traffic"]
    for path in ("accelerator", "host_boxes", "cpu"):
        assert traffic[path]["kernels_median"] > 100 and traffic[path]["gb_written_median"] > 0
    # the host-drawn boxes are trimmed as on the CPU: far fewer bytes than every slot of the budget
    assert traffic["host_boxes_over_accelerator_bytes"] < 0.8
    dist = result["distributions"]
    assert set(dist) == {"changed_fraction", "box_volume", "box_side", "boxes_per_inner_pass", "paste_passes"}
    for stats in dist.values():
        assert 0.0 <= stats["ks"]["statistic"] <= 1.0 and 0.0 <= stats["ks"]["p_value"] <= 1.0
        assert stats["ours"]["n"] > 0 and stats["reference"]["n"] > 0
    # the semantics are the same: box sides lie in [int(0.05 * 32), int(0.25 * 32) - 1] = [1, 7] for both
    for impl in ("ours", "reference"):
        assert 1 <= dist["box_side"][impl]["p10"] <= dist["box_side"][impl]["p90"] <= 7
        assert 0 < dist["changed_fraction"][impl]["mean"] < 0.6


def test_augment_share_of_a_saved_step(tmp_path):
    saved = tmp_path / "ssl_step.json"
    paper = {"phase_median_s": {"forward": 2.0, "loss": 0.1, "backward": 3.9}, "crops_per_step": 2}
    saved.write_text(json.dumps({"sizes": {"paper": paper}, "machine": {"cpu_count": 2}}))
    result = _run("augment.py", "--small", "--ssl-step-json", str(saved))
    share = result["share_of_paper_step"]
    assert share["paper_forward_backward_s_per_crop"] == 3.0
    views = result["timing"]["ssl_views_two_views"]["ours"]["median_s"]
    # the share is the reported (rounded) median over 3.0 s x 4 crops, itself rounded to 1e-5; comparing within
    # half a unit of the last digit fails when the quotient lies on the boundary (0.0057 / 12 = 0.000475)
    assert share["views_share_of_forward_backward"] == round(views / 12.0, 5)


def test_views_against_revision_small(tmp_path):
    """This checkout's views against a copy of themselves: identical on both paths, both sides timed; against views
    that differ in one voxel: not identical, exit 1."""
    views = REPO / "components" / "recipes" / "inpainting_contrast" / "views.py"
    result = _run("views_against_revision.py", "--small", "--before-file", str(views), "--conditions", "CI")
    assert result["benchmark"] == "views_against_revision" and result["size"] == 32 and result["reps"] == 2
    assert result["conditions"] == "CI"
    _machine_ok(result["machine"])
    assert set(result["paths"]) == {"cpu", "host_boxes"}
    for path in result["paths"].values():
        assert path["identical"] is True
        assert path["before_median_s"] > 0 and path["after_median_s"] > 0 and path["after_over_before_median"] > 0
    changed = tmp_path / "views.py"
    changed.write_text(views.read_text().replace("    return _paste(inner, draws.partner, draws.paste)",
                                                 "    return _paste(inner, draws.partner, draws.paste).add_(1e-3)"))  # fmt: skip
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "views_against_revision.py"), "--small", "--before-file",
                           str(changed)], capture_output=True, text=True, timeout=600, cwd=REPO)  # fmt: skip
    assert proc.returncode == 1 and not any(p["identical"] for p in json.loads(proc.stdout)["paths"].values())


def test_cache_small():
    result = _run("cache.py", "--small")
    assert result["benchmark"] == "cache" and result["roi"] == [96, 96, 96]
    _machine_ok(result["machine"])
    recipe, compact = result["recipe"], result["compact"]
    assert recipe["volumes"] == compact["volumes"] == 4
    assert recipe["dtype"] == "torch.float32" and compact["dtype"] == "torch.int16"
    assert 0 < compact["bytes_per_volume_max"] < recipe["bytes_per_volume_min"]
    assert compact["bytes_total"] <= 0.25 * recipe["bytes_total"]  # bytes do not depend on the machine
    ratio = compact["bytes_total"] / recipe["bytes_total"]
    assert result["compact_over_recipe"]["bytes"] == pytest.approx(ratio, abs=1e-4)
    for stats in (recipe, compact):
        assert stats["caching_s"] > 0 and stats["random_part_s_per_item"] > 0
    assert result["targets"]["bytes_ratio_met"] is True


def test_bundle_memory_counts_the_whole_process_tree():
    """bundle_memory.py sees memory held by a child of the measured command (as loader workers and torchrun ranks
    are): a parent holding 100 MiB with a child holding 300 MiB peaks at >= 400 MiB for the tree, >= 300 for one."""
    child = "import time; x = bytearray(300 * 2**20); x[::4096] = b'x' * len(x[::4096]); time.sleep(1.5)"
    parent = (
        "import subprocess, sys; y = bytearray(100 * 2**20); y[::4096] = b'y' * len(y[::4096]); "
        f"subprocess.run([sys.executable, '-c', {child!r}], check=True); print('Iter: 1/1')"
    )
    result = _run("bundle_memory.py", "--interval", "0.05", "--", sys.executable, "-c", parent)
    assert result["exit_code"] == 0 and result["first_iteration_s"] is not None
    assert result["peak_tree_pss_gb"] >= 0.39 and result["peak_tree_rss_gb"] >= 0.39
    assert 0.29 <= result["peak_process_rss_gb"] < result["peak_tree_rss_gb"]


def test_bundle_memory_sums_each_rank_with_its_workers_and_stops_at_an_iteration():
    """A launcher holding 150 MiB starts two ranks (LOCAL_RANK set, as torchrun does), each holding 100 MiB with a
    worker child holding 200 MiB: one rank's tree is its own and its worker's memory (>= 300 MiB), never the
    launcher's or the other rank's (< 450 MiB), in 2 processes; the run is ended once "Iter: 3/" is logged, before
    the launcher's long sleep."""
    sys.path.insert(0, str(BENCHMARKS))
    from bundle_memory import measure

    def hold(mib: int, then: str) -> str:
        fill = f"x = bytearray({mib} * 2**20); x[::4096] = b'x' * len(x[::4096])"
        return f"import os, subprocess, sys, time; {fill}; {then}"

    worker = hold(200, "time.sleep(60)")
    rank = hold(100, f"subprocess.Popen([sys.executable, '-c', {worker!r}]); time.sleep(60)")
    launcher = hold(150, "ranks = [subprocess.Popen([sys.executable, '-c', " + repr(rank)
                    + "], env={**os.environ, 'LOCAL_RANK': str(r)}) for r in range(2)]; time.sleep(2.5); "
                    "print('Iter: 1/9', flush=True); print('Iter: 3/9', flush=True); time.sleep(60)")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"}
    result = measure([sys.executable, "-c", launcher], interval=0.05, stop_at="iterations", iterations=3, timeout=50,
                     env=env)  # fmt: skip
    assert result["stopped"] == "iterations" and result["left_running"] == 0 and result["wall_s"] < 40
    assert result["iterations_s"] >= result["first_iteration_s"] > 2
    assert result["rank_tree_processes"] == 2
    assert 0.29 <= result["peak_rank_tree_rss_gb"] < 0.45 and 0.29 <= result["peak_rank_tree_pss_gb"] < 0.45
    assert result["peak_tree_rss_gb"] >= 2 * 0.29 + 0.14


def test_the_machine_names_its_cpu_model_and_vector_instructions():
    """VMs that both report "AMD EPYC" ran the low-data finetuning at very different speeds: a benchmark's figures
    name the CPU model and the vector instructions torch dispatches to."""
    sys.path.insert(0, str(BENCHMARKS))
    from machine import cpu_model, machine_info

    two_cpus = "processor\t: 0\nmodel name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2\n\nprocessor\t: 1\nmodel name\t: AMD EPYC 9R14\n"
    assert cpu_model(two_cpus) == "AMD EPYC 9R14" and cpu_model("flags : sse2\n") == "unknown"
    assert machine_info()["cpu_capability"] == torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2", "AVX512", "ZVECTOR", "SVE256")


def test_store_format_small():
    """Every candidate format returns crops equal to the volume's (the script checks each one); bytes do not depend
    on the machine: the compressed formats beat the raw memmap, and the store as shipped is its blosc2 setting."""
    result = _run("store_format.py", "--small")
    assert result["benchmark"] == "store_format" and result["shape"] == [128, 128, 96] and result["volumes"] == 2
    _machine_ok(result["machine"])
    formats = result["formats"]
    assert {"npy_memmap", "store_as_shipped", "zarr3_blosc_zstd3_shuffle_c64", "blosc2_lz4_shuffle_c64_b32"} <= set(formats)
    assert formats["npy_memmap"]["bytes_per_volume"] >= result["raw_bytes_per_volume"]
    shipped = formats["store_as_shipped"]
    setting = f"{shipped['codec']}{shipped['clevel']}_{shipped['filter']}_c{shipped['chunks'][0]}_b{shipped['blocks'][0]}"
    same = formats[f"blosc2_{setting}"]
    assert shipped["bytes_per_volume"] == pytest.approx(same["bytes_per_volume"], rel=0.01)
    for name, stats in formats.items():
        assert stats["crop_read_ms_p10"] <= stats["crop_read_ms_median"] <= stats["crop_read_ms_p90"], name
        if name != "npy_memmap":
            assert stats["bytes_per_volume"] < 0.5 * formats["npy_memmap"]["bytes_per_volume"], name


def test_finetune_crops_small(tmp_path):
    """The finetuning crops benchmark runs its three parts; its machine-independent figures hold: the crop-size
    layout reads fewer compressed bytes per crop than 64^3 chunks would hold, quantized images are smaller than
    exact ones within the error the store records, and both bundles' disk paths use the store crops."""
    result = _run("finetune_crops.py", "--small", "--work", str(tmp_path), timeout=900)
    assert result["benchmark"] == "finetune_crops"
    _machine_ok(result["machine"])
    for crop in result["layout"].values():
        old, new = crop["64^3 chunks, 32^3 blocks (format 1)"], crop["from the crop size"]
        assert new["chunks"] != old["chunks"] and new["crop_ms_p10"] <= new["crop_ms_median"]
    for floats in result["floats"].values():
        assert floats["quantized"]["image_bytes_per_volume"] < floats["exact"]["image_bytes_per_volume"]
        assert 0 < floats["quantized"]["max_abs_error"] <= floats["quantized"]["largest_magnitude"] / 32767
        assert "max_abs_error" not in floats["exact"]
    assert {c["crop_reader"] for c in result["crops"].values()} == {"StoreRandCropByPosNegLabeld",
                                                                   "StoreRandSpatialCropSamplesd"}
    for crops in result["crops"].values():
        assert crops["crops"] > 0 and crops["crops_per_s_disk"] > 0 and crops["crops_per_s_memory"] > 0


def _demo_summary(seed: int, dice: float) -> dict:
    steps = [{"step": "synthesise", "seconds": 1.0}, {"step": "SSL pretraining", "seconds": 230.5},
             {"step": "finetune, SSL init", "seconds": 200.25}]  # fmt: skip
    arm = {"mean_dice": dice, "per_class_dice": {"spleen": 0.9, "liver": None, "stomach": 0.75}}
    return {"seed": seed, "steps": steps, "arms": {"SSL init": arm}, "pretraining_health": {"verdict": "learning"}}


def test_demo_seeds_resumes_at_the_same_commit_and_tabulates(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from benchmarks import demo_seeds

    results = tmp_path / "demo_cpu.json"
    results.write_text(json.dumps({"commit": "old", "seeds": {"0": {}}, "budget_trials": {"kept": 1}}))
    monkeypatch.setattr(demo_seeds, "RESULTS", results)
    monkeypatch.setattr(demo_seeds, "git_commit", lambda: "abc")
    ran = []

    def fake_run(seed, work, extra):
        ran.append(seed)
        return {"wall_s": 440.4, "max_rss_kb": 1_300_000, "summary": _demo_summary(seed, 0.8 + seed / 100)}

    monkeypatch.setattr(demo_seeds, "run_seed", fake_run)
    first = demo_seeds.measure([0, 1], tmp_path, [])
    assert ran == [0, 1] and first["budget_trials"] == {"kept": 1}  # another commit's seeds are measured again
    assert first["earlier"] == {"old": {"seeds": {"0": {}}}}  # and kept under their commit
    demo_seeds.measure([1, 2], tmp_path, [])
    assert ran == [0, 1, 2]  # seed 1 was recorded at this commit
    rows = demo_seeds.table(json.loads(results.read_text())).splitlines()
    assert rows[2] == "| 2 | 230.5 s | learning | 200.2 s | 440 s | 1.3 GB | **0.820** | 0.90 | 0.75 |"
    assert demo_seeds.peak_rss_kb("\tMaximum resident set size (kbytes): 1279020\n") == 1279020
    with pytest.raises(ValueError, match="Maximum resident set size"):
        demo_seeds.peak_rss_kb("nothing")


def test_git_commit_ignores_recorded_results_but_not_code_and_descends_from_follows_history(tmp_path):
    """A benchmark that wrote its own results file must still match its commit when it resumes; a record follows a
    pre-registration only at a commit that descends from it."""
    sys.path.insert(0, str(REPO))
    from benchmarks.machine import descends_from, git_commit

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "benchmarks" / "results" / "demo_cpu.json").write_text("{}\n")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "start"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "benchmarks" / "results" / "demo_cpu.json").write_text('{"seeds": {"0": {}}}\n')
    assert git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "+changes"
    assert git_commit(tmp_path / "nowhere") == "unknown"
    subprocess.run([*git, "commit", "-qam", "next"], check=True)
    child = git_commit(tmp_path)
    assert descends_from(child, head, tmp_path) and descends_from(head, head, tmp_path)
    assert not descends_from(head, child, tmp_path) and not descends_from(child + "+changes", head, tmp_path)
    assert not descends_from(child, "0" * 40, tmp_path)


def test_changed_since_names_the_files_that_differ_from_a_commit_uncommitted_changes_included(tmp_path):
    """The frozen analysis code of a pre-registration: a change committed since, an uncommitted one and a deletion
    are named; other files are not; without git or the commit every file is (none can be shown unchanged)."""
    sys.path.insert(0, str(REPO))
    from benchmarks.machine import changed_since

    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    for name in ("a.py", "b.py", "c.py"):
        (tmp_path / name).write_text(f"{name[0]} = 1\n")
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "start"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    paths = ("a.py", "b.py")
    assert changed_since(head, paths, tmp_path) == []
    (tmp_path / "b.py").write_text("b = 2\n")  # uncommitted
    (tmp_path / "c.py").write_text("c = 2\n")  # not one of the paths
    assert changed_since(head, paths, tmp_path) == ["b.py"]
    subprocess.run([*git, "commit", "-qam", "next"], check=True)
    assert changed_since(head, paths, tmp_path) == ["b.py"]  # committed since
    (tmp_path / "a.py").unlink()
    assert changed_since(head, paths, tmp_path) == ["a.py", "b.py"]  # deleted
    assert changed_since("0" * 40, paths, tmp_path) == ["a.py", "b.py"]  # an unknown commit: every path
    assert changed_since(head, paths, tmp_path / "nowhere") == ["a.py", "b.py"]  # no repository


# a stand-in for a bundle run: writes the health report where --output_dir points, its rotation loss from --rotation
_FAKE_PRETRAINING = """
import json, sys
from pathlib import Path
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
(Path(args["--output_dir"])).mkdir(parents=True)
signal = {"value": float(args.get("--rotation", "1.39")), "baseline": 1.386, "verdict": "at baseline"}
report = {"iteration": 1003, "crops": 256, "verdict": "at baseline", "signals": {"rotation_loss": signal}}
(Path(args["--output_dir"]) / "health.json").write_text(json.dumps({"reports": [report]}))
"""


def test_demo_ssl_lever_reruns_the_demo_pretraining_with_its_overrides_only(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO))
    from benchmarks import demo_ssl_lever

    for seed in (3, 4):
        command = [sys.executable, "-c", _FAKE_PRETRAINING, "--output_dir", "/demo/eval", "--ckpt_dir", "/demo/models"]
        steps = [{"step": "synthesise", "command": []}, {"step": "SSL pretraining", "command": command}]
        (tmp_path / f"seed{seed}").mkdir()
        (tmp_path / f"seed{seed}" / "summary.json").write_text(json.dumps({"steps": steps}))
    out = tmp_path / "levers.json"
    monkeypatch.setattr(demo_ssl_lever, "git_commit", lambda: "abc")
    args = ["--work", str(tmp_path), "--seeds", "3", "--name", "lower", "--set", "rotation=1.25", "--out", str(out)]
    demo_ssl_lever.main(args)
    seed3 = json.loads(out.read_text())["levers"]["lower"]["seeds"]["3"]
    assert seed3["signals"]["rotation_loss"]["value"] == 1.25 and seed3["overrides"] == {"rotation": "1.25"}
    assert (tmp_path / "levers" / "lower" / "seed3" / "eval" / "health.json").is_file()  # not the demo's own folder
    assert not Path("/demo/eval").exists()
    (tmp_path / "levers" / "lower" / "seed3" / "eval" / "health.json").unlink()  # a rerun of seed 3 would fail now
    demo_ssl_lever.main([*args[:3], "3,4", *args[4:]])  # seed 3 is recorded: only seed 4 runs
    assert set(json.loads(out.read_text())["levers"]["lower"]["seeds"]) == {"3", "4"}
    with pytest.raises(ValueError, match="no pretraining step"):
        demo_ssl_lever.lever_command({"steps": [{"step": "synthesise", "command": []}]}, tmp_path, {})


# the signals each recipe's health report reads (components' recipes: pretext signals, then the embedding's)
HEALTH_SIGNALS = {
    "ssl": {"rotation_accuracy", "rotation_loss", "contrast_accuracy", "contrast_loss", "inpainting_l1", "embedding_std"},
    "dino": {"teacher_entropy", "student_teacher_kl", "prototypes_in_use", "embedding_std"},
    "mim": {"masked_l1", "masked_l1_median", "reconstruction_spread", "embedding_std"},
}
VERDICTS = {"learning", "at baseline", "collapsed"}


def _signals_ok(signals: dict, recipe: str) -> None:
    assert set(signals) == HEALTH_SIGNALS[recipe]
    for signal in signals.values():
        assert isinstance(signal["value"], float) and isinstance(signal["baseline"], float)
        assert signal["better"] in {"higher", "lower"} and signal["margin"] >= 0
        assert signal["verdict"] in VERDICTS | {"not collapsed"}


@pytest.mark.slow
def test_gpu_health_small(tmp_path):
    """gpu_health.py --small: the three recipes calibrated, planned within their shares and run, each with its final
    verdict, every signal beside its trivial baseline, and the report history, in one JSON named after the device."""
    from components.demo.recipes import MASKED_IMAGE_ROI_SIZE, SSL_ROI_SIZE

    result = _run("gpu_health.py", "--small", "--budget_s", "1200", "--out_dir", str(tmp_path), timeout=1500)
    assert json.loads((tmp_path / "gpu_health_cpu_small.json").read_text()) == result
    assert result["benchmark"] == "gpu_health" and result["device"] == "cpu" and result["small"] is True
    assert result["commit"] and result["torch"] and result["complete"] is True
    _machine_ok(result["machine"])
    corpus = result["corpus"]
    assert corpus["training"] == 4 and corpus["validation"] == 1 and min(corpus["shape_min"]) >= 64
    assert list(result["recipes"]) == ["ssl", "dino", "mim"]
    for recipe, entry in result["recipes"].items():
        assert entry["status"] == "done", entry
        calibration, plan = entry["calibration"], entry["plan"]
        assert calibration["epochs"] == 2 and calibration["iteration_s"] > 0 and calibration["startup_s"] >= 0
        assert calibration["report"]["iteration"] == 2 * calibration["epoch_length"]
        _signals_ok(calibration["report"]["signals"], recipe)
        # the plan: at most --small's 3 epochs, predicted inside what was left of the share, and the run is the plan
        assert 1 <= plan["max_epochs"] <= 3 and plan["predicted_s"] <= plan["available_s"] < entry["share_s"]
        assert plan["iterations"] == plan["max_epochs"] * calibration["epoch_length"] == entry["iterations"]
        overrides = entry["overrides"]
        assert overrides["max_epochs"] == plan["max_epochs"] and overrides["training#val_interval"] == plan["val_interval"]
        assert overrides["roi_size"] == {"ssl": SSL_ROI_SIZE, "mim": MASKED_IMAGE_ROI_SIZE, "dino": [32, 32, 32]}[recipe]  # the demo's
        assert overrides["feature_size"] == 12 and overrides["dataset_dir"] == "<work>/corpus"
        assert entry["seconds"] > 0 and entry["wall_s"] <= entry["share_s"] + 5
        assert entry["verdict"] in VERDICTS
        _signals_ok(entry["signals"], recipe)
        history = entry["history"]
        assert len(history) == plan["reports"] and history[-1]["iteration"] == entry["iterations"]
        assert history[-1]["signals"] == entry["signals"] and history[-1]["verdict"] == entry["verdict"]
        for kind in ("calibration", "main"):
            saved = json.loads((tmp_path / "gpu_health_cpu_small" / f"{recipe}_{kind}" / "health.json").read_text())
            assert saved["reports"][-1]["verdict"] == (entry["verdict"] if kind == "main" else calibration["report"]["verdict"])


def _plan_module():
    sys.path.insert(0, str(BENCHMARKS))
    import gpu_health_plan

    return gpu_health_plan


def test_gpu_health_shares_and_reports():
    plan = _plan_module()
    assert plan.share(300.0, 3) == 100.0 and plan.share(-5.0, 2) == 0.0
    with pytest.raises(ValueError, match="no recipe left"):
        plan.share(10.0, 0)
    # a report every quarter of the run and at its end
    assert [(plan.validation_interval(e), plan.report_count(e, plan.validation_interval(e))) for e in (1, 3, 8, 9, 10)] == [
        (1, 1), (1, 3), (2, 4), (2, 5), (2, 5)]  # fmt: skip


def test_gpu_health_calibration_to_epochs():
    """From a calibration's logged wall times to the epochs of the run that fits: 3 epochs of 14 iterations, the first
    10 iterations at 1 s (warm-up), then 0.5 s each; a validation of 2 s and a health report of 3 s at the end."""
    plan = _plan_module()
    walls = [(1, 10.0), (11, 20.0), (21, 25.0), (31, 30.0), (41, 35.0)]  # (iteration, wall time) logged every 10
    assert plan.iteration_seconds(walls, 14) == 0.5  # from iteration 21 on: the first epoch is start-up
    assert plan.iteration_seconds(walls, 40) == 0.5  # one logged after the first epoch: from the second logged on
    with pytest.raises(ValueError, match="cannot time iterations"):
        plan.iteration_seconds(walls[:1], 14)
    health_wall = 35.0 + 0.5 + 2.0 + 3.0  # iteration 42, the validation, the report
    calibration = plan.calibrate(walls, health_wall, iterations=42, epochs=3, wall_s=60.0, health_s=3.0, health_crops=16)
    assert (calibration.epoch_length, calibration.iteration_s) == (14, 0.5)
    assert calibration.validation_s == pytest.approx(2.0) and calibration.startup_s == pytest.approx(60 - 21 - 2 - 3)
    with pytest.raises(ValueError, match="not whole epochs"):
        plan.calibrate(walls, health_wall, iterations=43, epochs=3, wall_s=60.0, health_s=3.0, health_crops=16)

    # 200 s left: 0.85 * 200 - 3 = 167 s for 34 s of start-up, 7 s an epoch and 5 s a report (16 crops)
    crops = lambda interval: 16  # noqa: E731
    chosen = plan.plan_epochs(calibration, 200.0, crops)
    # 16 epochs: 34 + 112 + 4 reports x 5 = 166 s; 17 epochs: 34 + 119 + 5 x 5 = 178 s
    assert (chosen.max_epochs, chosen.val_interval, chosen.iterations, chosen.reports) == (16, 4, 224, 4)
    assert chosen.predicted_s == pytest.approx(166.0) and chosen.available_s == 200.0
    assert plan.predicted_seconds(calibration, 17, crops) == pytest.approx(178.0)
    assert plan.plan_epochs(calibration, 200.0, crops, cap=10).max_epochs == 10
    assert plan.plan_epochs(calibration, 45.0, crops) is None  # 34 + 7 + 5 = 46 s for one epoch
    # the bundles' "auto" crops grow with the interval, and so does a report's cost: fewer epochs fit
    auto = lambda interval: min(256, max(8, int(0.15 * 14 * 4 * interval)))  # noqa: E731
    fewer = plan.plan_epochs(calibration, 200.0, auto)
    assert fewer.max_epochs < 16 and fewer.health_crops == auto(fewer.val_interval)
    assert fewer.predicted_s <= 167.0 < plan.predicted_seconds(calibration, fewer.max_epochs + 1, auto)


def test_gpu_health_schedule_compressed_into_the_run():
    plan = _plan_module()
    configs = {name: json.loads((REPO / "bundles" / f"swin_unetr_{name}_pretrain" / "configs" / "train.json").read_text())
               for name in ("ssl", "dino", "mim")}  # fmt: skip
    # 20 epochs of 17 iterations: a 500-iteration warm-up is cut to a tenth of the run; epochs keep their share of 100
    assert plan.schedule_overrides(configs["ssl"], 20, 17) == {"training#warmup_iterations": 34}
    assert plan.schedule_overrides(configs["dino"], 20, 17) == {
        "training#warmup_epochs": 2, "training#teacher_temperature_warmup_epochs": 6, "training#freeze_last_layer_epochs": 1}
    assert plan.schedule_overrides(configs["mim"], 20, 17) == {
        "training#warmup_iterations": 34, "masking#teacher_temperature_warmup_epochs": 6}
    assert plan.schedule_overrides(configs["ssl"], 1000, 17) == {"training#warmup_iterations": 500}  # shipped, when short
    assert plan.schedule_overrides(configs["dino"], 2, 17)["training#teacher_temperature_warmup_epochs"] == 1
    with pytest.raises(ValueError, match="training#warmup_epochs = '\\$10'"):
        plan.schedule_overrides({"max_epochs": 100, "training": {"warmup_epochs": "$10"}}, 20, 17)


def test_gpu_health_enlarge_keeps_the_field_of_view(tmp_path):
    import nibabel as nib
    import numpy as np

    sys.path.insert(0, str(BENCHMARKS))
    import gpu_health

    affine = np.array([[0.0, -0.8, 0.0, 10.0], [-0.8, 0.0, 0.0, -20.0], [0.0, 0.0, 5.0, 30.0], [0, 0, 0, 1]])
    array = np.full((10, 6, 4), 40, dtype=np.int16)
    nib.save(nib.Nifti1Image(array, affine), str(tmp_path / "small.nii.gz"))
    shape = gpu_health.enlarge(tmp_path / "small.nii.gz", tmp_path / "large.nii", 8)
    large = nib.load(str(tmp_path / "large.nii"))
    assert shape == list(large.shape) == [10, 8, 8] and large.get_data_dtype() == np.int16
    assert np.all(np.asarray(large.dataobj) == 40)
    assert np.allclose(large.header.get_zooms(), [0.8, 0.6, 2.5])
    # the outer faces of the first and the last voxels lie where they did
    for old, new in (([-0.5] * 3, [-0.5] * 3), ([9.5, 5.5, 3.5], [9.5, 7.5, 7.5])):
        assert np.allclose(large.affine @ [*new, 1], affine @ [*old, 1])


def test_gpu_health_records_why_a_recipe_has_no_verdict(tmp_path):
    """A share under the least a recipe starts with skips it, with its reason and no verdict, and the JSON is written
    all the same."""
    skipped = _run("gpu_health.py", "--small", "--budget_s", "15", "--out_dir", str(tmp_path), timeout=300)
    assert skipped["complete"] is False and list(skipped["recipes"]) == ["ssl", "dino", "mim"]
    assert json.loads((tmp_path / "gpu_health_cpu_small.json").read_text()) == skipped
    for entry in skipped["recipes"].values():
        assert entry["status"] == "skipped" and entry["verdict"] is None
        assert re.fullmatch(r"needs at least 20 s; its share of the \d+ s left is \d+ s", entry["reason"])


def test_gpu_health_a_run_that_cannot_fit_fails_with_its_prediction(tmp_path):
    """A recipe whose calibration leaves no time for one epoch (here: its deadline is when it starts) raises before the
    run, and its part records the prediction that did not fit in one line; the exit code says it failed."""
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_health import SETTINGS, write_corpus

    write_corpus(tmp_path / "corpus", SETTINGS["small"]["subjects"], SETTINGS["small"]["min_size"])
    partial = tmp_path / "ssl.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_health.py"), "--small", "--_recipe", "ssl", "--_partial", str(partial),
         "--_deadline", str(time.time()), "--_work", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode != 0
    record = json.loads(partial.read_text())
    [error] = record["errors"]
    assert re.fullmatch(r"RuntimeError: does not fit: one epoch is predicted at \d+ s \(\d+ s of start-up, "
                        r"[0-9.]+ s per iteration x 2\) and -\d+ s of the share are left", error), error  # fmt: skip
    assert record["calibration"]["epochs"] == 2 and "plan" not in record and not (tmp_path / "ssl_main").exists()


def _ends_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone or a zombie within ``seconds`` (SIGKILL is delivered, not waited for)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if "\nState:\tZ" in Path(f"/proc/{pid}/status").read_text():
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_part_still_running_at_the_end_of_its_share_is_killed_with_its_children(tmp_path):
    """run_in_share kills the part's whole process group at the end of its share (a loader worker must not outlive
    it) and says so; what the part had recorded is kept."""
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_timing import run_in_share

    partial, pids = tmp_path / "part.json", tmp_path / "pids"
    part = (f"import json, os, subprocess, sys, time; json.dump({{'figure': 1}}, open({str(partial)!r}, 'w')); "
            f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}'); time.sleep(300)")  # fmt: skip
    entry = run_in_share([sys.executable, "-c", part], partial, 3.0, tmp_path / "log", "part", tmp_path)
    assert entry["status"] == "timed_out" and entry["reason"] == "still running at the end of its share (3 s); killed"
    assert entry["share_s"] == 3.0 and 3.0 <= entry["wall_s"] < 10 and entry["figure"] == 1
    for pid in map(int, pids.read_text().split()):  # gone, or a zombie its new parent has not reaped yet
        assert _ends_within(pid, 10.0), f"process {pid} of the part outlived its share"
    assert "===== part: share 3 s =====" in (tmp_path / "log").read_text()
