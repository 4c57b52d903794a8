"""Protocol v3's fixed parts: the plan, its data and the draws of every finetuning seed, and the matched corpus.

``low_data.py``'s docstring states the protocol; this module holds what it fixes before any run:

- which volumes train each finetuning seed at each k (:func:`training_volumes`: disjoint blocks, one per seed, so no
  two seeds share a training volume at any k, and within a seed the k = 1 volume is among its k = 2 volumes), which
  two volumes select the model, and which held-out volumes score it (:func:`held_out_draws`: per seed, drawn from a
  fixed in-domain pool and a fixed shifted pool, no two seeds drawing the same set);
- the sizes those rules need (:func:`check_plan`, before any run);
- the corpus of the ``ssl_matched`` arm: the unlabeled corpus resampled to the finetuning's spacing
  (:func:`matched_corpus`), pretrained in the finetuning's intensity window (:data:`MATCHED_OVERRIDES`).

Results are keyed by ``low_data_protocol.code_state`` and ``low_data_runs.run_numerics`` as in protocol 2.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from components.data import synthetic
from components.demo.recipes import CT_BUNDLE, SPACING, DemoBudget
from components.demo.runner import BUNDLES_DIR
from low_data_protocol import Data, DatalistError, synthetic_sets, user_data, write_text
from machine import changed_since, descends_from

#: the recipes of the plan: each demo recipe, and ``ssl_matched``, SSL pretrained in the finetuning's window and
#: spacing (the arm that measures the mismatch between pretraining and finetuning)
RECIPES = ("ssl", "dino", "mim", "ssl_matched")
#: a matched recipe and the demo recipe whose bundle and overrides it runs
MATCHED = {"ssl_matched": "ssl"}
#: how the docs name each recipe
RECIPE_NAMES = {"ssl": "SSL", "dino": "self-distillation", "mim": "masked image",
                "ssl_matched": "SSL in the finetuning's window and spacing"}  # fmt: skip
SCRATCH, PROBE_RANDOM = "scratch", "probe_random"
#: the health verdicts a run's last report may have (components.training.health)
HEALTH_VERDICTS = ("learning", "at baseline", "collapsed", "not collapsed")


def _finetuning_window() -> list[float]:
    """The CT bundle's intensity window (``intensity_range`` of its train.json), read from the bundle itself."""
    return json.loads((BUNDLES_DIR / CT_BUNDLE / "configs" / "train.json").read_text())["intensity_range"]


#: what ``ssl_matched`` adds to the SSL pretraining's overrides: the finetuning's window (its corpus is resampled to
#: the finetuning's spacing by :func:`matched_corpus`, since the pretraining bundle has no spacing transform)
MATCHED_OVERRIDES = {"intensity_range": _finetuning_window()}

#: the pretraining and finetuning sizes, written out: the demo's CPU budget (``components.demo.run.BUDGETS["cpu"]``)
#: when the protocol was fixed, so that tuning the demo later leaves the protocol as it is. Its pretraining is 59
#: epochs of the 34 training volumes of the 48-volume corpus, 2 per iteration: 1,003 iterations. The finetuning's
#: epochs and validation interval are replaced by the plan's budget (:attr:`Plan.finetune_iterations`).
PROTOCOL_BUDGET = DemoBudget(num_labeled=24, num_unlabeled=48, ssl_epochs=59, ssl_batch=2, ssl_learning_rate=4e-4,
                             ssl_warmup_iterations=20, finetune_epochs=36, finetune_crops=1, finetune_learning_rate=3e-3,
                             val_interval=6, feature_size=12)  # fmt: skip


class PlanError(ValueError):
    """A plan whose sizes cannot serve protocol v3's rules, or data too small for it: raised before any run, one line."""


