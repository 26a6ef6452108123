"""The fixtures shared between test modules. pytest finds them here; test modules never import a
fixture (they import only plain helpers from the _fixtures_* modules).

The fixtures are defined in _fixtures_drafter.py, beside the helpers they use, and re-exported here.
_fixtures_generation.py and _fixtures_quant.py hold helpers only. A test module's own fixture of
the same name (test_latency.py's and test_packing.py's `tokenizer`) takes precedence in that module.

Imported without the `tests.` prefix: pytest's default ("prepend") import mode puts this folder on
sys.path before importing conftest.py, whatever the working directory."""
from _fixtures_drafter import (chain_qwen35_dir, chain_target_dir, corpus, micro_llama_dir, micro_qwen35_dir, tokenizer,
                               trained)

__all__ = ["chain_qwen35_dir", "chain_target_dir", "corpus", "micro_llama_dir", "micro_qwen35_dir", "tokenizer",
           "trained"]
