#!/usr/bin/env python
"""Run the eqc notebooks in order with papermill (see README). Examples:

    python run_all.py                      # whole pipeline, tiny profile
    python run_all.py --profile paper --stage 3
    python run_all.py --only 03 -p qad.lr=1e-5
    python run_all.py --profile small --to 07   # 01 -> 07: data, target, drafter
    python run_all.py --dry-run            # what would run, and why
"""
import argparse
import sys

from eqc_utils.params import ParamsError
from eqc_utils.pipeline import REGISTRY, SelectionError, registered, run_pipeline


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="tiny",
                    help="a profile name (params/<profile>.yaml) or a path to a YAML file whose `profile` "
                         "key matches its file name")
    ap.add_argument("--stage", type=int, choices=(1, 2, 3, 4), help="run the notebooks of one paper stage")
    ap.add_argument("--only", action="append", metavar="NN",
                    help="run only notebook NN, e.g. 03 or 03_qad_target (repeatable)")
    ap.add_argument("--from", dest="start", metavar="NN", help="run notebook NN and everything after it")
    ap.add_argument("--to", dest="end", metavar="NN", help="stop after notebook NN, e.g. --to 07 for 01 -> 07")
    ap.add_argument("--force", action="store_true", help="run even when the cached outputs are up to date")
    ap.add_argument("--dry-run", action="store_true", help="say what would run and why, run nothing")
    ap.add_argument("--list", action="store_true", help="list the stages")
    ap.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                    help="override a parameter, e.g. -p qad.lr=1e-5 (any key but `profile`)")
    args = ap.parse_args(argv)

    if args.list:
        present = {s.name for s in registered()}
        for s in REGISTRY:
            mark = "" if s.name in present else "  (notebook missing)"
            print(f"{s.number}  paper stage {s.paper_stage}  {s.name:24s} {s.description}{mark}")
        return 0
    try:
        results = run_pipeline(args.profile, args.param, paper_stage=args.stage, only=args.only,
                               start=args.start, end=args.end, force=args.force, dry_run=args.dry_run)
    except (ParamsError, SelectionError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
