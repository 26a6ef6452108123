"""Rows of the data generator, whichever backend answers: prompts in, resume, the partial-file writer, output
rows and run statistics (the file formats are described in `eqc_utils.generation`)."""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, NamedTuple

from eqc_utils.conversation import request_messages
from eqc_utils.io import describe_changes, read_jsonl, stale_name, write_jsonl

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- rows in, rows out
def load_prompts(path: str | Path, limit: int | None = None) -> list[tuple[dict, list[dict]]]:
    """(row, messages) pairs, first occurrence of each id kept; malformed lines raise naming the line."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"prompts file {path} does not exist (made by stage 01_prompts)")
    rows, seen, duplicates = [], set(), 0
    for lineno, row in _rows_with_lines(path):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict) or not isinstance(row.get("id"), (str, int)):
            raise ValueError(f"{where}: prompt row needs an 'id' (string)")
        if row["id"] in seen:
            duplicates += 1
            continue
        seen.add(row["id"])
        rows.append((row, request_messages(row, where)))
        if limit is not None and len(rows) >= limit:
            break
    if duplicates:
        log.warning("%s: %d rows repeat an earlier id and were skipped", path, duplicates)
    return rows


def _rows_with_lines(path: Path) -> Iterable[tuple[int, dict]]:
    """Like io.read_jsonl (same error on a malformed line) but keeps the line numbers."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg}); fix or delete that line") from err


def reconstruct_text(content: str | None, reasoning: str | None, thinking: str, include_reasoning: bool) -> str:
    """The stored response (docs/recipe.md §1.5 step 8): re-join server-split reasoning as <think>…</think>."""
    content = (content or "").strip()
    reasoning = (reasoning or "").strip()
    if thinking == "off":
        return content
    if reasoning and include_reasoning:
        return f"<think>\n{reasoning}\n</think>\n\n{content}".strip()
    if not content:
        return reasoning
    if thinking == "on" and include_reasoning and not content.startswith("<think>"):
        return "<think>\n" + content
    return content


def sampling_params(gen: dict) -> dict:
    """Sampling settings from params' `generation` section, as recorded in every output row."""
    out = {"max_tokens": gen["max_tokens"], "temperature": gen["temperature"], "top_p": gen["top_p"]}
    if gen["top_k"] > 0:
        out["top_k"] = gen["top_k"]
    if gen["seed"] is not None:
        out["seed"] = gen["seed"]
    if gen["thinking"] != "auto":
        out["enable_thinking"] = gen["thinking"] == "on"
    return out


def output_row(row: dict, messages: list[dict], text: str, *, finish_reason: str, prompt_tokens: int,
               completion_tokens: int, gen_model: str, sampling: dict, sample: int = 0) -> dict:
    """The row written for sample `sample` of the prompt `row`."""
    out = {k: v for k, v in row.items() if k not in ("conversations", "messages")}
    out.update(id=sample_id(row["id"], sample), prompt_id=row["id"], sample=sample,
               conversations=messages + [{"role": "assistant", "content": text}], response=text,
               finish_reason=finish_reason, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
               gen_model=gen_model, sampling=sampling)
    return out


# ---------------------------------------------------------------- several samples per prompt
class Job(NamedTuple):
    """One answer to make: sample `sample` of the prompt `row`, asking `messages`."""
    row: dict
    messages: list[dict]
    sample: int

    @property
    def id(self):
        return sample_id(self.row["id"], self.sample)


def sample_id(prompt_id, sample: int):
    """Row id of sample k of a prompt: the prompt's own id for k = 0, so files made before `generation.n`
    existed (one row per prompt) are still complete for n = 1; `<prompt id>#s<k>` after."""
    return prompt_id if sample == 0 else f"{prompt_id}#s{sample}"


def prompt_id_of(row: dict):
    """The prompt an output row answers (rows made before `prompt_id` existed: their id)."""
    return row.get("prompt_id", row.get("id"))


