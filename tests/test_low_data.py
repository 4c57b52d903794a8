"""The low-data protocol (benchmarks/low_data.py): fixed pools and held-out sets, arms that differ only in their
starting weights, results keyed by their settings, the statistics, a user's datalists, and a killed-and-resumed run.

The fast tests replace the bundle runs below the protocol by stand-ins that record what they were asked to run; the
slow one runs the real ``--small`` plan twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import monai
import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
import low_data_arms  # noqa: E402
import low_data_docs as docs  # noqa: E402
import low_data_lever  # noqa: E402
import low_data_plan as plan_module  # noqa: E402
import low_data_protocol as protocol  # noqa: E402
import low_data_runs as runner  # noqa: E402
import low_data_schedule as schedule  # noqa: E402

import components  # noqa: E402
from components import sha256_file, write_dataset  # noqa: E402
from components.release.origin import PACKAGE_DIR, source_digest  # noqa: E402


def _fake_data(root: Path, plan: protocol.Plan, seed: int) -> protocol.Data:
    """The synthetic splits' shape without writing volumes: pool, validation, in-domain and shifted items."""
    labeled = [{"image": f"labeled/imagesTr/case_{i:03d}.nii.gz", "label": f"labeled/labelsTr/case_{i:03d}.nii.gz"}
               for i in range(plan.pool_size + 1 + plan.num_in_domain)]  # fmt: skip
    shifted = [{"image": f"shifted/imagesTr/case_{i:03d}.nii.gz", "label": f"shifted/labelsTr/case_{i:03d}.nii.gz"}
               for i in range(plan.num_shifted)]  # fmt: skip
    unlabeled = root / "unlabeled" / "dataset.json"
    unlabeled.parent.mkdir(parents=True, exist_ok=True)
    unlabeled.write_text(json.dumps({"training": [{"image": "a.nii.gz"}], "validation": [{"image": "b.nii.gz"}]}))
    return protocol.Data(root, labeled[: plan.pool_size], labeled[plan.pool_size : plan.pool_size + 1],
                         labeled[plan.pool_size + 1 :], shifted, ["background", "spleen"], unlabeled)  # fmt: skip


@pytest.fixture
def fake_protocol(monkeypatch):
    """run() with every bundle run replaced: pretraining returns a record, finetuning a Dice drawn from (arm, k,
    seed); the calls (arm, k, seed, overrides, datalist content) are recorded."""
    calls: list[dict] = []
    monkeypatch.setattr(runner, "synthetic_data", _fake_data)
    monkeypatch.setattr(runner, "training_class_weights", lambda datalist, names=None: [0.1, 1.0])
    monkeypatch.setattr(runner, "encoder_rankme", lambda data, weights, plan, seed, device: {"crops": 0, "encoders": {}})
    monkeypatch.setattr(runner, "plots", lambda *args: None)
    monkeypatch.setattr(runner, "coverage", lambda populations: {"populations": len(populations)})  # tested on its own

    def pretrain(recipe, key, overrides, results, threads, report_only=False):
        return {"recipe": recipe, "key": key, "sha256": f"weights-of-{recipe}", "commit": "c", "model": f"/w/{recipe}.pt"}

    def finetune(arm, k, seed, key, overrides, data, results, threads, report_only=False):
        if report_only:  # the stand-in keeps no results: nothing to report
            return None
        datalist = json.loads(Path(overrides["datalist"]).read_text())
        calls.append({"arm": arm, "k": k, "seed": seed, "key": key, "overrides": overrides, "datalist": datalist})
        rng = np.random.default_rng([k, seed, list(low_data_arms.ARMS).index(arm)])
        score = {h: {"mean": float(rng.uniform(0.2, 0.8)), "per_image": {}} for h in protocol.HELD_OUT_SETS}
        return {"arm": arm, "k": k, "seed": seed, "key": key, "commit": "c", "dice": {"selected": score, "last": score},
                "validation_curve": [(k, 0.1), (2 * k, 0.2)], "selected_iteration": 2 * k, "training_files": [i["image"] for i in datalist["training"]],
                "held_out_files": datalist["heldout"]}  # fmt: skip

    monkeypatch.setattr(runner, "run_pretraining", pretrain)
    monkeypatch.setattr(runner, "run_finetuning", finetune)
    return calls


PLAN = replace(protocol.PLANS["cpu"], ks=(1, 2, 4, 8), min_seeds=2, max_seeds=2, finetune_iterations=8, val_every=8)


def _files(calls: list[dict], k: int) -> dict:
    return {(c["seed"], c["arm"]): (c["datalist"]["training"], c["datalist"]["heldout"], c["datalist"]["validation"])
            for c in calls if c["k"] == k}  # fmt: skip


def test_held_out_sets_and_pools_do_not_depend_on_ks_or_seeds(fake_protocol, tmp_path):
    calls = fake_protocol
    runner.run(replace(PLAN, ks=(1,)), tmp_path / "a", "cpu")
    only_k1 = _files(calls, 1)
    calls.clear()
    runner.run(PLAN, tmp_path / "b", "cpu")
    assert _files(calls, 1) == only_k1  # --ks 1 and --ks 1,2,4,8 train and score on identical files
    calls.clear()
    runner.run(replace(PLAN, ks=(1,), min_seeds=1, max_seeds=1), tmp_path / "c", "cpu")
    assert _files(calls, 1) == {key: files for key, files in only_k1.items() if key[0] == 0}  # --seeds 1: seed 0 alike
    held_out = {json.dumps(files[1]) for files in only_k1.values()}
    assert len(held_out) == 1 and len(json.loads(held_out.pop())) == PLAN.num_in_domain + PLAN.num_shifted


def test_pools_are_nested_and_never_overlap_validation_or_held_out(fake_protocol, tmp_path):
    runner.run(PLAN, tmp_path, "cpu")
    for seed in (0, 1):
        pools = [{i["image"] for i in _files(fake_protocol, k)[(seed, "scratch")][0]} for k in (1, 2, 4, 8)]
        assert [len(p) for p in pools] == [1, 2, 4, 8]
        assert pools[0] < pools[1] < pools[2] < pools[3]
        _, held_out, validation = _files(fake_protocol, 8)[(seed, "scratch")]
        assert not pools[3] & {i["image"] for i in held_out + validation}
    first = {seed: _files(fake_protocol, 1)[(seed, "scratch")][0] for seed in (0, 1)}
    assert first[0] != first[1]  # the seeds draw other volumes


