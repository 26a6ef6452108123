"""Serving: vLLM server processes (launcher) and, later, the HTTP proxy in front of them."""
from eqc_utils.serving.launcher import ServerStartError, VLLMServers, vllm_cli_args

__all__ = ["VLLMServers", "ServerStartError", "vllm_cli_args"]