def stage2_settings(gen: dict) -> dict:
    """The generation settings of 05 (the QAD target's answers): `generation.n_stage2` answers per prompt where set,
    else `n` as in 02."""
    n2 = gen.get("n_stage2")
    if n2 is None:
        return gen
    if not isinstance(n2, int) or n2 < 1:
        raise ValueError(f"generation.n_stage2 must be a positive integer or null (= generation.n), got {n2!r}")
    return {**gen, "n": n2}


def samples_per_prompt(gen: dict) -> int:
    """`generation.n`, checked: n ≥ 1, and n > 1 only with sampling (greedy answers would be n copies)."""
    n = gen.get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"generation.n must be a positive integer, got {n!r}")
    if n > 1 and gen["temperature"] <= 0:
        raise ValueError(f"generation.n={n} with temperature {gen['temperature']} (greedy) would write {n} "
                         f"identical answers per prompt; set n: 1 or a temperature > 0")
    return n


def sample_seed(gen: dict, sample: int) -> int | None:
    """The seed sent for sample k: seed + k, so a fixed seed still gives n different answers."""
    return None if gen["seed"] is None else gen["seed"] + sample


# ---------------------------------------------------------------- resumable output files
def partial_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.stem + ".partial.jsonl")


def failures_path(out_path: Path) -> Path:
    return out_path.with_name(out_path.stem + ".failures.jsonl")


def open_for_resume(out_path: Path, prompts: list[tuple[dict, list[dict]]], sampling: dict,
                    gen_model: str, limit: int | None = None, n: int = 1) -> tuple[list[Job], "RowWriter"]:
    """The answers still to make (samples 0..n-1 of the first `limit` of `prompts`, prompt by prompt), and
    a writer appending to the partial file. A finished output of an earlier run becomes the partial file
    again (a rename: nothing copied, nothing lost).

    An earlier row counts as done only if it answered the same messages with the same sampling and
    model. Rows of prompts beyond `limit`, or of samples beyond `n`, that are done stay in the output (a
    lower limit or n only stops generating more). Other rows (prompts, sampling or model changed since; a
    repeated id) are not kept: the earlier file is first renamed `<out>.stale-<YYYYmmdd-HHMMSS>` and the
    changed settings are logged, so nothing generated is ever lost. A model retrained in place under the
    same path is not detected: move the output aside to regenerate it."""
    work = partial_path(out_path)
    if out_path.exists():
        if work.exists():
            raise FileExistsError(f"both {out_path} and {work} exist; keep the one you trust and delete the other")
        os.replace(out_path, work)
    done = set()
    if work.exists():
        _drop_torn_last_line(work)
        earlier = read_jsonl(work)
        kept, reasons = _still_valid(earlier, {row["id"]: msgs for row, msgs in prompts}, sampling, gen_model)
        if len(kept) < len(earlier):
            stale = stale_name(out_path)
            shutil.copy2(work, stale)
            write_jsonl(work, kept)
            log.warning("%s: %d of %d earlier rows are not kept (%s); all earlier rows are in %s",
                        out_path, len(earlier) - len(kept), len(earlier), "; ".join(reasons), stale)
        done = {r["id"] for r in kept}
    todo = [Job(row, msgs, k) for row, msgs in prompts[:limit] for k in range(n)
            if sample_id(row["id"], k) not in done]
    return todo, RowWriter(work)


def _answers(r: dict):
    """The prompt id an earlier row answers, or None when its id, prompt_id and sample disagree."""
    pid, k = prompt_id_of(r), r.get("sample", 0)
    if not isinstance(pid, (str, int)) or not isinstance(k, int) or k < 0 or r.get("id") != sample_id(pid, k):
        return None
    return pid