def test_arms_of_a_pair_differ_only_in_the_starting_weights(fake_protocol, tmp_path):
    """Within a family (finetuned, linear probe, frozen swinViT) the arms of a (k, seed) pair differ only in the
    encoder they start from; the probe runs the CT bundle with the LinearProbe network, the frozen-swinViT arms freeze
    the encoder for the whole run."""
    runner.run(replace(PLAN, arms=tuple(low_data_arms.ARMS)), tmp_path, "cpu")
    own = {"output_dir", "ckpt_dir"}  # each run's own folders
    commands = {c["arm"]: {k: v for k, v in c["overrides"].items() if k not in own} for c in fake_protocol if (c["k"], c["seed"]) == (2, 1)}
    assert set(commands) == set(low_data_arms.ARMS) and len(commands) == 12

    def differing(a: str, b: str) -> set[str]:
        return {k for k in commands[a].keys() | commands[b].keys() if commands[a].get(k) != commands[b].get(k)}

    for recipe in ("ssl", "dino", "mim"):
        assert differing(recipe, "scratch") == {"pretrained_path"}
        assert differing(f"probe_{recipe}", "probe_random") == {"pretrained_path"}
        assert differing(f"frozen_swinvit_{recipe}", "frozen_swinvit_random") == {"pretrained_path"}
        assert commands[f"probe_{recipe}"]["pretrained_path"] == commands[recipe]["pretrained_path"] == f"/w/{recipe}.pt"
    assert differing("probe_random", "scratch") == {"network_def#network"}
    assert commands["probe_mim"]["network_def#network"] == "$components.LinearProbe"
    assert differing("frozen_swinvit_random", "scratch") == {"training#freeze_encoder_iterations"}
    assert commands["frozen_swinvit_ssl"]["training#freeze_encoder_iterations"] == PLAN.finetune_iterations
    assert commands["scratch"]["pretrained_path"] is None and commands["probe_random"]["pretrained_path"] is None


def test_the_cpu_plans_time_estimate_is_the_records_it_names():
    """Protocol v3's estimate (its docstring and docs/measuring.md) from the pilot's records at 480 iterations: the
    finetuned (scratch) runs' range and medians, the probe runs' range and median; 90 finetuned and 90 probe runs (3
    blocks of baselines and 12 pretrainings, 3 seeds x 2 k each) and 12 pretrainings (SSL's and ssl_matched's at
    1,250 s, twice the demo's 624 s on two threads; masked image and self-distillation at the pretraining curve's
    medians, 456 s and 509 s), two side by side; twice the finetuning at 960 iterations."""
    pilot = [json.loads(p.read_text()) for p in (REPO / "benchmarks/results/low_data_cpu_protocol3_pilot").glob("*.json")]
    finetuned = [r["seconds"] for r in pilot if r["arm"] == "scratch"]
    probe = [r["seconds"] for r in pilot if r["arm"] == "probe_random"]
    per_k = [float(np.median([r["seconds"] for r in pilot if r["arm"] == "scratch" and r["k"] == k])) for k in (1, 2)]
    assert len(finetuned) == len(probe) == 6 and [round(v) for v in per_k] == [1097, 1301]
    assert (round(min(finetuned)), round(max(finetuned)), round(min(probe)), round(max(probe))) == (986, 1511, 238, 432)

    def median(name: str) -> float:
        return float(np.median([json.loads((REPO / f"benchmarks/results/pretrain_curve/{name}_1003_seed{s}.json").read_text())["seconds"]
                                for s in range(3)]))  # fmt: skip

    assert (round(median("mim")), round(median("dino+training.teacher_temperature=0.04"))) == (456, 509)
    plan = plan_module.PLANS["cpu"]
    runs = (plan.pretrainings + len(plan.recipes) * plan.pretrainings) * plan.finetune_seeds * len(plan.ks)  # per arm kind
    assert runs == 90
    finetuning = runs * float(np.median(finetuned)) + runs * float(np.median(probe))
    pretraining = plan.pretrainings * (2 * 1250 + 456 + 509)
    assert (round(runs * float(np.median(finetuned)), -2), round(runs * float(np.median(probe)), -2)) == (107900, 25200)
    assert round((finetuning + pretraining) / 2, -2) == 71800 and round((2 * finetuning + pretraining) / 2, -2) == 138300
    for doc in ("benchmarks/low_data.py", "docs/measuring.md"):
        text = " ".join((REPO / doc).read_text().split())
        assert "71,800 s (20 h)" in text and "138,300 s (38 h)" in text and "986-1,511 s" in text and "1,301 s" in text, doc


def test_the_default_plans_arms_and_contrasts(fake_protocol, tmp_path):
    """The four finetuned and four probe arms, with the contrasts against scratch and against a probe of a random
    encoder; the frozen-swinViT arms only when a plan names them."""
    for name in ("cpu", "cuda", "small"):
        assert protocol.PLANS[name].arms == ("scratch", "ssl", "dino", "mim", "probe_random", "probe_ssl", "probe_dino", "probe_mim")
    result = runner.run(replace(PLAN, ks=(1,), min_seeds=1, max_seeds=1), tmp_path, "cpu")
    assert {c["arm"] for c in fake_protocol} == set(protocol.PLANS["cpu"].arms) and set(result["pretraining"]) == {"ssl", "dino", "mim"}
    assert list(result["paired"]["in_domain"]["selected"]) == [
        "ssl - scratch", "dino - scratch", "mim - scratch", "probe_ssl - probe_random", "probe_dino - probe_random",
        "probe_mim - probe_random"]
    frozen = replace(PLAN, ks=(1,), min_seeds=1, max_seeds=1, arms=("frozen_swinvit_random", "frozen_swinvit_mim"))
    result = runner.run(frozen, tmp_path / "frozen", "cpu")
    assert list(result["paired"]["in_domain"]["selected"]) == ["frozen_swinvit_mim - frozen_swinvit_random"]
    assert set(result["pretraining"]) == {"mim"}


def test_the_masked_image_pretraining_runs_like_the_ssl_one(tmp_path):
    """Its overrides are the SSL pretraining's (the plan's budget: data, batch, epochs, rate, warm-up, feature size,
    window) but for the crop (SSL's is 32x64x64 since f016327, masked image's 64x32x32), every one an id of the masked
    image bundle, whose mask blocks tile the crop."""
    plan = protocol.PLANS["cpu"]
    data = _fake_data(tmp_path / "data", plan, 0)
    numerics, code = runner.run_numerics("cpu"), protocol.code_state()
    jobs = {r: runner.pretraining_job(r, plan, data, tmp_path, numerics, code, 0) for r in ("ssl", "mim")}
    own = {"output_dir", "ckpt_dir", "train#loss#alpha", "roi_size"}  # SSL's loss weights and crop are SSL's own
    assert jobs["ssl"][1]["train#loss#alpha"] == [3.0, 1.0, 1.0] and "train#loss#alpha" not in jobs["mim"][1]
    assert (jobs["ssl"][1]["roi_size"], jobs["mim"][1]["roi_size"]) == ([32, 64, 64], [64, 32, 32])
    assert {k: v for k, v in jobs["mim"][1].items() if k not in own} == {k: v for k, v in jobs["ssl"][1].items() if k not in own}
    assert jobs["mim"][0] != jobs["ssl"][0] and Path(jobs["mim"][1]["ckpt_dir"]).parent.name == f"mim_{jobs['mim'][0]}"
    from monai.bundle import ConfigParser

    from components.config.running import run_config_files

    config = ConfigParser.load_config_files([str(f) for f in run_config_files(REPO / "bundles/swin_unetr_mim_pretrain", ["train.json"])])

    def has(path: str) -> bool:
        node = config
        for part in path.split("#"):
            if not isinstance(node, dict) or part not in node:
                return False
            node = node[part]
        return True

    interface = {"training#rankme_crops"}  # the id that lands with components.LinearProbe (another worker's change)
    assert [k for k in jobs["mim"][1] if k not in interface and not has(k)] == []
    roi, block = jobs["mim"][1]["roi_size"], config["masking"]["block_size"]
    assert all(edge % block == 0 for edge in roi)


