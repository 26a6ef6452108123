"""eqc: reproducibility package for "Quantize the Target, Quantize the Drafter" (arXiv 2607.04244).

Importing the package makes the process offline for model hubs unless the caller already chose
otherwise (a paper-profile user exports HF_HUB_OFFLINE=0; `assets.hub_allowed` in params does the same
for a stage). Tiny and small profiles only ever read local assets.
"""
import os

for _flag in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_flag, "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("MPLBACKEND", "agg")