def _still_valid(earlier: list[dict], wanted: dict, sampling: dict, gen_model: str) -> tuple[list[dict], list[str]]:
    """The earlier rows that still answer a current prompt (`wanted`: prompt id -> messages) with the current
    settings (first row per id), and why the others are not kept, naming the settings that changed."""
    kept, seen = [], set()
    other_sampling, other_models = {}, {}
    gone = changed_messages = repeated = 0
    for r in earlier:
        rid, pid = r.get("id"), _answers(r)
        if pid is None or pid not in wanted:
            gone += 1
        elif rid in seen:
            repeated += 1
        elif (r.get("conversations") or [])[:-1] != wanted[pid]:
            changed_messages += 1
        elif r.get("sampling") != sampling:
            key = json.dumps(r.get("sampling"), sort_keys=True)
            other_sampling[key] = other_sampling.get(key, 0) + 1
        elif r.get("gen_model") != gen_model:
            other_models[str(r.get("gen_model"))] = other_models.get(str(r.get("gen_model")), 0) + 1
        else:
            kept.append(r)
            seen.add(rid)
    reasons = []
    for key, n in other_sampling.items():
        old = json.loads(key)
        what = describe_changes(old, sampling) if isinstance(old, dict) else f"sampling: {key} -> ..."
        reasons.append(f"{n} made with other sampling settings ({what})")
    for model, n in other_models.items():
        reasons.append(f"{n} made by another model (gen_model: {model} -> {gen_model})")
    if changed_messages:
        reasons.append(f"{changed_messages} answered prompts whose messages have changed since")
    if gone:
        reasons.append(f"{gone} answered ids that are not in the prompts file")
    if repeated:
        reasons.append(f"{repeated} repeated an id answered earlier in the file (the first answer is kept)")
    return kept, reasons


def _drop_torn_last_line(path: Path) -> None:
    """A killed writer can leave a last line without its newline: cut it (its request is redone)."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        log.warning("%s: dropping an unfinished last line (%d bytes) left by an interrupted run", path, len(data) - cut)
        with open(path, "r+b") as f:
            f.truncate(cut)


class RowWriter:
    """Append JSON rows, one flush per row: a killed run loses only the requests in flight."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.file = open(path, "a", encoding="utf-8")

    def write(self, row: dict) -> None:
        self.file.write(json.dumps(row, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def finish_output(out_path: Path) -> int:
    """Rename the partial file to the final name; returns the number of rows."""
    work = partial_path(out_path)
    if not work.exists():
        work.write_text("")
    os.replace(work, out_path)
    return sum(1 for line in open(out_path, encoding="utf-8") if line.strip())


@dataclass
class GenerationStats:
    rows: int = 0                 # rows in the finished output (earlier runs included)
    new_rows: int = 0             # rows written by this run
    already_done: int = 0         # (prompt, sample) pairs an earlier run answered
    failures: int = 0             # requests given up on (see the failures file)
    truncated: int = 0            # new rows that hit max_tokens (kept or dropped)
    dropped_truncated: int = 0    # truncated rows not saved (keep_truncated off)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    tokens_per_s: float = 0.0     # completion tokens of this run per wall second
    endpoint_errors: dict = field(default_factory=dict)   # base URL -> connection errors seen
    backend: str = ""
    engine: str = ""              # transformers backend: generate, static or continuous

    def as_dict(self) -> dict:
        return asdict(self)


class RowRecorder:
    """The one place an answer becomes an output row, for both backends: counts it in the stats, then writes it
    unless it is dropped (truncated with keep_truncated off) or empty (a failure: a re-run asks again)."""

    def __init__(self, stats: GenerationStats, writer: RowWriter, gen: dict, sampling: dict, gen_model: str):
        self.stats, self.writer, self.gen, self.sampling, self.gen_model = stats, writer, gen, sampling, gen_model

    def add(self, job: Job, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int) -> None:
        stats = self.stats
        stats.prompt_tokens += prompt_tokens
        stats.completion_tokens += completion_tokens
        if finish_reason == "length":
            stats.truncated += 1
            if not self.gen["keep_truncated"]:
                stats.dropped_truncated += 1
                return
        if not text:
            stats.failures += 1
            return
        self.writer.write(output_row(job.row, job.messages, text, finish_reason=finish_reason,
                                     prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                     gen_model=self.gen_model, sampling=self.sampling, sample=job.sample))
        stats.new_rows += 1
