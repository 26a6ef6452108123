"""The notebook pipeline: a registry of stages, stamps that let unchanged stages be skipped, and
papermill execution. Depends on no ML code (a notebook imports that, the runner never does).

A stage's stamp hashes (1) the params sections it reads, (2) its notebook's source without outputs,
(3) the sources of the eqc_utils library, (4) the stamps of the stages it consumes. A stage is skipped
when its stamp matches the one saved by its last successful run and all its declared outputs exist.
The stamp is removed when a stage starts and written only when it succeeds, so an interrupted or
failed run never leaves a valid-looking stamp over half-rewritten artifacts.
"""
from __future__ import annotations

import hashlib
import json
import logging
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from eqc_utils import io
from eqc_utils.headline import describe_machine, write_headline
from eqc_utils.params import load_params, params_digest, profile_path
from eqc_utils.paths import NOTEBOOKS_DIR, PARAMS_DIR, REPO_ROOT, reports_root, runs_root
from eqc_utils.stamps import STAMP_FILE, read_stamp, remove_stamp, stamp_path

LIBRARY_DIR = Path(__file__).resolve().parent   # the eqc_utils package

# what each part of a stamp is called when a stage re-runs because it changed
STAMP_PARTS = {"params": "params", "notebook": "notebook", "library": "library (eqc_utils)", "files": "files"}


class SelectionError(ValueError):
    """--stage / --only / --from name an unknown notebook or select none at all."""


@dataclass(frozen=True)
class StageSpec:
    name: str                 # notebook stem, e.g. "03_qad_target"; also the artifact folder name
    paper_stage: int          # 1 data, 2 target, 3 drafter, 4 serving/eval
    sections: tuple           # params sections the stage reads
    outputs: tuple            # paths (inside its folder) that must exist for the stage to count as done
    upstream: tuple = ()      # stages whose artifacts it consumes
    description: str = ""
    files: tuple = ()         # repository files it reads besides params (globs from the repo root), e.g. serve configs

    @property
    def notebook(self) -> Path:
        return NOTEBOOKS_DIR / f"{self.name}.ipynb"

    @property
    def number(self) -> str:
        return self.name[:2]


REGISTRY: tuple[StageSpec, ...] = (
    StageSpec("01_prompts", 1, ("seed", "assets", "prompts"),
              ("prompts_stage1.jsonl", "prompts_stage2.jsonl"),
              description="stage-1 and stage-2 prompt sets (manifest rebuild / deterministic sampler)"),
    StageSpec("02_teacher_data", 1, ("seed", "device", "assets", "generation"), ("teacher.jsonl",), ("01_prompts",),
              description="stage-1 prompts answered by the teacher through vLLM (resumable)"),
    StageSpec("03_qad_target", 2, ("seed", "device", "assets", "quant", "qad", "pack"),
              ("qad_student/grid_amax.safetensors", "summary.json"), ("02_teacher_data",),
              description="INT4 init (PTQ), grid pinning, QAD against the teacher"),
    StageSpec("04_pack_target", 2, ("seed", "device", "quant", "pack"),
              ("target_ct/config.json", "target_dense/config.json", "serve_check.json"),
              ("01_prompts", "03_qad_target"),
              description="compressed-tensors W4A16 pack + dense twin, codes bit-exact, vLLM = twin"),
    StageSpec("05_qad_data", 2, ("seed", "device", "generation"),
              ("qad.jsonl",), ("01_prompts", "04_pack_target"),
              description="stage-2 prompts answered by the packed QAD target"),
    StageSpec("06_drafter_pretrain", 3, ("seed", "device", "assets", "drafter"),
              ("pretrain/drafter/config.json", "pretrain/tau.json"), ("02_teacher_data",),
              description="DFlash drafter trained against the teacher on teacher data; tau per checkpoint"),
    StageSpec("07_drafter_finetune", 3, ("seed", "device", "assets", "drafter"),
              ("finetune/drafter/config.json", "finetune/tau.json", "tau_summary.json"),
              ("04_pack_target", "05_qad_data", "06_drafter_pretrain"),
              description="warm-start finetune against the QAD twin on QAD data, direct ablation, vLLM dflash check"),
    StageSpec("08_drafter_quant", 3, ("seed", "device", "assets", "drafter", "pack", "drafter_quant"),
              ("drafter_w4/config.json", "tau.json", "window_sweep.json"),
              ("04_pack_target", "05_qad_data", "07_drafter_finetune"),
              description="GPTQ W4A16 drafter (vs RTN) with a sliding window, packed for vLLM; tau, window sweep"),
    StageSpec("09_eval", 4, ("seed", "device", "assets", "eval"),
              ("gates.json", "latency.json", "acceptance.json", "eval_summary.json"),
              ("04_pack_target", "08_drafter_quant"),
              description="served stack behind the proxy: quality gates, latency vs the target alone, acceptance",
              files=("configs/serve/*.yaml",)),
)


