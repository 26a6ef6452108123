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


@pytest.fixture(scope="session")
def chain_target_dir(micro_llama_dir, tokenizer, tmp_path_factory):
    """A micro Llama whose greedy text is a deterministic chain of whole English words.

    A random micro model is unfit for learning tests: its logits are nearly flat and its greedy text
    (runs of newlines) does not survive decode -> re-tokenise. Here 400 word tokens get unit-direction
    embeddings of norm 3 and an untied head whose row for word v is the embedding of word perm(v), so
    the next token follows a fixed permutation of the previous one: text with real structure to learn,
    and that re-tokenises to the same ids. (The chains are cycles: from the decode tests' prompt the text
    repeats after 19 words.)"""
    return make_chain_target(micro_llama_dir, tokenizer, tmp_path_factory.mktemp("drafter") / "chain_llama")


@pytest.fixture(scope="session")
def chain_qwen35_dir(micro_qwen35_dir, tokenizer, tmp_path_factory):
    """The same word chain on the micro Qwen3.5 (Gated DeltaNet + attention): varied greedy text for a
    recurrent target, so that a stale recurrent state or a wrong stop shows in the tokens."""
    return make_chain_target(micro_qwen35_dir, tokenizer, tmp_path_factory.mktemp("drafter") / "chain_qwen35")


def make_chain_target(base_dir, tokenizer, path):
    import re
    from transformers import AutoModelForCausalLM

    vocab = tokenizer.convert_ids_to_tokens(list(range(49152)))
    words = torch.tensor([i for i, s in enumerate(vocab) if re.fullmatch(r"Ġ[a-z]{3,8}", s or "")][:400])
    target = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        emb = target.get_input_embeddings().weight
        rows = torch.randn(len(words), emb.shape[1], generator=g)
        rows = 3 * rows / rows.norm(dim=1, keepdim=True)
        emb[words] = rows
        head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False)
        head.weight.copy_(emb * 0.1)
        head.weight[words] = rows[torch.randperm(len(words), generator=g)]
    target.config.tie_word_embeddings = False
    target.lm_head = head
    target.save_pretrained(path)
    for f in base_dir.iterdir():          # the tokenizer files saved beside the micro model
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            (path / f.name).write_bytes(f.read_bytes())
    return path
