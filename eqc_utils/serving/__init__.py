"""Serving: vLLM server processes (launcher), serve configs, and the HTTP proxy in front of them
(`python -m eqc_utils.serving --config <serve yaml>`, docs/serving.md)."""
from eqc_utils.serving.launcher import ServerStartError, VLLMServers, vllm_cli_args

__all__ = ["VLLMServers", "ServerStartError", "vllm_cli_args"]
