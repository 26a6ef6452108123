"""Shared pieces of the drafter tests: micro targets (random weights, SmolLM2 tokenizer) built once
per session, a tiny self-generated corpus and a drafter trained on it (once per module), and helpers.

The fixtures reach the tests through tests/conftest.py; test modules import only the plain helpers.
torch and the library's heavier modules are imported inside the functions: conftest.py imports this
module in every test session."""
from __future__ import annotations

import pytest

from eqc_utils import assets
from _micro_models import micro_llama, micro_qwen35

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Explain gravity.",
             "List three fruits.", "How do I sort a list in Python?", "Tell me a joke."]


@pytest.fixture(scope="session")
def micro_llama_dir(tmp_path_factory):
    return micro_llama(tmp_path_factory.mktemp("drafter") / "micro_llama")


@pytest.fixture(scope="session")
def micro_qwen35_dir(tmp_path_factory):
    return micro_qwen35(tmp_path_factory.mktemp("drafter") / "micro_qwen35")


@pytest.fixture(scope="session")
def tokenizer():
    return assets.load_tokenizer("teacher")


def load_causal_lm(path):
    import torch
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

    import torch
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


@pytest.fixture(scope="module")
def corpus(chain_target_dir, tokenizer, tmp_path_factory):
    """Conversations whose answers are the chain target's own greedy continuations."""
    from eqc_utils import io
    from eqc_utils.drafter.decode import greedy_generate
    target = load_causal_lm(chain_target_dir)
    rows = []
    for i, question in enumerate(QUESTIONS):
        conv = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(conv, tokenize=True, add_generation_prompt=True, return_dict=False)
        answer = tokenizer.decode(greedy_generate(target, ids, 48).output_ids, skip_special_tokens=True)
        rows.append({"id": str(i), "category": ("chat", "math")[i % 2],
                     "conversations": conv + [{"role": "assistant", "content": answer}]})
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    io.write_jsonl(path, rows)                      # split_heldout keeps one of them (smallest md5 of its id) out
    return path, rows


def tiny_params(**changes):
    from eqc_utils.params import load_params
    P = load_params("tiny")["drafter"]
    P.update(num_layers=1, block_size=8, num_anchors=48, heldout_prompts=1, epochs=1000, max_steps=60,
             batch_size=2, grad_accum=1, save_every=30, log_every=10, eval_max_new_tokens=40, lr=3e-3,
             precision="fp32", resume=True)
    P.update(changes)
    return P


@pytest.fixture(scope="module")
def trained(chain_target_dir, tokenizer, corpus, tmp_path_factory):
    from eqc_utils.drafter.runs import train_run
    path, rows = corpus
    P = tiny_params()
    result = train_run("learn", chain_target_dir, path, tmp_path_factory.mktemp("learn") / "run", P, tokenizer,
                       device="cpu")
    return result, P, rows


def brute_force_mask(anchors, valid, context_len, block_size, window=None):
    """The drafter's attention rule (docs/recipe.md §3.2 step 4) written as nested loops: query slot k of
    block n (position a_n + k) sees context j iff the block is valid and j < a_n (and, with a window,
    a_n + k - j < window), and it sees its own block."""
    import torch
    batch, n = anchors.shape
    q_len = n * block_size
    mask = torch.zeros(batch, 1, q_len, context_len + q_len, dtype=torch.bool)
    for b in range(batch):
        for blk in range(n):
            for k in range(block_size):
                q = blk * block_size + k
                for j in range(context_len):
                    mask[b, 0, q, j] = (bool(valid[b, blk]) and j < anchors[b, blk]
                                        and (window is None or anchors[b, blk] + k - j < window))
                for j in range(block_size):
                    mask[b, 0, q, context_len + blk * block_size + j] = True
    return mask


def notebook_runs(tmp_path, monkeypatch, qad_data, target_dir, profile: str = "tiny"):
    """runs/, figures/ and reports/ under tmp_path (the EQC_*_DIR variables), holding what the drafter
    notebooks read from earlier stages: `qad_data` as 05's QAD data, `target_dir` as 04's dense target.
    Returns the profile's runs folder."""
    import shutil
    for var, sub in (("EQC_RUNS_DIR", "runs"), ("EQC_FIGURES_DIR", "figures"), ("EQC_REPORTS_DIR", "reports")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    runs = tmp_path / "runs" / profile
    (runs / "05_qad_data").mkdir(parents=True)
    shutil.copy(qad_data, runs / "05_qad_data" / "qad.jsonl")
    shutil.copytree(target_dir, runs / "04_pack_target" / "target_dense")
    return runs