@dataclass(frozen=True)
class Plan:
    """Protocol v3's sizes (the defaults are the CPU plan's).

    Each recipe is pretrained with seeds 0, 1, ... until ``pretrainings`` of them passed the health gate (their last
    report's verdict in ``passing``) or ``max_pretrainings`` were tried; ``health_crops``: the validation crops of that
    report (None: the demo's). Pretraining p is finetuned over its own block of ``finetune_seeds`` finetuning seeds
    (:func:`finetune_block`), each with its own training volumes and held-out draws, at every k in ``ks``; every
    recipe's pretraining p and the baselines use the same block. ``finetune_iterations`` (one volume per iteration,
    validated every ``val_every``, at least ``min_validations`` times, a multiple of 4) is None until the pilot
    (``pilot_iterations``, scratch and probe_random only, over block 0) fixes it; a run refuses an unfixed budget.
    ``num_validation`` volumes select the model; each seed draws ``held_out`` volumes from each of the fixed
    ``in_domain_pool`` and ``shifted_pool``. ``data_seed`` fixes the data, the blocks and the draws.
    ``convergence_gain``: the largest last-quarter gain of a converged validation curve; ``margin``: the equivalence
    margin (Dice); ``level``: the intervals' level before any correction. ``budget`` sizes the pretraining and the
    finetuning's crop, rate and network. A ``trial`` plan checks the mechanics only: it needs no pre-registration
    (:data:`PREREGISTRATION`) and its verdicts are no evidence."""

    ks: tuple[int, ...] = (1, 2)
    recipes: tuple[str, ...] = RECIPES
    finetune_seeds: int = 3
    pretrainings: int = 3
    max_pretrainings: int = 5
    passing: tuple[str, ...] = ("learning",)
    health_crops: int | None = None
    num_validation: int = 2
    in_domain_pool: int = 8
    shifted_pool: int = 8
    held_out: int = 4
    finetune_iterations: int | None = None
    val_every: int = 20
    min_validations: int = 8
    pilot_iterations: tuple[int, ...] = (480, 960)
    convergence_gain: float = 0.01
    margin: float = 0.02
    level: float = 0.95
    data_seed: int = 0
    budget: DemoBudget = PROTOCOL_BUDGET
    trial: bool = False

    @property
    def seeds(self) -> int:
        """The finetuning seeds of every block the plan may use: ``finetune_seeds`` per pretraining seed tried."""
        return self.max_pretrainings * self.finetune_seeds

    @property
    def training_pool(self) -> int:
        """The labeled volumes the seeds train on: max(k) of their own per finetuning seed."""
        return self.seeds * max(self.ks)


def finetune_block(pretraining_seed: int, plan: Plan) -> list[int]:
    """The finetuning seeds of pretraining ``pretraining_seed``'s block: ``p * F`` to ``p * F + F - 1``, F =
    ``plan.finetune_seeds``. Nesting the finetuning seeds in the pretrainings makes the pretraining means independent
    (each has its own volumes and held-out draws), so their t-interval covers the finetuning's draw too; the
    baselines of a block pair with every recipe's pretraining of that seed."""
    return list(range(pretraining_seed * plan.finetune_seeds, (pretraining_seed + 1) * plan.finetune_seeds))


#: the pre-registration commit of the CPU plan: the commit that fixes the plan (its finetuning budget the pilot's
#: answer) and its analysis code (:data:`ANALYSIS_CODE`). A commit cannot name itself, so a later commit writes it
#: here, before any record of the plan exists; until then the CPU plan refuses to run, and every record of it must be
#: made at a commit that descends from this one (:func:`check_preregistered`, the summary's check).
PREREGISTRATION: str | None = None
#: the plan's analysis code, which the pre-registration commit fixes too: a summary whose code of these files differs
#: from that commit's withholds every verdict (:func:`preregistration_status`). ``low_data_docs.py`` only renders a
#: summary and ``low_data.py`` is the command line: neither is part of it.
ANALYSIS_CODE = ("benchmarks/low_data_plan.py", "benchmarks/low_data_schedule.py", "benchmarks/low_data_verdicts.py",
                 "benchmarks/low_data_stats.py", "benchmarks/low_data_runs.py", "benchmarks/low_data_protocol.py")  # fmt: skip

