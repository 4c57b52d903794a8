"""RankMe in the low-data protocol: the effective rank of each encoder's embeddings of the same held-out crops, a
label-free signal set beside what the probe arms measure.

Every encoder (random, SSL, self-distillation, masked image) embeds the same ``plan.rankme_crops`` crops, the number
the pretraining bundles log RankMe on (``training#rankme_crops``, which the protocol passes to every pretraining):
RankMe is at most min(N crops, D dimensions), so values of different crop counts are not compared.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from components.demo.recipes import CT_BUNDLE, finetune_overrides
from components.demo.runner import BUNDLES_DIR
from low_data_arms import RECIPES
from low_data_protocol import Data, Plan, write_datalist


def encoder_rankme(data: Data, weights: dict[str, dict], plan: Plan, seed: int, device: str = "cpu") -> dict:
    """RankMe (``components.effective_rank``) of the random encoder and of each recipe's in ``weights`` whose file is
    there, on the same ``plan.rankme_crops`` crops of the finetuning size: as many from each held-out volume (the first
    ones one more where they do not divide evenly), preprocessed as the CT bundle validates, drawn from ``seed``, and
    embedded on ``device``. Returns ``crops`` (N), ``dims`` (D), ``bound`` (min(N, D)) and per encoder its
    ``rankme`` and the value its pretraining bundle logged at its last validation on as many crops."""
    from monai.transforms import RandSpatialCropSamples, SpatialPad

    from components import effective_rank, load_pretrained, swin_embeddings
    from machine import bundle_parser

    datalist = write_datalist(data, 1, 0, seed)
    parser = bundle_parser(BUNDLES_DIR / CT_BUNDLE, {**finetune_overrides(plan.budget, datalist, data.root / "rankme", "cpu", seed, None),
                                                     "label_names": data.label_names, **plan.finetune_overrides})  # fmt: skip
    preprocessing = parser.get_parsed_content("validate#preprocessing")
    volumes = data.in_domain + data.shifted
    pad = SpatialPad(parser["roi_size"])
    cropper = RandSpatialCropSamples(parser["roi_size"], num_samples=math.ceil(plan.rankme_crops / len(volumes)), random_size=False)
    cropper.set_random_state(seed)
    per_volume = []
    for item in volumes:
        image = preprocessing({key: str(data.root / value) for key, value in item.items()})["image"]
        per_volume.append([c.as_tensor() if hasattr(c, "as_tensor") else c for c in cropper(pad(image))])
    round_robin = [volume[index] for index in range(len(per_volume[0])) for volume in per_volume]
    batch = torch.stack(round_robin[: plan.rankme_crops])
    out: dict = {"crops": len(batch), "encoders": {}}
    for name, recipe in (("random", None), *((r, r) for r in RECIPES)):
        if recipe is not None and (recipe not in weights or not Path(weights[recipe]["model"]).is_file()):
            continue
        torch.manual_seed(1000)
        network = parser.get_parsed_content("network_def", instantiate=True, lazy=False)
        if recipe is not None:
            load_pretrained(network, weights[recipe]["model"])
        network.to(device).eval()
        with torch.no_grad():
            embeddings = torch.cat([swin_embeddings(network, chunk.to(device)).cpu() for chunk in batch.split(16)])
        out.update(dims=embeddings.shape[1], bound=min(len(batch), embeddings.shape[1]))
        out["encoders"][name] = {"rankme": effective_rank(embeddings), **centred_rank(embeddings),
                                 "logged_by_bundle": weights[recipe].get("logged_rankme") if recipe else None}  # fmt: skip
    return out


def centred_rank(embeddings: torch.Tensor) -> dict[str, float]:
    """RankMe after the embeddings' mean is removed (``rankme_centred``) and the share of their mean squared norm that
    their mean holds (``mean_share``, 0-1). RankMe as published (and as the bundles log it) does not centre, so a
    large common offset reads as collapse; these two tell the cases apart (a summary's ``rankme`` holds the measured
    values, docs/measuring.md reads them)."""
    from components import effective_rank

    mean = embeddings.mean(dim=0, keepdim=True)
    share = float(mean.square().sum() / embeddings.square().sum(dim=1).mean())
    return {"rankme_centred": effective_rank(embeddings - mean), "mean_share": share}


def rankme_agreement(rankme: dict, intervals: dict, ks: tuple[int, ...]) -> dict:
    """Whether RankMe orders the encoders (random and each recipe's) as the probe arms' in-domain Dice of the selected
    models does (``probe_<recipe> - probe_random``; random at 0), per k: {k: {"rankme_order", "probe_dice_order",
    "agrees"}}; a k without a probe contrast is left out."""
    scores = {name: e["rankme"] for name, e in rankme["encoders"].items()}
    contrasts = intervals.get("in_domain", {}).get("selected", {})
    out = {}
    for k in ks:
        dice = {"random": 0.0}
        for recipe in RECIPES:
            entry = contrasts.get(f"probe_{recipe} - probe_random", {}).get(str(k))
            if entry is not None and recipe in scores:
                dice[recipe] = entry["mean"]
        if len(dice) < 2:
            continue
        names = sorted(dice)
        by_rank = sorted(names, key=lambda n: -scores[n])
        by_dice = sorted(names, key=lambda n: -dice[n])
        out[str(k)] = {"rankme_order": by_rank, "probe_dice_order": by_dice, "agrees": by_rank == by_dice}
    return out