def test_a_datalist_being_written_is_never_read_half_written(tmp_path):
    """The arms of a (k, seed) pair write and read its datalist side by side; a reader that saw a half-written list
    once gave a run of the lever another key than its settings' (and so a needless re-run). A reader polling while
    the list is written again and again sees the whole list or none."""
    data = _fake_data(tmp_path, protocol.PLANS["cpu"], 0)
    path = protocol.write_datalist(data, 1, 0, 0)
    whole, seen, done = path.read_text(), [], threading.Event()

    def read_while_written() -> None:
        while not done.is_set():
            with contextlib.suppress(FileNotFoundError):
                seen.append(path.read_text())

    reader = threading.Thread(target=read_while_written)
    reader.start()
    for _ in range(200):
        path.unlink()
        protocol.write_datalist(data, 1, 0, 0)
    done.set()
    reader.join()
    assert seen and all(text == whole for text in seen), f"{sum(text != whole for text in seen)} of {len(seen)} reads were partial"


def test_a_result_is_keyed_by_every_setting_of_its_run_and_its_numerics(fake_protocol, tmp_path, monkeypatch):
    summary = runner.run(PLAN, tmp_path, "cpu")
    keys = {(c["arm"], c["k"], c["seed"]): c["key"] for c in fake_protocol}
    assert len(set(keys.values())) == len(keys)
    fake_protocol.clear()
    runner.run(replace(PLAN, finetune_iterations=16), tmp_path, "cpu")
    assert not {c["key"] for c in fake_protocol} & set(keys.values())  # another budget: no key in common
    fake_protocol.clear()
    runner.run(PLAN, tmp_path / "elsewhere", "cpu")
    assert {(c["arm"], c["k"], c["seed"]): c["key"] for c in fake_protocol} == keys  # the same settings in another folder
    numerics = runner.run_numerics("cpu")
    assert summary["settings"]["numerics"] == numerics and numerics["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    fake_protocol.clear()
    monkeypatch.setattr(runner, "run_numerics", lambda device: {**numerics, "cpu_capability": "AVX2" if numerics["cpu_capability"] != "AVX2" else "AVX512"})
    other = runner.run(PLAN, tmp_path, "cpu")  # the same settings on a CPU of other vector instructions
    assert not {c["key"] for c in fake_protocol} & set(keys.values()) and other["settings_hash"] != summary["settings_hash"]


def test_the_key_leaves_out_the_demo_driver_alone_which_no_protocol_process_imports(tmp_path):
    """Tuning the demo (its budgets and steps, components/demo/run.py) keeps every key; a change of the demo-sized
    runs it shares with the protocol (components/demo/recipes.py) does not. The one file left out is one that neither
    the benchmark's process (its run, protocol and RankMe modules) nor any bundle config imports."""
    copy = tmp_path / "components"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    code = protocol.code_state(copy)
    for rel, kept in (("demo/run.py", True), ("demo/recipes.py", False), ("demo/plots.py", False)):
        path = copy / rel
        original = path.read_text()
        path.write_text(original + "\n# tuned\n")
        assert (protocol.code_state(copy) == code) is kept, rel
        path.write_text(original)
    probe = ("import sys; sys.path[:0] = ['benchmarks', '.']; import low_data, low_data_runs, low_data_protocol, low_data_rankme, "
             "low_data_lever, low_data_plan, low_data_schedule, low_data_verdicts, low_data_docs; "
             "print(sorted(m for m in sys.modules if m.startswith('components.demo')))")
    imported = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert "'components.demo.recipes'" in imported and "'components.demo.run'" not in imported, imported
    configs = [p for p in (REPO / "bundles").glob("*/configs/*.json") if "components.demo" in p.read_text()]
    assert not configs, configs
    with pytest.raises(ValueError, match="demo/driver.py"):
        source_digest(copy, exclude=("demo/driver.py",))


def test_a_result_is_keyed_by_the_monai_version_and_the_code_that_ran(fake_protocol, tmp_path, monkeypatch):
    """A changed loss (any byte of the components package) or bundle config, or another MONAI, gives every run a new
    key: no old record is reused; the summary's settings hold the code's digests and say what a key covers."""
    summary = runner.run(PLAN, tmp_path, "cpu")
    keys = {(c["arm"], c["k"], c["seed"]): c["key"] for c in fake_protocol}
    code = protocol.code_state()
    assert summary["settings"]["code"] == code and summary["settings"]["numerics"]["monai"] == monai.__version__
    assert code["components"] == source_digest(PACKAGE_DIR, exclude=("demo/run.py",)) and set(code["configs"]) == {
        f"{b}/{name}" for b in ("swin_unetr_btcv_finetune", "swin_unetr_ssl_pretrain", "swin_unetr_dino_pretrain",
                                "swin_unetr_mim_pretrain") for name in ("common.json", "train.json")} | {
        "swin_unetr_btcv_finetune/evaluate.json"}
    assert "MONAI version" in summary["settings"]["result_keys"] and "components" in summary["settings"]["result_keys"]

    copy = tmp_path / "components"
    shutil.copytree(PACKAGE_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert protocol.code_state(copy) == code  # the same source elsewhere: the same digest
    loss = copy / "recipes" / "inpainting_contrast" / "loss.py"
    loss.write_text(loss.read_text() + "\n# a changed loss\n")
    changed = protocol.code_state(copy)
    assert changed["components"] != code["components"] and changed["configs"] == code["configs"]
    for name, state in (("a changed loss", changed),
                        ("a changed config", {**code, "configs": {**code["configs"], "swin_unetr_btcv_finetune/train.json": "0" * 64}})):
        fake_protocol.clear()
        monkeypatch.setattr(runner, "code_state", lambda state=state: state)
        other = runner.run(PLAN, tmp_path, "cpu")
        assert not {c["key"] for c in fake_protocol} & set(keys.values()), name
        assert other["settings"]["code"] == state and other["settings_hash"] != summary["settings_hash"]
    monkeypatch.setattr(runner, "code_state", protocol.code_state)
    numerics = runner.run_numerics("cpu")
    monkeypatch.setattr(runner, "run_numerics", lambda device: {**numerics, "monai": "1.5.0"})
    fake_protocol.clear()
    runner.run(PLAN, tmp_path, "cpu")
    assert not {c["key"] for c in fake_protocol} & set(keys.values())  # another MONAI


def _stand_in_bundle(calls: list):
    """A bundle run stand-in for run_finetuning: writes the evaluation's per-image CSV and records the call."""

    def run_bundle(bundle, configs=("train.json",), overrides=None, log=None, echo=True, threads=None):
        calls.append((configs, overrides))
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("")
        if "eval_list" in overrides:
            out = Path(overrides["output_dir"])
            out.mkdir(parents=True, exist_ok=True)
            datalist = Path(overrides["datalist"])
            rows = [f"{(datalist.parent / i['image']).resolve()},0.5,nan,0.5" for i in json.loads(datalist.read_text())["heldout"]]
            (out / "val_mean_dice_raw.csv").write_text("filename,class0,class1,mean\n" + "\n".join(rows) + "\n")
        return 1.0

    return run_bundle


def test_a_finished_run_is_reused_and_a_result_of_other_settings_is_never_read(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(runner, "run_bundle", _stand_in_bundle(calls))
    monkeypatch.setattr(runner, "read_scalars", lambda folder: {"val_mean_dice": [(1, 0.3), (2, 0.4), (3, 0.35)]})
    plan = replace(PLAN, ks=(1,))
    data = _fake_data(tmp_path / "data", plan, 0)
    datalist = protocol.write_datalist(data, 1, 0, 0)
    results = tmp_path / "results"
    overrides = {"datalist": str(datalist), "output_dir": str(tmp_path / "run" / "eval"), "ckpt_dir": str(tmp_path / "run" / "models")}
    record = runner.run_finetuning("scratch", 1, 0, "keyA", overrides, data, results, None)
    assert len(calls) == 3  # training, then the selected (iteration 2) and the last model on the held-out sets
    assert record["selected_iteration"] == 2 and record["dice"]["selected"]["in_domain"]["mean"] == 0.5
    assert record["held_out_files"]["shifted"] == [i["image"] for i in data.shifted]
    assert json.loads((results / "scratch_k1_seed0_keyA.json").read_text()) == record
    assert runner.run_finetuning("scratch", 1, 0, "keyA", overrides, data, results, None) == record and len(calls) == 3
    stale = tmp_path / "run" / "eval" / "events.out.tfevents.stale"
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_text("an older run's events")
    runner.run_finetuning("scratch", 1, 0, "keyB", overrides, data, results, None)
    assert len(calls) == 6 and not stale.exists()  # other settings: run again, in an emptied folder


def test_a_pretraining_is_continued_from_the_results_folder_alone(tmp_path, monkeypatch):
    """A piece of the plan on a fresh machine has the results folder (committed) but not the run folders: the
    pretraining's weights kept beside its record are reused, not retrained; weights that do not match the record
    are never used."""
    bundles: list = []

    def pretraining_bundle(bundle, configs=("train.json",), overrides=None, log=None, echo=True, threads=None):
        bundles.append(bundle)
        (Path(overrides["ckpt_dir"])).mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.full((2,), float(len(bundles)))}, Path(overrides["ckpt_dir"]) / "model.pt")
        return 1.0

    monkeypatch.setattr(runner, "run_bundle", pretraining_bundle)
    monkeypatch.setattr(runner, "read_scalars", lambda folder: {"loss": [(1, 2.0)]})
    results, run_dir = tmp_path / "results", tmp_path / "machine1" / "pretrain" / "ssl_k"
    overrides = {"output_dir": str(run_dir / "eval"), "ckpt_dir": str(run_dir / "models")}
    first = runner.run_pretraining("ssl", "k", overrides, results, None)
    kept = results / "pretrain_ssl_k.pt"
    assert kept.read_bytes() == (run_dir / "models" / "model.pt").read_bytes() and first["model"] == str(run_dir / "models" / "model.pt")
    fresh = tmp_path / "machine2" / "pretrain" / "ssl_k"  # another machine: no run folder
    again = runner.run_pretraining("ssl", "k", {"output_dir": str(fresh / "eval"), "ckpt_dir": str(fresh / "models")}, results, None)
    assert bundles == [runner.PRETRAINING["ssl"][0]] and again == {**first, "model": str(kept)}
    kept.write_bytes(b"other weights")
    third = runner.run_pretraining("ssl", "k", {"output_dir": str(fresh / "eval"), "ckpt_dir": str(fresh / "models")}, results, None)
    assert len(bundles) == 2 and third["sha256"] != first["sha256"] and third["model"] == str(fresh / "models" / "model.pt")
    assert sha256_file(kept) == third["sha256"]  # the record and the kept weights agree again


def test_seeds_are_added_at_the_narrow_ks_until_the_t_interval_is_narrow(fake_protocol, tmp_path):
    plan = replace(PLAN, ks=(1, 2, 4), min_seeds=2, max_seeds=7, target_half_width=0.0001)
    result = runner.run(plan, tmp_path, "cpu")
    assert result["seeds_run"] == {"1": 7, "2": 7, "4": 2} and result["half_width_target_met"] is False
    assert max(c["seed"] for c in fake_protocol if c["k"] == 4) == 1
    fake_protocol.clear()
    result = runner.run(replace(plan, target_half_width=1.0), tmp_path / "wide", "cpu")
    assert result["seeds_run"] == {"1": 5, "2": 5, "4": 2} and result["half_width_target_met"] is True  # t from 5 pairs on
    entry = result["paired"]["in_domain"]["selected"]["ssl - scratch"]["1"]
    assert entry["n"] == 5 and entry["interval_kind"] == "t95" and entry["mean"] == pytest.approx(np.mean(entry["differences"]))
    assert result["paired"]["in_domain"]["selected"]["ssl - scratch"]["4"]["interval_kind"] == "range"


def test_a_time_limited_piece_starts_no_run_after_its_limit_and_the_next_piece_continues(fake_protocol, tmp_path):
    first = runner.run(replace(PLAN, ks=(1, 2)), tmp_path, "cpu", stop_after_s=0.0)
    assert first["complete"] is False and first["runs"] == [] and len(first["missing_runs"]) == 2 * 2 * len(PLAN.arms)
    report = runner.run(replace(PLAN, ks=(1, 2)), tmp_path, "cpu", report_only=True)
    assert report["missing_runs"] == first["missing_runs"] and not fake_protocol
    whole = runner.run(replace(PLAN, ks=(1, 2)), tmp_path, "cpu")
    assert whole["complete"] is True and whole["missing_runs"] == [] and len(whole["runs"]) == 2 * 2 * len(PLAN.arms)


def test_bad_plans_fail_before_any_run(fake_protocol, tmp_path):
    with pytest.raises(ValueError, match="outside 1..8"):
        runner.run(replace(PLAN, ks=(16,)), tmp_path, "cpu")
    with pytest.raises(ValueError, match="multiple of every k"):
        runner.run(replace(PLAN, ks=(3,)), tmp_path, "cpu")
    with pytest.raises(ValueError, match="go together"):
        runner.run(PLAN, tmp_path, "cpu", labeled=tmp_path / "x.json")
    assert not fake_protocol


def _user_lists(root: Path) -> tuple[Path, Path, Path]:
    """Lists as a user writes them: an MSD-style labeled dataset.json (training with labels, test as plain path
    strings), an unlabeled corpus with images only, and another site's labeled list."""
    write_dataset(root / "site_a", num=8, seed=3, organs=("spleen", "liver"))
    write_dataset(root / "corpus", num=3, seed=4, varied=True, labels=False)
    write_dataset(root / "site_b", num=3, seed=5, organs=("spleen", "liver"), varied=True)
    labeled = json.loads((root / "site_a" / "dataset.json").read_text())
    msd = {"name": "mine", "labels": labeled["labels"], "training": labeled["training"] + labeled["validation"],
           "test": [f"./{i['image']}" for i in labeled["test"]]}  # fmt: skip
    (root / "site_a" / "msd.json").write_text(json.dumps(msd))
    corpus = json.loads((root / "corpus" / "dataset.json").read_text())
    (root / "corpus" / "list.json").write_text(json.dumps({"training": corpus["training"] + corpus["validation"], "test": corpus["test"]}))
    return root / "site_a" / "msd.json", root / "corpus" / "list.json", root / "site_b" / "dataset.json"


def test_a_users_datalists_are_split_by_the_data_seed_alone(tmp_path):
    labeled, unlabeled, shifted = _user_lists(tmp_path)
    plan = replace(protocol.PLANS["small"], ks=(1, 2), num_in_domain=2, pool_size=8, finetune_iterations=2)
    data = protocol.user_data(tmp_path / "out", plan, 0, labeled, unlabeled, shifted)
    # 7 labeled entries (training + validation; the test list holds plain paths without labels)
    assert len(data.in_domain) == 2 and len(data.validation) == 1 and len(data.pool) == 4
    assert all(Path(i["label"]).is_file() for i in data.pool + data.in_domain + data.validation)
    assert not {i["image"] for i in data.pool} & {i["image"] for i in data.in_domain + data.validation}
    assert len(data.shifted) == 3 and data.label_names == ["background", "spleen", "liver"]
    corpus = json.loads(data.unlabeled.read_text())
    assert len(corpus["training"]) + len(corpus["validation"]) == 3 and corpus["validation"]
    again = protocol.user_data(tmp_path / "again", plan, 0, labeled, unlabeled, shifted)
    assert (again.pool, again.in_domain, again.validation) == (data.pool, data.in_domain, data.validation)
    datalist = json.loads(protocol.write_datalist(data, 2, 0, 0).read_text())
    assert datalist["labels"] == {"0": "background", "1": "spleen", "2": "liver"} and len(datalist["heldout"]) == 5


def test_a_users_lists_that_cannot_serve_the_plan_are_named(tmp_path):
    labeled, unlabeled, _ = _user_lists(tmp_path)
    with pytest.raises(protocol.DatalistError, match="needs at least 11"):
        protocol.user_data(tmp_path / "o", replace(protocol.PLANS["cpu"], ks=(1, 2, 4, 6)), 0, labeled, unlabeled, None)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"labels": {"0": "background"}, "training": [{"image": "nope.nii.gz", "label": "nope.nii.gz"}]}))
    with pytest.raises(protocol.DatalistError, match="nope.nii.gz"):
        protocol.user_data(tmp_path / "o", protocol.PLANS["small"], 0, broken, unlabeled, None)


