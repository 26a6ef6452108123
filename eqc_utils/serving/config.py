"""Serve configs: which model vLLM serves behind the proxy, with which drafter and flags.

A serve config is a small YAML file (`configs/serve/*.yaml`), deep-merged onto `DEFAULTS`:

    name: tiny_dflash                       # informational
    model: "{runs}/tiny/04_pack_target/target_ct"
    served_model_name: target               # the `model` name clients send
    quant: null                             # --quantization (null: vLLM reads it from the checkpoint)
    trust_remote_code: false
    tokenizer: null                         # --tokenizer (null: the model folder's)
    chat_template: null                     # --chat-template (a .jinja file; null: the model's own)
    speculative_config:                     # null: plain autoregressive decoding
      method: dflash
      model: "{runs}/tiny/07_drafter_finetune/finetune/drafter"
      num_speculative_tokens: 7
    device: auto                            # auto | cpu | cuda (auto: GPU when torch sees one)
    vllm_args: {max_model_len: 1024, max_num_seqs: 1}
    env: {}                                 # extra environment for the vLLM process
    startup_timeout: 900
    proxy: {max_attempts: 4, backoff_base: 0.5, max_restarts: 3, ...}

Paths (`model`, `tokenizer`, `chat_template`, `speculative_config.model`) may use `{runs}` (the runs
folder, EQC_RUNS_DIR) and `{repo}` (the repository root); a relative path is looked up from the
current folder, then from the repository root; anything else (e.g. a hub id) is passed on unchanged.

`vllm_args` keys are `vllm serve` flags with `_` or `-` (`max_model_len` = `--max-model-len`).
A few keys are handled specially: `enable_chunked_prefill` and `enable_prefix_caching` become
`--no-…` when false (vLLM's own default applies when absent), `cudagraph_mode` goes into
`--compilation-config`, and dicts/lists are passed as JSON. Every other key passes through as it is.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from eqc_utils.paths import REPO_ROOT, runs_root

DEFAULTS: dict[str, Any] = {
    "name": None,
    "engine": "vllm",
    "model": None,
    "served_model_name": None,      # null: the `model` string, as vLLM itself would name it
    "quant": None,
    "trust_remote_code": False,
    "tokenizer": None,
    "chat_template": None,
    "speculative_config": None,
    "device": "auto",
    "vllm_args": {"max_model_len": 8704, "max_num_seqs": 1, "dtype": "auto"},
    "env": {},
    "startup_timeout": 900.0,
    "log_dir": None,                # null: a temporary folder (its path is in the proxy's log)
    "proxy": {
        "internal_port": None,      # vLLM's loopback port; null: a free one at each start
        "max_attempts": 4,          # tries per request on a vLLM 5xx or a connection error
        "backoff_base": 0.5,        # seconds; the wait before try k+1 is backoff_base * 2**k
        "max_restarts": 3,          # restarts of a vLLM that died after becoming ready
        "request_timeout": 900.0,   # seconds for a whole upstream response
        "connect_timeout": 15.0,
        "health_timeout": 2.0,      # seconds vLLM's /health may take when /ping asks
        "max_connections": 256,     # open connections to vLLM
        "graceful_shutdown": 10.0,  # seconds open requests get when the proxy is asked to stop
    },
}

PATH_KEYS = ("model", "tokenizer", "chat_template")
NEGATABLE = {"enable_chunked_prefill", "enable_prefix_caching"}   # false -> --no-<flag>


class ServeConfigError(ValueError):
    """A serve config is missing, malformed or names unknown keys."""


@dataclass
class ServeConfig:
    """A loaded serve config (see the module docstring for the keys)."""
    raw: dict
    source: str = "<dict>"
    values: dict = field(init=False)

    def __post_init__(self):
        self.values = validate(self.raw, self.source)

    def __getitem__(self, key: str):
        return self.values[key]

    @property
    def model(self) -> str:
        return self.values["model"]

    @property
    def served_model_name(self) -> str:
        return self.values["served_model_name"] or self.values["model"]

    @property
    def proxy(self) -> dict:
        return self.values["proxy"]

    @property
    def speculative(self) -> bool:
        return bool(self.values["speculative_config"])

    def vllm_flags(self) -> list[str]:
        """`vllm serve` flags after the model (host, port and served name are added by the launcher)."""
        return vllm_flags(self.values)


def deep_merge(base: Mapping, update: Mapping) -> dict:
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def resolve_path(value: str | None) -> str | None:
    """Expand `{runs}` / `{repo}`; a relative path found from the current folder or the repository
    root becomes absolute; anything else (a hub id, a folder not built yet) is returned expanded."""
    if value is None:
        return None
    text = str(value).replace("{runs}", str(runs_root())).replace("{repo}", str(REPO_ROOT))
    path = Path(text).expanduser()
    if path.is_absolute():
        return str(path)
    for base in (Path.cwd(), REPO_ROOT):
        if (base / path).exists():
            return str((base / path).resolve())
    return text


def validate(raw: Mapping, source: str = "<dict>") -> dict:
    """Defaults merged in, keys checked, paths resolved, `speculative_config` parsed when given as JSON."""
    if not isinstance(raw, Mapping):
        raise ServeConfigError(f"{source}: a serve config must be a YAML mapping, not {type(raw).__name__}")
    unknown = sorted(set(raw) - set(DEFAULTS))
    if unknown:
        raise ServeConfigError(f"{source}: unknown key(s) {unknown}; known: {sorted(DEFAULTS)}")
    unknown = sorted(set(raw.get("proxy") or {}) - set(DEFAULTS["proxy"]))
    if unknown:
        raise ServeConfigError(f"{source}: unknown proxy key(s) {unknown}; known: {sorted(DEFAULTS['proxy'])}")
    given = {k: v for k, v in raw.items() if v is not None or k not in ("vllm_args", "env", "proxy")}
    if isinstance(given.get("vllm_args"), Mapping):   # one spelling per flag, so overrides replace defaults
        given["vllm_args"] = {str(k).lstrip("-").replace("-", "_"): v for k, v in given["vllm_args"].items()}
    values = deep_merge(DEFAULTS, given)
    if values["engine"] != "vllm":
        raise ServeConfigError(f"{source}: engine '{values['engine']}' is not supported (only 'vllm')")
    if not values["model"]:
        raise ServeConfigError(f"{source}: 'model' is required (a model folder or hub id)")
    if values["device"] not in ("auto", "cpu", "cuda"):
        raise ServeConfigError(f"{source}: device must be auto, cpu or cuda (got {values['device']!r})")
    for key in ("vllm_args", "env", "proxy"):
        if not isinstance(values[key], Mapping):
            raise ServeConfigError(f"{source}: '{key}' must be a mapping")
    reserved = {"host", "port", "served_model_name", "model"} & set(values["vllm_args"])
    if reserved:
        raise ServeConfigError(f"{source}: vllm_args may not set {sorted(reserved)}: the proxy chooses vLLM's host "
                               "and port; set the model and served_model_name as top-level keys")
    for key in PATH_KEYS:
        values[key] = resolve_path(values[key])
    spec = values["speculative_config"]
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as err:
            raise ServeConfigError(f"{source}: speculative_config is neither a mapping nor JSON: {err}") from err
    if spec:
        if not isinstance(spec, Mapping) or "method" not in spec:
            raise ServeConfigError(f"{source}: speculative_config needs at least a 'method' (e.g. dflash)")
        spec = dict(spec)
        if spec.get("model"):
            spec["model"] = resolve_path(spec["model"])
    values["speculative_config"] = spec or None
    proxy = values["proxy"]
    if int(proxy["max_attempts"]) < 1:
        raise ServeConfigError(f"{source}: proxy.max_attempts must be >= 1")
    if int(proxy["max_restarts"]) < 0:
        raise ServeConfigError(f"{source}: proxy.max_restarts must be >= 0")
    return values


def _flag(key: str) -> str:
    return "--" + key.lstrip("-").replace("_", "-")


def vllm_flags(values: Mapping) -> list[str]:
    """The `vllm serve` flags of a validated config (model, host, port, served name excluded)."""
    flags: list[str] = []
    if values.get("quant"):
        flags += ["--quantization", str(values["quant"])]
    if values.get("trust_remote_code"):
        flags.append("--trust-remote-code")
    if values.get("tokenizer"):
        flags += ["--tokenizer", str(values["tokenizer"])]
    if values.get("chat_template"):
        flags += ["--chat-template", str(values["chat_template"])]
    if values.get("speculative_config"):
        flags += ["--speculative-config", json.dumps(values["speculative_config"])]
    args = dict(values.get("vllm_args") or {})
    compilation = args.pop("compilation_config", None) or args.pop("compilation-config", None)
    cudagraph = args.pop("cudagraph_mode", None) or args.pop("cudagraph-mode", None)
    if isinstance(compilation, str):
        compilation = json.loads(compilation)
    if cudagraph is not None:
        compilation = {**(compilation or {}), "cudagraph_mode": cudagraph}
    if compilation:
        args["compilation_config"] = compilation
    for key, value in args.items():
        name = key.lstrip("-").replace("-", "_")
        if value is None:
            continue
        if value is False:
            if name in NEGATABLE:
                flags.append(_flag("no_" + name))
            continue
        if value is True:
            flags.append(_flag(name))
        elif isinstance(value, (dict, list)):
            flags += [_flag(name), json.dumps(value)]
        else:
            flags += [_flag(name), str(value)]
    return flags


def load_serve_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ServeConfig:
    """Read a serve YAML (a bare name is looked up in configs/serve/) and apply dotted overrides,
    e.g. {"vllm_args.max_model_len": 16384, "proxy.max_restarts": 0}."""
    path = Path(path)
    if not path.exists() and len(path.parts) == 1:
        candidate = REPO_ROOT / "configs" / "serve" / (path.name if path.suffix else f"{path.name}.yaml")
        if candidate.exists():
            path = candidate
    if not path.is_file():
        raise ServeConfigError(f"serve config {path}: no such file (shipped ones: {', '.join(shipped_configs())})")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ServeConfigError(f"serve config {path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ServeConfigError(f"serve config {path}: must be a YAML mapping")
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ServeConfigError(f"override {dotted}: '{part}' is not a mapping in {path}")
        node[leaf] = value
    return ServeConfig(raw, str(path))


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in (REPO_ROOT / "configs" / "serve").glob("*.yaml"))
