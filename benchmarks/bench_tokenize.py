#!/usr/bin/env python
"""Rows per second of turning generated conversations into drafter training examples (what 06 and 07 do before
their first step, and 03 before packing): one conversation at a time (`conversation.render_with_answer` per row)
against the bulk path (`drafter.data.build_examples`: every prompt of a chunk in one tokenizer call, every answer in
another), side by side in one process on the same rows, with a check that both give the same token ids.

    # after a tiny run (2-core VM):
    python benchmarks/bench_tokenize.py --data runs/tiny/02_teacher_data/teacher.jsonl --rows 4000
    # on a GPU node after small's 02:
    python benchmarks/bench_tokenize.py --profile small --data runs/small/02_teacher_data/teacher.jsonl --rows 33000

Rows are repeated to reach --rows when the file has fewer. Medians of --repeats passes. Writes
benchmarks/results/tokenize_<cores>cores.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_generation import machine  # noqa: E402
from eqc_utils import assets, io  # noqa: E402
from eqc_utils.conversation import render_with_answer, training_messages  # noqa: E402
from eqc_utils.drafter.data import build_examples  # noqa: E402
from eqc_utils.params import load_params  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def one_at_a_time(rows: list[dict], tokenizer, max_length: int) -> list[list[int]]:
    return [render_with_answer(tokenizer, training_messages(row, "bench"))[0][:max_length] for row in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny", help="whose tokenizer and drafter.max_length (default tiny)")
    ap.add_argument("--data", required=True, help="a teacher or QAD data JSONL (02's teacher.jsonl, 05's qad.jsonl)")
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/tokenize_<cores>cores.json)")
    args = ap.parse_args(argv)

    P = load_params(args.profile)
    tokenizer = assets.load_tokenizer(P["assets"]["tokenizer"], P["assets"]["teacher"], P["assets"]["hub_allowed"])
    source = io.read_jsonl(args.data)
    if not source:
        raise SystemExit(f"bench_tokenize: {args.data} has no rows")
    rows = (source * (args.rows // len(source) + 1))[:args.rows]
    max_length = P["drafter"]["max_length"]

    timings: dict[str, list[float]] = {"one_at_a_time": [], "bulk": []}
    for _ in range(args.repeats):
        start = time.perf_counter()
        single = one_at_a_time(rows, tokenizer, max_length)
        timings["one_at_a_time"].append(time.perf_counter() - start)
        start = time.perf_counter()
        bulk = build_examples(rows, tokenizer, max_length, min_loss_tokens=0, where="bench")
        timings["bulk"].append(time.perf_counter() - start)
    same = [e.input_ids for e in bulk] == single

    info = machine()
    seconds = {k: statistics.median(v) for k, v in timings.items()}
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "machine": info, "tokenizer": Path(str(getattr(tokenizer, "name_or_path", "?"))).name, "rows": len(rows),
              "source_rows": len(source), "tokens": sum(len(ids) for ids in single), "repeats": args.repeats,
              "seconds": seconds, "all_seconds": timings,
              "rows_per_s": {k: len(rows) / v for k, v in seconds.items()},
              "speedup": seconds["one_at_a_time"] / seconds["bulk"], "same_ids": same}
    print(f"{len(rows)} rows, {result['tokens']} tokens, {info['cores']} cores: one at a time "
          f"{result['rows_per_s']['one_at_a_time']:.0f} rows/s, bulk {result['rows_per_s']['bulk']:.0f} rows/s "
          f"({result['speedup']:.2f}x, medians of {args.repeats}); same token ids: {same}")
    out = Path(args.out) if args.out else RESULTS_DIR / f"tokenize_{info['cores']}cores.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