def _with_images(datalist: Path, images: list[str], out: Path) -> Path:
    """A copy of ``datalist`` (written to ``out``) whose training list also names ``images``."""
    content = json.loads(datalist.read_text())
    content["training"] = content["training"] + [{"image": str(image)} for image in images]
    out.write_text(json.dumps(content))
    return out


def test_held_out_and_validation_volumes_never_in_the_corpus_or_the_shifted_list(tmp_path):
    """By path or by content (a copy under another name): a validation or held-out volume that the pretraining also
    reads, or that the shifted list holds, is refused in one line naming both lists and the file; the pool may be in
    the corpus (pretraining on the labeled images' pixels is allowed)."""
    labeled, unlabeled, shifted = _user_lists(tmp_path)
    plan = replace(protocol.PLANS["small"], ks=(1, 2), num_in_domain=2, pool_size=8)
    data = protocol.user_data(tmp_path / "ok", plan, 0, labeled, unlabeled, shifted)
    pool_in_corpus = _with_images(unlabeled, [i["image"] for i in data.pool], tmp_path / "corpus" / "with_pool.json")
    protocol.user_data(tmp_path / "ok", plan, 0, labeled, pool_in_corpus, shifted)

    held = data.validation[0]["image"]
    corpus = _with_images(unlabeled, [held], tmp_path / "corpus" / "with_validation.json")
    with pytest.raises(protocol.DatalistError) as path_overlap:
        protocol.user_data(tmp_path / "o", plan, 0, labeled, corpus, shifted)
    message = str(path_overlap.value)
    assert "\n" not in message and held in message
    assert f"--labeled {str(labeled)!r} (validation)" in message and f"--unlabeled {str(corpus)!r}" in message

    copy = tmp_path / "corpus" / "renamed_copy.nii.gz"
    copy.write_bytes(Path(data.in_domain[1]["image"]).read_bytes())
    corpus = _with_images(unlabeled, [str(copy)], tmp_path / "corpus" / "with_copy.json")
    with pytest.raises(protocol.DatalistError, match=r"\(in-domain held-out\) and --unlabeled .*same content") as copied:
        protocol.user_data(tmp_path / "o", plan, 0, labeled, corpus, shifted)
    assert data.in_domain[1]["image"] in str(copied.value) and str(copy) in str(copied.value)

    site_b = json.loads(shifted.read_text())
    site_b["training"].append({"image": data.pool[0]["image"], "label": data.pool[0]["label"]})
    (tmp_path / "site_b" / "with_pool.json").write_text(json.dumps(site_b))
    with pytest.raises(protocol.DatalistError, match=r"\(training pool\) and --shifted .* share a volume"):
        protocol.user_data(tmp_path / "o", plan, 0, labeled, unlabeled, tmp_path / "site_b" / "with_pool.json")
    other_site = protocol._entries(shifted, require_label=True)[0]["image"]
    corpus = _with_images(unlabeled, [other_site], tmp_path / "corpus" / "with_shifted.json")
    with pytest.raises(protocol.DatalistError, match=r"--shifted .* and --unlabeled .* share a volume"):
        protocol.user_data(tmp_path / "o", plan, 0, labeled, corpus, shifted)


