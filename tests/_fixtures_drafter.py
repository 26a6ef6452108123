"""Shared pieces of the drafter tests: micro targets (random weights, SmolLM2 tokenizer) built once
per session, and a tiny self-generated corpus."""
from __future__ import annotations

import pytest
import torch

from eqc_utils import assets


@pytest.fixture(scope="session")
def micro_llama_dir(tmp_path_factory):
    return assets.micro_llama(tmp_path_factory.mktemp("drafter") / "micro_llama")


@pytest.fixture(scope="session")
def micro_qwen35_dir(tmp_path_factory):
    return assets.micro_qwen35(tmp_path_factory.mktemp("drafter") / "micro_qwen35")


@pytest.fixture(scope="session")
def tokenizer():
    return assets.load_tokenizer("teacher")


def load_causal_lm(path):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
