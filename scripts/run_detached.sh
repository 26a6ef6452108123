#!/usr/bin/env bash
# Run pipeline stages in the background, detached from the terminal (it survives a dropped SSH session or the end
# of an interactive batch allocation's shell), with a progress log and a small results archive (no weights).
#
#   bash scripts/run_detached.sh start [-p PROFILE] [STAGE ...]   # e.g. start -p small 02 03; no stages = all
#   bash scripts/run_detached.sh wait [SECONDS] [DIR]             # show progress until done (or SECONDS passed),
#                                                                   # then write DIR/results.tar.gz (default: runs/)
# On an air-gapped node source scripts/offline_env.sh first. Figures go to runs/_figures/<profile> (set
# EQC_FIGURES_DIR to change), so that a tracked figures/ folder is never overwritten by a partial run.
set -u
cd "$(dirname "$0")/.."
LOGS=runs/_detached
mkdir -p "$LOGS"
export EQC_FIGURES_DIR=${EQC_FIGURES_DIR:-$PWD/runs/_figures}
profile=$(cat "$LOGS/profile" 2>/dev/null || echo tiny)

stage() {  # one stage, with its run_all output in its own log
  python3 run_all.py --profile "$profile" --only "$1" > "$LOGS/stage_$1.log" 2>&1
  local rc=$?
  echo "$(date +%T) stage $1 exit $rc" >> "$LOGS/progress.log"
  return $rc
}

pipeline() {
  echo "$(date +%T) start profile $profile: ${*:-all stages} ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))" >> "$LOGS/progress.log"
  local stages=("$@")
  (( ${#stages[@]} )) || mapfile -t stages < <(python3 run_all.py --list | awk '/^[0-9][0-9] /{print $1}')
  for s in "${stages[@]}"; do stage "$s" || return 1; done
}

show_progress() {
  echo "== progress"; cat "$LOGS/progress.log" 2>/dev/null
  for f in runs/"$profile"/03_qad_target/train_log.jsonl runs/"$profile"/03_qad_target/eval_log.jsonl; do
    [ -f "$f" ] && { echo "== $f"; tail -n 2 "$f"; }
  done
  for f in runs/"$profile"/0[67]_drafter_*/*/history.jsonl; do
    [ -f "$f" ] && { echo "== $f"; tail -n 1 "$f"; }
  done
  for f in "$LOGS"/stage_*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 3 "$f"; }; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null
}

collect() {  # metrics, logs, figures and reports; weights, partial files and data files over 4 MB stay behind
  local dest=$1 list
  mkdir -p "$dest"
  list=$(mktemp)
  find runs/"$profile" runs/_figures "$LOGS" reports/"$profile" -type f \( -name '*.json' -o -name '*.jsonl' \
    -o -name '*.png' -o -name '*.yaml' -o -name '*.log' -o -name '*.html' -o -name '*.ipynb' \) \
    ! -path '*/checkpoints/*' ! -name '*.partial' -size -4M 2>/dev/null > "$list"
  tar czf "$dest/results.tar.gz" -T "$list"
  rm -f "$list"
  ls -la "$dest/results.tar.gz"
}

case "${1:-}" in
  start)
    shift
    if [[ "${1:-}" == "-p" ]]; then profile=$2; shift 2; fi
    echo "$profile" > "$LOGS/profile"
    setsid nohup bash "$0" pipeline "$@" > "$LOGS/pipeline.log" 2>&1 < /dev/null &
    echo "started (pid $!), profile $profile";;
  pipeline)
    shift; pipeline "$@"; echo "$(date +%T) DONE exit $?" >> "$LOGS/progress.log";;
  wait)
    end=$(( $(date +%s) + ${2:-540} ))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -q DONE "$LOGS/progress.log" 2>/dev/null; do sleep 10; done
    show_progress; collect "${3:-runs}";;
  *) echo "usage: $0 start [-p PROFILE] [STAGE ...] | wait [SECONDS] [DIR]"; exit 2;;
esac