def _comparable(result: dict) -> dict:
    """The summary without what depends on the invocation: timings, the machine, the output folder and the checkout's
    state (a file edited while the test runs turns the commit into ``<sha>+changes``)."""
    drop = {"machine", "total_seconds", "commits"}
    per_run = {"seconds", "commit"}
    out = {k: v for k, v in result.items() if k not in drop}
    out["runs"] = [{k: v for k, v in r.items() if k not in per_run} for r in result["runs"]]
    out["recipes"] = {name: {**entry, "pretrainings": [{**{k: v for k, v in p.items() if k not in per_run},
                                                         "health": {k: v for k, v in p["health"].items() if k != "seconds"}}
                                                        for p in entry["pretrainings"]]}
                      for name, entry in result["recipes"].items()}  # fmt: skip
    return out


requires_probe = pytest.mark.skipif(not hasattr(components, "LinearProbe"), reason="components.LinearProbe and "
                                    "training#rankme_crops (another worker's change) are not in this checkout yet: the "
                                    "plan's probe arms and pretrainings need them")  # fmt: skip


@pytest.mark.slow
@requires_probe
def test_a_killed_and_resumed_small_run_gives_the_uninterrupted_json(tmp_path):
    """The real --small plan of protocol v3 (the four recipes' pretrainings with their health reports; scratch,
    probe_random and each recipe's finetuned and probe arms at one k and finetuning seed): uninterrupted, and killed
    once its first finetuning record is written, then run again into the same folder."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, str(REPO / "benchmarks" / "low_data.py"), "--small", "--device", "cpu", "--parallel", "1"]
    whole = subprocess.run([*command, "--out", str(tmp_path / "whole")], capture_output=True, text=True, env=env, timeout=2400)
    assert whole.returncode == 0, whole.stderr[-3000:]
    uninterrupted = json.loads(whole.stdout)

    small = plan_module.PLANS["small"]
    arms = ["scratch", "probe_random", *(a for r in small.recipes for a in (r, f"probe_{r}"))]
    out = tmp_path / "killed"
    proc = subprocess.Popen([*command, "--out", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 1800
    while not list((out / "results").glob("scratch_k1_f0_*.json")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = list((out / "results").glob("*_k1_f0_*.json"))
    assert 1 <= len(finished) < len(arms)  # killed part way: some runs done, some not
    resumed = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True, env=env, timeout=2400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = json.loads(resumed.stdout)
    assert _comparable(result) == _comparable(uninterrupted)

    assert result["complete"] and sorted(r["arm"] for r in result["runs"]) == sorted(arms)
    for recipe, entry in result["recipes"].items():
        assert [p["seed"] for p in entry["pretrainings"]] == [0], recipe
        assert entry["pretrainings"][0]["verdict"] in plan_module.HEALTH_VERDICTS  # the run's last health report was read
        assert entry["status"] == "evaluated" and entry["primary"]["n"] == 1 and entry["primary"]["interval"] is None
    drawn = result["data"]["per_seed"]["0"]
    for run in result["runs"]:
        loaded = run["encoder_tensors_loaded"]
        assert loaded is None if run["recipe"] is None else loaded[0] == loaded[1] > 0, run["arm"]
        assert run["held_out_files"] == {"in_domain": drawn["in_domain"], "shifted": drawn["shifted"]}
        assert run["training_files"] == drawn["training"]["1"] and len(run["validation_files"]) == small.num_validation
        for model in protocol.MODELS:
            assert all(0.0 <= run["dice"][model][h]["mean"] <= 1.0 for h in protocol.HELD_OUT_SETS)
    assert set(result["convergence"]) == {"scratch", "probe_random"} and result["protocol"] == 3
    assert result["settings"]["code"] == protocol.code_state() and result["settings"]["numerics"]["monai"] == monai.__version__


PROTOCOL_DOCS = ["README.md", "docs/measuring.md", "benchmarks/README.md", "bundles/swin_unetr_ssl_pretrain/docs/README.md",
                 "bundles/swin_unetr_dino_pretrain/docs/README.md", "bundles/swin_unetr_mim_pretrain/docs/README.md"]
# protocol v3's summaries (issue 44), on encoders that pass their health check: their plan and the folder of their
# records (none exists before the plan runs: the docs' blocks say "not run yet")
SUMMARY_PLANS: dict[str, tuple[plan_module.Plan, str]] = {
    "benchmarks/results/low_data_cpu_protocol3.json": (plan_module.PLANS["cpu"], "benchmarks/results/low_data_cpu_protocol3"),
}
OLD_PROTOCOL = {  # summaries of the earlier protocols: the folder of their records (None: no finetuning run)
    "benchmarks/results/low_data_cpu.json": "benchmarks/results/low_data_cpu",
    "benchmarks/results/low_data_cpu_9seeds.json": "benchmarks/results/low_data_cpu",
    "benchmarks/results/low_data_cpu_lever.json": "benchmarks/results/low_data_cpu",
    "benchmarks/results/low_data_cpu_65711b4.json": "benchmarks/results/low_data_cpu_65711b4",
    "benchmarks/results/low_data_cpu_8a1a45b.json": "benchmarks/results/low_data_cpu_8a1a45b",
    "benchmarks/results/low_data_cuda/pieces/1.json": None,
    "benchmarks/results/low_data_cuda/pieces/2.json": None,
    # protocol 2: its encoders had not learned their pretext tasks (benchmarks/results/pretrain_curve.json)
    "benchmarks/results/low_data_cpu_protocol2.json": "benchmarks/results/low_data_cpu_protocol2",
    "benchmarks/results/low_data_cpu_protocol2_lever.json": "benchmarks/results/low_data_cpu_protocol2",
    "benchmarks/results/low_data_cuda_protocol2.json": "benchmarks/results/low_data_cuda_protocol2",
}
BLOCK = re.compile(r"<!-- low_data (tables|coverage|findings|answers|protocol3): python benchmarks/low_data.py --markdown (\S+) --write_docs \.\.\. -->")


def _blocks(doc: str) -> list[tuple[str, str]]:
    return BLOCK.findall((REPO / doc).read_text())


@pytest.mark.parametrize("doc", PROTOCOL_DOCS)
def test_every_generated_block_is_what_its_summary_gives(doc, tmp_path):
    """No document shows the tables or findings of a superseded summary as current (only the old protocol's coverage
    table, in benchmarks/README.md); every generated block is what its summary gives today."""
    copy = tmp_path / "doc.md"
    copy.write_text((REPO / doc).read_text())
    for kind, summary in _blocks(doc):
        assert summary in SUMMARY_PLANS or (kind == "coverage" and summary in OLD_PROTOCOL), (kind, summary)
        assert not docs.write_doc_tables(copy, REPO / summary), f"{doc}: python benchmarks/low_data.py --markdown {summary} --write_docs {doc}"


@pytest.mark.parametrize("summary", SUMMARY_PLANS)
def test_every_documented_run_is_the_run_the_shipped_code_makes(summary, tmp_path):
    """Protocol v3: the plan, the data and its draws, and the key of every pretraining and run behind a documented
    table (its overrides, datalist, the code and configs, the corpus, the pretraining's weights, the numerics it ran
    on) are what the shipped code gives today: a change of the code that changes what a table measures fails here
    until the table is re-measured."""
    if not (REPO / summary).is_file():
        pytest.skip(f"{summary}: protocol v3 has not run at this commit (the docs say so)")
    result = json.loads((REPO / summary).read_text())
    (plan, records), seed = SUMMARY_PLANS[summary], result["settings"]["data_seed"]
    numerics, code = result["settings"]["numerics"], protocol.code_state()
    assert result["protocol"] == 3 and "superseded" not in result
    assert protocol.digest(schedule.plan_settings(plan, seed, numerics, code)) == result["settings_hash"], f"{summary}: the plan or code changed"
    data = plan_module.synthetic_data(tmp_path / "data", plan, seed)
    assert {**data.files(), "per_seed": schedule.draws(data, plan, seed)} == result["data"], f"{summary}: the data or its draws changed"
    pretrainings = {}
    for recipe, entry in result["recipes"].items():
        corpus = plan_module.matched_corpus(data) if recipe in plan_module.MATCHED else data.unlabeled
        for p in entry["pretrainings"]:
            key, _, _ = schedule.pretraining_job(recipe, p["seed"], plan, corpus, tmp_path, numerics, code)
            assert key == p["key"], f"{summary}: the settings of the {recipe} pretraining seed {p['seed']} changed since it ran"
            record = json.loads((REPO / records / f"pretrain_{recipe}_s{p['seed']}_{key}.json").read_text())
            pretrainings[(recipe, p["seed"])] = {**record, "recipe": recipe, "seed": p["seed"], "model": "weights.pt"}
    for run in result["runs"]:
        arm, k, s, p = run["arm"], run["k"], run["seed"], run["pretraining_seed"]
        datalist = plan_module.write_seed_datalist(data, k, s, plan, seed)
        key, _ = schedule.finetune_job(arm, k, s, plan, data, datalist, tmp_path, numerics, code,
                                       pretrainings[(run["recipe"], p)] if run["recipe"] else None)  # fmt: skip
        assert key == run["key"], f"{summary}: the settings of {schedule.run_stem(arm, k, s, p)} changed since it ran"
        assert (REPO / records / f"{schedule.run_stem(arm, k, s, p)}_{key}.json").is_file()  # every run's record committed raw


@pytest.mark.parametrize("summary", OLD_PROTOCOL)
def test_the_old_protocols_summaries_are_superseded_and_kept_whole(summary):
    """The earlier protocol's summaries say why they are superseded, and every record behind them stays committed as
    raw data (the GPU pieces ran pretrainings only)."""
    result = json.loads((REPO / summary).read_text())
    assert "superseded" in result and result["superseded"].strip()
    records = OLD_PROTOCOL[summary]
    if records is None:
        assert result["runs"] == [] and set(result["pretraining"]) == {"ssl", "dino"}
        return
    committed = {p.name for p in (REPO / records).glob("*_k*_seed*.json")}
    assert {f"{r['arm']}_k{r['k']}_seed{r['seed']}_{r['key']}.json" for r in result["runs"]} <= committed
    assert all((REPO / records / f"pretrain_{recipe}_{p['key']}.json").is_file() for recipe, p in result["pretraining"].items())


def test_the_9_seed_extension_reuses_the_plans_runs_and_adds_seeds_3_to_8():
    """The old protocol's 9-seed extension (the coverage simulation's pairs): its seeds 0-2 are the 3-seed plan's runs
    (same keys, same Dice: read from their records, not re-run), its pretrainings are the plan's, and it adds seeds 3-8
    of the six arms at k = 1 and 2."""
    plan = json.loads((REPO / "benchmarks/results/low_data_cpu.json").read_text())
    extension = json.loads((REPO / "benchmarks/results/low_data_cpu_9seeds.json").read_text())
    by_run = {(r["arm"], r["k"], r["seed"]): r for r in extension["runs"]}
    assert {s for _, _, s in by_run} == set(range(9)) and len(by_run) == len(extension["runs"]) == 9 * 2 * 6
    for run in plan["runs"]:
        reused = by_run[run["arm"], run["k"], run["seed"]]
        assert (reused["key"], reused["dice"]) == (run["key"], run["dice"])
    assert extension["pretraining"] == plan["pretraining"] and extension["data"] == plan["data"]


@pytest.mark.parametrize("commit, num_runs", [("65711b4", 28), ("8a1a45b", 36)])
def test_the_superseded_runs_of_an_earlier_commit_are_kept_whole(commit, num_runs):
    """The records of a superseded plan (65711b4: stopped when the recipes changed; 8a1a45b: keys without numerics,
    another CPU) stay committed as raw data; their summary lists every one of them and says why it is superseded."""
    summary = json.loads((REPO / f"benchmarks/results/low_data_cpu_{commit}.json").read_text())
    runs = {p.name for p in (REPO / f"benchmarks/results/low_data_cpu_{commit}").glob("*_k*_seed*.json")}
    assert {f"{r['arm']}_k{r['k']}_seed{r['seed']}_{r['key']}.json" for r in summary["runs"]} == runs and len(runs) == num_runs
    assert {r["commit"][:7] for r in summary["runs"]} == {commit} and "superseded" in summary


@pytest.mark.slow
@requires_probe
def test_the_small_plan_runs_on_a_users_msd_lists(tmp_path):
    """--labeled / --unlabeled / --shifted with lists as a user writes them: every arm trains on the user's files and
    is scored on the user's held-out and other-site volumes."""
    labeled, unlabeled, shifted = _user_lists(tmp_path / "lists")
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "low_data.py"), "--small", "--device", "cpu", "--parallel", "1",
         "--out", str(tmp_path / "out"), "--labeled", str(labeled), "--unlabeled", str(unlabeled), "--shifted", str(shifted)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=2400,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    small = plan_module.PLANS["small"]
    assert result["settings"]["data"] == "user datalists" and result["complete"] is True
    assert len(result["runs"]) == 2 + 2 * len(small.recipes)
    assert result["data"]["label_names"] == ["background", "spleen", "liver"]
    assert len(result["data"]["shifted"]) == small.shifted_pool and all("site_b" in f for f in result["data"]["shifted"])
    for run in result["runs"]:
        assert all("site_a" in f for f in run["training_files"])
        assert run["held_out_files"]["in_domain"] == result["data"]["per_seed"]["0"]["in_domain"]
        assert all("site_b" in f for f in run["held_out_files"]["shifted"])
        assert 0.0 <= run["dice"]["selected"]["shifted"]["mean"] <= 1.0