#: the committed summary of the CPU plan's pilot (``low_data.py --pilot --json ...``): a non-trial plan's finetuning
#: budget must be its answer (:func:`check_pilot`)
PILOT_SUMMARY = Path(__file__).resolve().parent / "results" / "low_data_cpu_protocol3_pilot.json"
#: the plan's fields that define its pilot: a pilot run with other values of any of them does not fix this plan's budget
PILOT_FIELDS = ("ks", "finetune_seeds", "num_validation", "in_domain_pool", "shifted_pool", "held_out", "val_every", "min_validations",
                "convergence_gain", "data_seed", "pilot_iterations", "budget")  # fmt: skip

PLANS = {
    # the CPU plan: its finetuning budget is fixed from the pilot (low_data.py --pilot) before the pre-registration
    "cpu": Plan(finetune_iterations=480),
    # CI: the mechanics on tiny sizes; it learns nothing, so its gate admits every verdict (never a real plan's)
    "small": Plan(ks=(1,), finetune_seeds=1, pretrainings=1, max_pretrainings=1, passing=HEALTH_VERDICTS, health_crops=8, num_validation=1,
                  in_domain_pool=2, shifted_pool=2, held_out=1, finetune_iterations=4, val_every=1, min_validations=4,
                  pilot_iterations=(4,), budget=replace(PROTOCOL_BUDGET, num_unlabeled=6, ssl_epochs=1), trial=True),
}  # fmt: skip


def _budget_errors(plan: Plan, iterations: int, what: str) -> list[str]:
    errors = [f"{name} ({value}) must be a multiple of every k {plan.ks} (one volume per iteration)"
              for name, value in ((what, iterations), ("val_every", plan.val_every)) for k in plan.ks if value % k]  # fmt: skip
    if iterations % plan.val_every:
        errors.append(f"{what} ({iterations}) must be a multiple of val_every ({plan.val_every})")
    elif iterations // plan.val_every < max(4, plan.min_validations) or (iterations // plan.val_every) % 4:
        errors.append(f"{what} ({iterations}) gives {iterations // plan.val_every} validations; the convergence rule "
                      f"compares the last two quarters of at least {max(4, plan.min_validations)}, a multiple of 4")  # fmt: skip
    return errors


def check_plan(plan: Plan, pilot: bool = False) -> None:
    """Checks that the plan's sizes serve the rules, before any run: distinct held-out draws for every seed of every
    block (``C(pool, held_out) >= max_pretrainings * finetune_seeds``), budgets that are multiples of every k and of
    ``val_every`` giving at least ``min_validations`` validations, a multiple of 4 (the convergence rule compares whole
    quarters), a known recipe and verdict, and (unless ``pilot``) a fixed finetuning budget.

    Raises:
        PlanError: naming every rule broken, in one line.
    """
    errors = []
    unknown = [r for r in plan.recipes if r not in RECIPES]
    if unknown:
        errors.append(f"unknown recipes {unknown} (the recipes are {list(RECIPES)})")
    if not plan.ks or min(plan.ks) < 1:
        errors.append(f"ks must be positive, got {plan.ks}")
    if not 1 <= plan.pretrainings <= plan.max_pretrainings:
        errors.append(f"pretrainings ({plan.pretrainings}) must be between 1 and max_pretrainings ({plan.max_pretrainings})")
    if plan.finetune_seeds < 1 or plan.num_validation < 1:
        errors.append("finetune_seeds and num_validation must be at least 1")
    for name, pool in (("in_domain_pool", plan.in_domain_pool), ("shifted_pool", plan.shifted_pool)):
        if not 1 <= plan.held_out <= pool:
            errors.append(f"held_out ({plan.held_out}) must be between 1 and {name} ({pool})")
        elif math.comb(pool, plan.held_out) < plan.seeds:
            errors.append(f"{name} ({pool}) gives {math.comb(pool, plan.held_out)} distinct draws of {plan.held_out}, fewer "
                          f"than the {plan.seeds} finetuning seeds ({plan.finetune_seeds} per pretraining seed, "
                          f"{plan.max_pretrainings} pretraining seeds at most)")  # fmt: skip
    bad = [v for v in plan.passing if v not in HEALTH_VERDICTS]
    if bad or not plan.passing:
        errors.append(f"passing must be verdicts of {list(HEALTH_VERDICTS)}, got {list(plan.passing)}")
    if not (0 < plan.margin and 0 < plan.level < 1 and 0 < plan.convergence_gain):
        errors.append("margin and convergence_gain must be positive and level in (0, 1)")
    if plan.ks and min(plan.ks) >= 1:
        for iterations in plan.pilot_iterations if pilot else ():
            errors += _budget_errors(plan, iterations, "pilot budget")
        if not pilot and plan.finetune_iterations is None:
            errors.append("the finetuning budget (finetune_iterations) is not fixed: run the pilot (low_data.py --pilot) "
                          "and fix it in PLANS before the pre-registration commit")  # fmt: skip
        elif not pilot:
            errors += _budget_errors(plan, plan.finetune_iterations, "finetune_iterations")
    if errors:
        raise PlanError("the plan cannot serve protocol v3: " + "; ".join(errors) + ".")


