"""The notebook pipeline: a registry of stages, stamps that let unchanged stages be skipped, and
papermill execution. Depends on no ML code (a notebook imports that, the runner never does).

A stage's stamp hashes (1) the params sections it reads, (2) its notebook's source without outputs,
(3) the stamps of the stages it consumes. A stage is skipped when its stamp matches the one saved by
its last successful run and all its declared outputs exist.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from eqc_utils import io
from eqc_utils.params import load_params, params_digest
from eqc_utils.paths import NOTEBOOKS_DIR, REPO_ROOT, reports_root, stage_dir

STAMP_FILE = ".stamp.json"


@dataclass(frozen=True)
class StageSpec:
    name: str                 # notebook stem, e.g. "03_qad_target"; also the artifact folder name
    paper_stage: int          # 1 data, 2 target, 3 drafter, 4 serving/eval
    sections: tuple           # params sections the stage reads
    outputs: tuple            # paths (inside its folder) that must exist for the stage to count as done
    upstream: tuple = ()      # stages whose artifacts it consumes
    description: str = ""

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


def read_stamp(profile: str, stage: str) -> dict | None:
    path = stage_dir(profile, stage) / STAMP_FILE
    return io.read_json(path) if path.exists() else None


def compute_stamp(spec: StageSpec, params: dict, profile: str) -> dict:
    upstream = {}
    for name in spec.upstream:
        saved = read_stamp(profile, name)
        upstream[name] = saved["stamp"] if saved else "missing"
    parts = {
        "params": params_digest(params, list(spec.sections)),
        "notebook": notebook_digest(spec.notebook),
        "upstream": upstream,
    }
    stamp = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return {"stamp": stamp, **parts}


def why_run(spec: StageSpec, params: dict, profile: str, force: bool) -> str | None:
    """None when the stage can be skipped, else the reason it must run."""
    if force:
        return "--force"
    saved = read_stamp(profile, spec.name)
    if saved is None:
        return "never ran"
    now = compute_stamp(spec, params, profile)
    if saved["stamp"] != now["stamp"]:
        changed = [k for k in ("params", "notebook") if saved.get(k) != now[k]]
        changed += [f"upstream {n}" for n, s in now["upstream"].items() if saved.get("upstream", {}).get(n) != s]
        return "changed: " + ", ".join(changed or ["stamp"])
    missing = [o for o in spec.outputs if not (stage_dir(profile, spec.name) / o).exists()]
    if missing:
        return "missing outputs: " + ", ".join(missing)
    return None


def select(stages: list[StageSpec], *, paper_stage: int | None = None, only: list[str] | None = None,
           start: str | None = None) -> list[StageSpec]:
    known = {s.number: s for s in stages}
    for number in (only or []) + ([start] if start else []):
        if number.zfill(2)[:2] not in known:
            raise SystemExit(f"unknown notebook '{number}'; known: {', '.join(sorted(known))}")
    chosen = stages
    if paper_stage is not None:
        chosen = [s for s in chosen if s.paper_stage == paper_stage]
        if not chosen:
            raise SystemExit(f"--stage {paper_stage}: no notebooks of that paper stage exist yet")
    if only:
        wanted = {o.zfill(2)[:2] for o in only}
        chosen = [s for s in chosen if s.number in wanted]
    if start:
        chosen = [s for s in chosen if s.number >= start.zfill(2)[:2]]
    return chosen


@dataclass
class StageResult:
    name: str
    status: str               # ran / skipped / failed
    seconds: float = 0.0
    reason: str = ""
    error: str = ""
    metrics: dict = field(default_factory=dict)


def execute(spec: StageSpec, profile_arg: str, overrides: list[str], params: dict,
            log=print) -> StageResult:
    """Run one notebook with papermill (kernel python3, cwd = repo root), render its reports."""
    import papermill as pm
    from eqc_utils import reports

    profile = params["profile"]
    out_nb = reports_root() / profile / f"{spec.name}.ipynb"
    out_nb.parent.mkdir(parents=True, exist_ok=True)
    started = time.time()
    error = ""
    try:
        pm.execute_notebook(
            str(spec.notebook), str(out_nb), kernel_name="python3", cwd=str(REPO_ROOT),
            parameters={"profile": profile_arg, "overrides": overrides}, progress_bar=False,
            log_output=False)
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
    stamp = compute_stamp(spec, params, profile)
    io.write_json(stage_dir(profile, spec.name) / STAMP_FILE, {**stamp, "seconds": round(seconds, 1),
                                                              "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
    return StageResult(spec.name, "ran", seconds)


def run_pipeline(profile_arg: str = "tiny", overrides: list[str] | None = None, *, paper_stage=None,
                 only=None, start=None, force=False, dry_run=False, log=print) -> list[StageResult]:
    from eqc_utils import reports

    overrides = list(overrides or [])
    params = load_params(profile_arg, overrides)  # fail fast on a bad profile, before any notebook
    profile = params["profile"]
    stages = select(registered(), paper_stage=paper_stage, only=only, start=start)
    results: list[StageResult] = []
    will_run: set[str] = set()
    for spec in stages:
        reason = why_run(spec, params, profile, force)
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
        result = execute(spec, profile_arg, overrides, params, log)
        results.append(result)
        if result.status == "failed":
            log(f"[{spec.name}] FAILED after {result.seconds:.1f}s: {result.error}")
            break
        log(f"[{spec.name}] ran in {result.seconds:.1f}s")
    if not dry_run:
        index = reports.write_index(profile, results)
        log(f"report: {index}")
    return results