# ------------------------------------------------------------------------------------------- the lever (low_data_lever)

def test_the_lever_changes_only_the_corpus_size_and_the_arms():
    plan, lever = protocol.PLANS["cpu"], low_data_lever.lever_plan(protocol.PLANS["cpu"])
    assert {f for f in protocol.Plan.__dataclass_fields__ if getattr(plan, f) != getattr(lever, f)} == {"budget", "arms"}
    changed = {f: getattr(lever.budget, f) for f in type(plan.budget).__dataclass_fields__ if getattr(plan.budget, f) != getattr(lever.budget, f)}
    assert changed == {"num_unlabeled": 192} and lever.arms == ("scratch", "ssl", "probe_random", "probe_ssl")


def test_the_lever_reuses_the_plans_baseline_runs_and_retrains_only_from_its_own_encoder(fake_protocol, tmp_path, monkeypatch):
    """With a corpus whose size follows the plan, the pretraining key (and so the weights) changes with the lever,
    while scratch and probe_random keep their keys: the plan's records of them are reused, never re-run."""

    def data_with_corpus(root, plan, seed):
        data = _fake_data(root, plan, seed)
        data.unlabeled.write_text(json.dumps({"training": [{"image": f"u{i}.nii.gz"} for i in range(plan.budget.num_unlabeled)], "validation": []}))
        return data

    def pretrain(recipe, key, overrides, results, threads, report_only=False):  # weights that follow the pretraining's key
        return {"recipe": recipe, "key": key, "sha256": f"weights-{key}", "commit": "c", "model": f"/w/{recipe}_{key}.pt"}

    monkeypatch.setattr(runner, "synthetic_data", data_with_corpus)
    monkeypatch.setattr(runner, "run_pretraining", pretrain)
    plan = replace(PLAN, ks=(1, 2), min_seeds=1, max_seeds=1)
    runner.run(plan, tmp_path / "plan", "cpu")
    before = {(c["arm"], c["k"]): (c["key"], c["datalist"]) for c in fake_protocol}
    fake_protocol.clear()
    runner.run(low_data_lever.lever_plan(plan), tmp_path / "lever", "cpu")
    after = {(c["arm"], c["k"]): (c["key"], c["datalist"]) for c in fake_protocol}
    assert set(after) == {(a, k) for a in low_data_lever.LEVER_ARMS for k in (1, 2)}
    for (arm, k), (key, datalist) in after.items():
        assert datalist == before[(arm, k)][1]  # the same pools, validation and held-out files
        assert (key == before[(arm, k)][0]) == (arm in ("scratch", "probe_random")), (arm, k)