def check_pilot(plan: Plan) -> None:
    """Checks that a plan's finetuning budget is its pilot's answer: the committed pilot summary
    (:data:`PILOT_SUMMARY`) is there and complete, was run with the plan's values of every field of
    :data:`PILOT_FIELDS`, found a converged budget, and ``plan.finetune_iterations`` is its
    ``smallest_converged_budget``. A non-monotone pilot (a budget converged, a larger one not) still fixes its
    smallest converged budget, as the rule says; the plan's own runs check the convergence again (their verdicts are
    withheld where it fails). A ``trial`` plan needs no pilot.

    Raises:
        PlanError: naming the file and what fails, in one line.
    """
    if plan.trial:
        return
    name = PILOT_SUMMARY
    try:
        pilot = json.loads(PILOT_SUMMARY.read_text())
    except FileNotFoundError:
        raise PlanError(f"no pilot summary {name}: run the pilot (low_data.py --pilot --json ...) and commit its "
                        "summary before the pre-registration.") from None  # fmt: skip
    except ValueError as err:
        raise PlanError(f"the pilot summary {name} is not JSON: {err}.") from None
    if pilot.get("complete") is not True:
        raise PlanError(f"the pilot summary {name} is not complete ({len(pilot.get('missing_runs') or [])} runs missing): "
                        "run the pilot to its end before the pre-registration.")  # fmt: skip
    ours, theirs = json.loads(json.dumps(asdict(plan))), pilot.get("settings") or {}
    differ = [f"{f} {theirs.get(f)} (the plan: {ours[f]})" for f in PILOT_FIELDS if theirs.get(f) != ours[f]]
    if differ:
        raise PlanError(f"the pilot summary {name} was run with other settings than the plan's: {'; '.join(differ)}.")
    budget = pilot.get("smallest_converged_budget")
    if budget is None:
        raise PlanError("no pilot budget converged: add a larger budget to pilot_iterations and run the pilot again before "
                        "the pre-registration.")  # fmt: skip
    if plan.finetune_iterations != budget:
        raise PlanError(f"finetune_iterations ({plan.finetune_iterations}) is not the pilot's smallest converged budget "
                        f"({budget}, {name}).")  # fmt: skip


def check_preregistered(plan: Plan, head: str) -> None:
    """Checks, before any run of a plan that is not a ``trial``, that it is pre-registered and that this checkout may
    add records to it: :data:`PREREGISTRATION` is set, the finetuning budget is the pilot's answer
    (:func:`check_pilot`) and ``head`` (this checkout's commit, as ``machine.git_commit`` records it) is that commit
    or a descendant, with no uncommitted change.

    Raises:
        PlanError: naming what is missing, in one line.
    """
    if plan.trial:
        return
    if PREREGISTRATION is None:
        raise PlanError("the plan is not pre-registered: fix its finetuning budget from the pilot (low_data.py --pilot) in "
                        "PLANS, commit, then name that commit in low_data_plan.PREREGISTRATION.")  # fmt: skip
    check_pilot(plan)
    if not descends_from(head, PREREGISTRATION):
        raise PlanError(f"this checkout ({head}) is not the pre-registration commit {PREREGISTRATION} or a descendant of it "
                        "with no uncommitted change: its records would not follow the pre-registration.")  # fmt: skip