def registered() -> list[StageSpec]:
    """Stages whose notebook exists, in pipeline order."""
    return [s for s in REGISTRY if s.notebook.exists()]


def notebook_digest(path: Path) -> str:
    """Hash of cell types and sources only: executing a notebook or clearing outputs keeps it."""
    nb = json.loads(path.read_text())
    cells = [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
             for c in nb["cells"]]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()[:16]


def library_digest(root: Path | None = None) -> str:
    """Hash of every `*.py` under the eqc_utils package (relative path and content, in sorted order).

    Every stage's stamp includes the whole library rather than the modules a stage imports: the import
    graph of a notebook is not knowable statically (imports inside functions, `accelerate launch` and
    `python -m eqc_utils...` subprocesses, code reached through third-party callbacks), and a missed
    module means a stale result silently reused, while a library edit that re-runs a stage needlessly
    only costs time. Hashing the few dozen source files takes milliseconds.
    """
    root = LIBRARY_DIR if root is None else root
    files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts))
    digest = hashlib.sha256()
    for rel, path in files:
        digest.update(rel.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def files_digest(patterns: tuple) -> str:
    """Hash of the repository files matching `patterns` (path and content, sorted)."""
    digest = hashlib.sha256()
    for path in sorted({p for pattern in patterns for p in REPO_ROOT.glob(pattern) if p.is_file()}):
        digest.update(path.relative_to(REPO_ROOT).as_posix().encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def compute_stamp(spec: StageSpec, params: dict, profile: str, library: str | None = None) -> dict:
    """The stamp of a stage's inputs as they are now; `library` is a library_digest() already taken."""
    upstream = {}
    for name in spec.upstream:
        saved = read_stamp(profile, name)
        upstream[name] = saved["stamp"] if saved else "missing"
    parts = {
        "params": params_digest(params, list(spec.sections)),
        "notebook": notebook_digest(spec.notebook),
        "library": library or library_digest(),
        "upstream": upstream,
    }
    if spec.files:
        parts["files"] = files_digest(spec.files)
    stamp = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return {"stamp": stamp, **parts}


def why_run(spec: StageSpec, params: dict, profile: str, force: bool, library: str | None = None) -> str | None:
    """None when the stage can be skipped, else the reason it must run."""
    if force:
        return "--force"
    saved = read_stamp(profile, spec.name)
    if saved is None:
        return "never ran"
    now = compute_stamp(spec, params, profile, library)
    if saved["stamp"] != now["stamp"]:
        changed = [label for k, label in STAMP_PARTS.items() if saved.get(k) != now.get(k)]
        changed += [f"upstream {n}" for n, s in now["upstream"].items() if saved.get("upstream", {}).get(n) != s]
        return "changed: " + ", ".join(changed or ["stamp"])
    missing = [o for o in spec.outputs if not (runs_root() / profile / spec.name / o).exists()]
    if missing:
        return "missing outputs: " + ", ".join(missing)
    return None


def _stage_number(text: str, option: str, known: dict[str, StageSpec]) -> str:
    """'3', '03' or '03_qad_target' -> '03'; anything else (e.g. '012') is an error."""
    text = str(text).strip()
    if text.isdigit() and len(text) <= 2 and text.zfill(2) in known:
        return text.zfill(2)
    if text[:2] in known and known[text[:2]].name == text:
        return text[:2]
    listing = ", ".join(f"{n} ({s.name})" for n, s in sorted(known.items()))
    raise SelectionError(f"{option} {text!r}: unknown stage; known: {listing}")


def select(stages: list[StageSpec], *, paper_stage: int | None = None, only: list[str] | None = None,
           start: str | None = None, end: str | None = None) -> list[StageSpec]:
    """The stages chosen by --stage, --only, --from and --to (combined: all must hold). A choice that names an
    unknown notebook, an --only notebook that another option excludes, or an empty selection is an error."""
    known = {s.number: s for s in stages}
    wanted = [_stage_number(o, "--only", known) for o in only or []]
    first = _stage_number(start, "--from", known) if start is not None else None
    last = _stage_number(end, "--to", known) if end is not None else None
    if first is not None and last is not None and last < first:
        raise SelectionError(f"--to {last} conflicts with --from {first}: notebook {last} comes before {first}")
    chosen = stages
    if paper_stage is not None:
        chosen = [s for s in chosen if s.paper_stage == paper_stage]
        if not chosen:
            raise SelectionError(f"--stage {paper_stage}: no notebooks of that paper stage exist yet")
        in_stage = ", ".join(s.number for s in chosen)
        for number in wanted:
            if number not in {s.number for s in chosen}:
                raise SelectionError(f"--only {number} conflicts with --stage {paper_stage}: notebook {number} is "
                                     f"not part of paper stage {paper_stage} (notebooks {in_stage})")
        if first is not None and all(s.number < first for s in chosen):
            raise SelectionError(f"--from {first} conflicts with --stage {paper_stage}: paper stage {paper_stage} "
                                 f"ends before notebook {first} (notebooks {in_stage})")
    if first is not None:
        for number in wanted:
            if number < first:
                raise SelectionError(f"--only {number} conflicts with --from {first}: notebook {number} comes "
                                     f"before {first}")
        chosen = [s for s in chosen if s.number >= first]
    if last is not None:
        for number in wanted:
            if number > last:
                raise SelectionError(f"--only {number} conflicts with --to {last}: notebook {number} comes "
                                     f"after {last}")
        if paper_stage is not None and all(s.number > last for s in chosen):
            raise SelectionError(f"--to {last} conflicts with --stage {paper_stage}: paper stage {paper_stage} "
                                 f"starts after notebook {last}")
        chosen = [s for s in chosen if s.number <= last]
    if wanted:
        chosen = [s for s in chosen if s.number in set(wanted)]
    if not chosen:
        raise SelectionError("no notebook selected")
    return chosen


@dataclass
class StageResult:
    name: str
    status: str               # ran / skipped / failed
    seconds: float = 0.0
    reason: str = ""
    error: str = ""
    metrics: dict = field(default_factory=dict)


class KernelNoiseFilter(logging.Filter):
    """Drops two messages the notebook kernel (ipykernel) logs to the terminal on every run, which say
    nothing about the notebook: the warning that its local TCP sockets are not encrypted (papermill
    starts kernels that way; the sockets are bound to localhost and messages are signed), and the
    "KeyboardInterrupt caught in kernel" that jupyter_client's shutdown provokes by interrupting the
    kernel before asking it to stop. Every other kernel message still gets through."""

    NOISE = ("Kernel is running over TCP without encryption", "KeyboardInterrupt caught in kernel")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else str(record.msg)
        return not message.startswith(self.NOISE)


def kernel_config(folder: Path) -> Path:
    """An IPython config file for the notebook kernel that attaches KernelNoiseFilter to its console log
    (the kernel is a separate process whose log goes straight to this terminal)."""
    path = folder / "eqc_kernel_config.json"
    config = {"IPKernelApp": {"logging_config": {
        "filters": {"eqc_kernel_noise": {"()": f"{KernelNoiseFilter.__module__}.{KernelNoiseFilter.__name__}"}},
        "handlers": {"console": {"filters": ["eqc_kernel_noise"]}},
    }}}
    path.write_text(json.dumps(config))
    return path


def execute(spec: StageSpec, profile_arg: str, overrides: list[str], params: dict,
            log=print, library: str | None = None) -> StageResult:
    """Run one notebook with papermill (kernel python3, cwd = repo root), render its reports.

    The stamp is taken of the inputs as they are when the notebook starts, the old one is removed
    before the notebook writes anything, and the new one is written only when the notebook succeeds."""
    import papermill as pm
    from eqc_utils import reports

    profile = params["profile"]
    stamp = compute_stamp(spec, params, profile, library)
    remove_stamp(profile, spec.name)
    out_nb = reports_root() / profile / f"{spec.name}.ipynb"
    out_nb.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    error = ""
    try:
        with tempfile.TemporaryDirectory(prefix="eqc-kernel-") as tmp:
            pm.execute_notebook(
                str(spec.notebook), str(out_nb), kernel_name="python3", cwd=str(REPO_ROOT),
                parameters={"profile": profile_arg, "overrides": overrides}, progress_bar=False,
                log_output=False, extra_arguments=[f"--IPKernelApp.extra_config_file={kernel_config(Path(tmp))}"])
    except pm.PapermillExecutionError as err:
        error = f"{spec.notebook.name}: cell {err.exec_count} failed: {err.ename}: {err.evalue}"
    except Exception as err:  # kernel died, notebook unreadable, ...
        error = f"{spec.notebook.name}: {type(err).__name__}: {err}"
    seconds = time.time() - started
    if out_nb.exists():
        try:
            reports.render_notebook(out_nb)
        except Exception as err:  # a missing nbconvert template must not cost the stage's results
            log(f"[{spec.name}] warning: HTML report not rendered: {type(err).__name__}: {err}")
    if error:
        return StageResult(spec.name, "failed", seconds, error=error)
    io.write_json(stamp_path(profile, spec.name), {**stamp, "seconds": round(seconds, 1),
                                                   "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
                                                   "machine": describe_machine()})
    return StageResult(spec.name, "ran", seconds)


def _notebook_profile_arg(profile_arg: str) -> str:
    """What the notebooks get as `profile`: a profile name as given, a YAML file as an absolute path
    (the notebooks run with the repository root as their working folder)."""
    path = profile_path(profile_arg)
    return profile_arg if path == PARAMS_DIR / f"{profile_arg}.yaml" else str(path.resolve())


def _write_summaries(profile: str, results: list[StageResult]):
    """The report index and figures/<profile>/headline.json as the results stand now."""
    from eqc_utils import reports
    index = reports.write_index(profile, results)
    return index, write_headline(profile, [spec.name for spec in registered()], stamp_file=STAMP_FILE)


def run_pipeline(profile_arg: str = "tiny", overrides: list[str] | None = None, *, paper_stage=None,
                 only=None, start=None, end=None, force=False, dry_run=False, log=print) -> list[StageResult]:
    """Run the selected stages in order, skipping those whose stamp is current. Raises ParamsError
    (bad profile or override) or SelectionError (bad --stage/--only/--from/--to) before any notebook runs.
    The report index and the headline are refreshed after every stage that ran, so a run cut off later
    (a node taken back, Ctrl-C) keeps the headline numbers of the stages it finished."""
    overrides = list(overrides or [])
    params = load_params(profile_arg, overrides)  # fail fast on a bad profile, before any notebook
    profile = params["profile"]
    notebook_profile = _notebook_profile_arg(profile_arg)
    stages = select(registered(), paper_stage=paper_stage, only=only, start=start, end=end)
    library = library_digest()  # once per run: every stage is stamped with the library it started with
    results: list[StageResult] = []
    will_run: set[str] = set()
    for spec in stages:
        reason = why_run(spec, params, profile, force, library)
        if reason is None and will_run & set(spec.upstream):
            reason = "upstream " + ", ".join(sorted(will_run & set(spec.upstream))) + " runs first"
        if reason is not None:
            will_run.add(spec.name)
        if dry_run:
            log(f"[{spec.name}] {'would run: ' + reason if reason else 'would skip: up to date'}")
            continue
        if reason is None:
            log(f"[{spec.name}] skipped (up to date)")
            results.append(StageResult(spec.name, "skipped", reason="up to date"))
            continue
        log(f"[{spec.name}] running ({reason}) ...")
        result = execute(spec, notebook_profile, overrides, params, log, library)
        results.append(result)
        if result.status == "failed":
            log(f"[{spec.name}] FAILED after {result.seconds:.1f}s: {result.error}")
            break
        log(f"[{spec.name}] ran in {result.seconds:.1f}s")
        _write_summaries(profile, results)
    if not dry_run:
        index, headline = _write_summaries(profile, results)
        log(f"report: {index}\nheadline numbers: {headline}")
    return results
