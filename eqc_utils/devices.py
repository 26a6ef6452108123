"""The params `device` key resolved to a torch device string, shared by every stage that loads a model."""
from __future__ import annotations


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; 'cuda' without a GPU is an error that says what to set."""
    import torch   # here, not at module level: the prompt and generation stages import this without torch work
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("params device is 'cuda' but torch sees no CUDA device; set device: auto or cpu")
    return device


def wants_compile(setting: str, device: str) -> bool:
    """A params `compile` key ('auto', 'on', 'off'): auto compiles on CUDA only (inductor's C++ builds take
    minutes on a small CPU, longer than the runs they would speed up)."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"compile setting {setting!r}: use auto, on or off")
    return setting == "on" or (setting == "auto" and device.startswith("cuda"))