def preregistration_status(commits: list[str]) -> dict:
    """Whether every record's commit follows the pre-registration (:data:`PREREGISTRATION`) and the analysis code is
    the pre-registered one: ``{"commit", "records_after", "not_after", "analysis_changed"}``: the commits that do not
    descend from it (all of them while none is set) and the files of :data:`ANALYSIS_CODE` that differ in this
    checkout from that commit (``machine.changed_since``: all of them where git cannot tell; None while none is set)."""
    not_after = sorted({c for c in commits if PREREGISTRATION is None or not descends_from(c, PREREGISTRATION)})
    changed = None if PREREGISTRATION is None else changed_since(PREREGISTRATION, ANALYSIS_CODE)
    return {"commit": PREREGISTRATION, "records_after": not not_after, "not_after": not_after, "analysis_changed": changed}


def training_volumes(data: Data, k: int, seed: int, plan: Plan) -> list[dict]:
    """The k training volumes of finetuning ``seed``: the first k of the seed's own max(k) volumes of the training
    pool (one permutation of the pool by the plan's data seed cut into consecutive runs of max(k); their order drawn
    from (data seed, seed)). These are disjoint, so seeds never share a training volume at any k; within a seed the
    volumes are nested.

    Raises:
        PlanError: a k outside the plan's or a seed beyond the pool.
    """
    size = max(plan.ks)
    if k not in plan.ks or not 0 <= seed < plan.seeds or len(data.pool) < plan.training_pool:
        raise PlanError(f"k = {k}, seed {seed}: the plan has ks {plan.ks}, seeds 0-{plan.seeds - 1} and a training "
                        f"pool of {plan.training_pool} volumes (the data has {len(data.pool)}).")  # fmt: skip
    order = np.random.default_rng([plan.data_seed, 2000]).permutation(len(data.pool))
    block = [data.pool[i] for i in order[seed * size : (seed + 1) * size]]
    within = np.random.default_rng([plan.data_seed, 3000 + seed]).permutation(size)
    return [block[i] for i in within[:k]]


def held_out_draws(pool_size: int, count: int, seeds: int, stream: list[int]) -> list[list[int]]:
    """For seeds 0 .. ``seeds`` - 1 the sorted indices of ``count`` of ``pool_size`` pool volumes: drawn without
    replacement in turn from one generator of ``stream``, a draw equal to an earlier seed's drawn again. Seed s's draw
    does not depend on how many seeds follow it."""
    rng = np.random.default_rng(stream)
    draws: list[list[int]] = []
    while len(draws) < seeds:
        draw = sorted(int(i) for i in rng.choice(pool_size, count, replace=False))
        if draw not in draws:
            draws.append(draw)
    return draws


def seed_data(data: Data, seed: int, plan: Plan) -> Data:
    """The data of finetuning ``seed``: ``in_domain`` and ``shifted`` are its draws from the two pools (the rest as
    ``data``), so a run of this seed is scored on them."""
    inside = held_out_draws(plan.in_domain_pool, plan.held_out, plan.seeds, [plan.data_seed, 4000])[seed]
    shifted = held_out_draws(plan.shifted_pool, plan.held_out, plan.seeds, [plan.data_seed, 5000])[seed]
    return replace(data, in_domain=[data.in_domain[i] for i in inside], shifted=[data.shifted[i] for i in shifted])


def write_seed_datalist(data: Data, k: int, seed: int, plan: Plan) -> Path:
    """The datalist of (k, finetuning ``seed``): ``training`` (:func:`training_volumes`), ``validation`` (model
    selection), ``heldout`` (the seed's in-domain then shifted draws: :func:`seed_data`) and the MSD ``labels``;
    written atomically (the arms of a pair write and read it side by side)."""
    path = data.root / "lists" / f"k{k}_f{seed}.json"
    drawn = seed_data(data, seed, plan)

    def rel(items: list[dict]) -> list[dict]:
        return [{key: os.path.relpath(data.root / value, path.parent) for key, value in item.items()} for item in items]

    content = {"labels": {str(i): n for i, n in enumerate(data.label_names)},
               "training": rel(training_volumes(data, k, seed, plan)), "validation": rel(data.validation),
               "heldout": rel(drawn.in_domain + drawn.shifted)}  # fmt: skip
    text = json.dumps(content, indent=2) + "\n"
    if not path.is_file() or path.read_text() != text:
        write_text(path, text)
    return path