def _summary(dice: dict, files: str = "a") -> dict:
    """A summary with one run per (arm, k, seed) of ``dice``: selected and last in-domain / shifted means."""
    runs = [{"arm": arm, "k": k, "seed": s, "training_files": [f"{files}{k}{s}"], "validation_files": ["v"],
             "held_out_files": {"in_domain": ["h"], "shifted": ["x"]},
             "dice": {m: {"in_domain": {"mean": d}, "shifted": {"mean": d / 2}} for m in protocol.MODELS}}
            for (arm, k, s), d in dice.items()]  # fmt: skip
    return {"runs": runs, "paired": {}, "settings_hash": "h", "settings": {"budget": {"num_unlabeled": 48, "ssl_epochs": 12}}}


def test_the_lever_is_paired_with_the_plans_run_of_the_same_arm_k_and_seed():
    baseline = _summary({("ssl", 1, 0): 0.40, ("ssl", 1, 1): 0.50, ("ssl", 1, 2): 0.30, ("probe_ssl", 1, 0): 0.2, ("scratch", 1, 0): 0.9})
    lever = _summary({("ssl", 1, 0): 0.45, ("ssl", 1, 1): 0.52, ("ssl", 1, 2): 0.36, ("probe_ssl", 1, 0): 0.1})
    result = low_data_lever.with_versus_plan(lever, baseline, "plan.json")
    entry = result["paired"]["in_domain"]["selected"]["ssl - ssl (plan)"]["1"]
    assert entry["differences"] == pytest.approx([0.05, 0.02, 0.06]) and entry["n"] == 3
    assert entry["mean"] == pytest.approx(13 / 300) and entry["interval"] == pytest.approx([0.02, 0.06]) and entry["interval_kind"] == "range"
    assert result["paired"]["shifted"]["last"]["ssl - ssl (plan)"]["1"]["differences"] == pytest.approx([0.025, 0.01, 0.03])
    probe = result["paired"]["in_domain"]["selected"]["probe_ssl - probe_ssl (plan)"]["1"]
    assert probe["differences"] == pytest.approx([-0.1]) and probe["interval"] is None
    assert result["lever"]["baseline"] == "plan.json" and "192 unlabeled volumes (the plan: 48)" in result["lever"]["what"]
    with pytest.raises(ValueError, match="ssl k=1 seed=0: the lever's training_files differ"):
        low_data_lever.versus_plan(_summary({("ssl", 1, 0): 0.45}, files="b"), baseline)


def test_the_lever_refuses_a_plan_other_than_its_baselines_or_other_numerics(monkeypatch):
    baseline = {"settings": runner.plan_settings(protocol.PLANS["cpu"], 0, runner.run_numerics("cpu"), protocol.code_state())}
    low_data_lever.check_same_protocol(protocol.PLANS["cpu"], baseline)
    with pytest.raises(ValueError, match=r"differs from the baseline summary's in \['finetune_iterations'\]"):
        low_data_lever.check_same_protocol(replace(protocol.PLANS["cpu"], finetune_iterations=400), baseline)
    monkeypatch.setattr(runner, "run_numerics", lambda device: {"device": device, "torch": "2.13.0+cpu", "cpu_capability": "ZVECTOR"})
    with pytest.raises(ValueError, match=r"differs from the baseline summary's in \['numerics'\]"):
        low_data_lever.check_same_protocol(protocol.PLANS["cpu"], baseline)
