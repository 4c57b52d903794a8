"""Where benchmark figures come from: the machine facts every benchmark prints with its results."""

from __future__ import annotations

import os
import platform

import monai
import torch


def machine_info() -> dict:
    """Where the figures come from: CPU count, load averages, torch threads and versions."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_avg_1_5_15": [round(v, 2) for v in load],
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "monai": monai.__version__,
        "cuda": torch.cuda.is_available(),
    }