def synthetic_data(root: Path, plan: Plan) -> Data:
    """The synthetic sets (``low_data_protocol.synthetic_sets``) split by index: the training pool, the validation
    volumes, then the in-domain pool; the shifted pool is the shifted set."""
    pool, val = plan.training_pool, plan.num_validation
    labeled, shifted = synthetic_sets(root, plan.data_seed, pool + val + plan.in_domain_pool, plan.shifted_pool, plan.budget.num_unlabeled)
    return Data(root, labeled[:pool], labeled[pool : pool + val], labeled[pool + val :], shifted[: plan.shifted_pool],
                ["background", *synthetic.DEMO_ORGANS], root / "unlabeled" / "dataset.json")  # fmt: skip


def users_data(root: Path, plan: Plan, labeled: Path, unlabeled: Path, shifted: Path | None) -> Data:
    """The plan on a user's datalists (``low_data_protocol.user_data``, the same checks that no validation or held-out
    volume is pretrained on or in another split): the labeled entries permuted by the plan's data seed give the in-domain pool,
    the validation volumes and the training pool; ``shifted`` (needed: the shifted pool) gives the shifted pool.

    Raises:
        DatalistError: as ``user_data``, and without ``shifted``; before any run.
    """
    if shifted is None:
        raise DatalistError("protocol v3 scores every run on a shifted held-out set too: --shifted names its labeled list.")
    return user_data(root, plan, plan.data_seed, labeled, unlabeled, shifted, (plan.in_domain_pool, plan.num_validation, plan.training_pool),
                     plan.shifted_pool)  # fmt: skip


def check_data(data: Data, plan: Plan) -> None:
    """Raises :class:`PlanError` when the data has fewer volumes in a split than the plan needs."""
    needed = {"training pool": (len(data.pool), plan.training_pool), "validation": (len(data.validation), plan.num_validation),
              "in-domain pool": (len(data.in_domain), plan.in_domain_pool), "shifted pool": (len(data.shifted), plan.shifted_pool)}  # fmt: skip
    short = [f"{name} has {have}, the plan needs {need}" for name, (have, need) in needed.items() if have < need]
    if short:
        raise PlanError("the data cannot serve the plan: " + "; ".join(short) + ".")


def matched_corpus(data: Data, spacing: list[float] = SPACING) -> Path:
    """The unlabeled corpus resampled to ``spacing`` (mm; the finetuning's), as the finetuning resamples (RAS, then
    bilinear), written as float32 NIfTI under ``<data root>/unlabeled_matched/`` with a datalist of the same training
    and validation lists; skipped when its manifest names the same corpus and spacing. Returns the datalist."""
    from monai.transforms import Compose, EnsureChannelFirst, LoadImage, Orientation, Spacing
    import nibabel as nib

    out = data.root / "unlabeled_matched"
    source = json.loads(data.unlabeled.read_text())
    manifest = {"corpus": source, "spacing": list(spacing)}
    datalist = out / "dataset.json"
    if (out / "manifest.json").is_file() and json.loads((out / "manifest.json").read_text()) == manifest and datalist.is_file():
        return datalist
    resample = Compose([LoadImage(image_only=True, dtype=np.float32), EnsureChannelFirst(), Orientation("RAS"),
                        Spacing(pixdim=spacing, mode="bilinear")])  # fmt: skip
    lists: dict[str, list[dict]] = {}
    for key in ("training", "validation"):
        for index, item in enumerate(source.get(key, [])):
            image = resample(str(data.unlabeled.parent / item["image"]))
            name = f"images/{key}_{index:04d}_{Path(item['image']).name}"  # a user's corpus may repeat a file name
            (out / "images").mkdir(parents=True, exist_ok=True)
            nib.save(nib.Nifti1Image(image[0].numpy().astype(np.float32), image.affine.numpy()), str(out / name))
            lists.setdefault(key, []).append({"image": name})
    write_text(datalist, json.dumps(lists, indent=2) + "\n")
    write_text(out / "manifest.json", json.dumps(manifest, indent=2) + "\n")
    return datalist
