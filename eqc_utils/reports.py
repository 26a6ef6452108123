"""HTML reports for reviewers: each executed notebook rendered twice (code hidden, code shown) and
an index.html with one row per stage: status, duration, headline metrics, links."""
from __future__ import annotations

import html
import time
from pathlib import Path

from eqc_utils import io
from eqc_utils.paths import reports_root, stage_dir

STATUS_FILE = "status.json"


def render_notebook(executed: Path) -> tuple[Path, Path]:
    """`X.ipynb` -> `X.html` (inputs hidden) and `X.code.html` (inputs shown)."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(executed), as_version=4)
    hidden = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True)
    shown = HTMLExporter()
    out_hidden = executed.with_suffix(".html")
    out_shown = executed.with_suffix(".code.html")
    io.write_text(out_hidden, hidden.from_notebook_node(nb)[0])
    io.write_text(out_shown, shown.from_notebook_node(nb)[0])
    return out_hidden, out_shown


def _metrics_cell(metrics: dict) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return html.escape(str(v))
    return "<br>".join(f"{html.escape(k)}: <b>{fmt(v)}</b>" for k, v in metrics.items())


def write_index(profile: str, results) -> Path:
    """Merge this run's results into reports/<profile>/status.json and rewrite index.html."""
    from eqc_utils.stamps import stamp_path
    root = reports_root() / profile
    root.mkdir(parents=True, exist_ok=True)
    status_path = root / STATUS_FILE
    status = io.read_json(status_path) if status_path.exists() else {}
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    for r in results:
        entry = status.get(r.name, {})
        seconds = r.seconds
        if r.status == "skipped":  # the time of the run whose results are reused
            stamp = stamp_path(profile, r.name)
            seconds = io.read_json(stamp).get("seconds", 0.0) if stamp.exists() else 0.0
        entry.update({"status": r.status, "seconds": round(seconds, 1), "error": r.error, "when": now})
        status[r.name] = entry
    io.write_json(status_path, status)

    rows = []
    for name in sorted(status):
        entry = status[name]
        metrics_path = stage_dir(profile, name) / "metrics.json"
        metrics = io.read_json(metrics_path) if metrics_path.exists() else {}
        links = []
        for suffix, label in ((".html", "report"), (".code.html", "with code"), (".ipynb", "notebook")):
            if (root / f"{name}{suffix}").exists():
                links.append(f'<a href="{name}{suffix}">{label}</a>')
        error = f'<div class="err">{html.escape(entry["error"])}</div>' if entry.get("error") else ""
        rows.append(
            f'<tr class="{entry["status"]}"><td>{html.escape(name)}</td><td>{entry["status"]}{error}</td>'
            f'<td>{entry["seconds"]:.1f} s</td><td>{_metrics_cell(metrics)}</td><td>{" · ".join(links)}</td></tr>')
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>eqc — {html.escape(profile)} profile</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }} td, th {{ border: 1px solid #ccc; padding: .4em .8em; vertical-align: top; }}
tr.failed td:nth-child(2) {{ color: #b00; font-weight: bold; }} tr.skipped td:nth-child(2) {{ color: #666; }}
.err {{ font-weight: normal; font-size: .85em; max-width: 40em; }}
</style></head><body>
<h1>eqc — profile <code>{html.escape(profile)}</code></h1>
<p>Quantize the Target, Quantize the Drafter (arXiv 2607.04244). Updated {now}.</p>
<table><thead><tr><th>stage</th><th>status</th><th>time</th><th>headline metrics</th><th>links</th></tr></thead>
<tbody>
{chr(10).join(rows)}
</tbody></table></body></html>
"""
    index = root / "index.html"
    io.write_text(index, page)
    return index
