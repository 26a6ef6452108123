"""Evaluation of the served models: latency per prompt-length bucket with speedups between servers
(`latency`), and the mean acceptance length of speculative decoding from vLLM's counters (`acceptance`)."""
