#!/usr/bin/env bash
# The `small` profile end to end on the lendable H200 (no internet, no vLLM there), in the background so that it
# outlives any one device call (each is limited to 10 minutes; a process in its own session runs on while the
# machine stays held). Every call sources benchmarks/gpu_env.sh first (wheels in .whl/, teacher GGUF pieces).
#
#   bash benchmarks/run_small_gpu.sh start          # 02, then 03 -> 04 -> 05 beside 06, then 07 and the decode bench
#   bash benchmarks/run_small_gpu.sh start 02 03    # only these stages, in this order (e.g. the QAD claim alone)
#   bash benchmarks/run_small_gpu.sh wait 540       # print progress until done or 540 s passed, then collect to $OUT
#
# Stage 01 runs on a CPU machine (its local prompt sources come from data wheels) and travels as runs/small/01_prompts.
set -u
cd "$(dirname "$0")/.."
LOGS=runs/small/_gpu
mkdir -p "$LOGS"
# figures/small is tracked: each device call re-syncs the working tree and would delete figures made there
# between calls, so this run writes them under runs/ (ignored, kept between calls) and collect() returns them
export EQC_FIGURES_DIR=$PWD/runs/_figures

stage() {  # one stage, its run_all output in its own log
  python3 run_all.py --profile small --only "$1" > "$LOGS/stage_$1.log" 2>&1
  local rc=$?
  echo "$(date +%T) stage $1 exit $rc" >> "$LOGS/progress.log"
  return $rc
}

pipeline() {
  echo "$(date +%T) start $(nvidia-smi --query-gpu=name --format=csv,noheader) ${*:-all stages}" >> "$LOGS/progress.log"
  if [ $# -gt 0 ]; then
    for s in "$@"; do stage "$s" || return 1; done
    return 0
  fi
  stage 02 || return 1
  # the target chain and the pre-training of the drafter (which needs only the teacher and 02) share the GPU
  (stage 03 && stage 04 && stage 05) &
  local target_chain=$!
  stage 06
  wait $target_chain || return 1
  stage 07 || return 1
  python3 benchmarks/bench_drafter.py --mode decode --target runs/small/04_pack_target/target_dense \
    --drafter runs/small/07_drafter_finetune/finetune/drafter --data runs/small/05_qad_data/qad.jsonl \
    --prompts 32 --new-tokens 128 > "$LOGS/bench_decode.txt" 2>&1
  echo "$(date +%T) bench exit $?" >> "$LOGS/progress.log"
}

show_progress() {
  echo "== progress"; cat "$LOGS/progress.log" 2>/dev/null
  for f in runs/small/03_qad_target/train_log.jsonl runs/small/03_qad_target/eval_log.jsonl; do
    [ -f "$f" ] && { echo "== $f"; tail -n 2 "$f"; }
  done
  for f in runs/small/0[67]_drafter_*/*/history.json; do
    [ -f "$f" ] && { echo "== $f"; python3 -c "import json, sys; print((json.load(open(sys.argv[1])) or ['empty'])[-1])" "$f"; }
  done
  for f in "$LOGS"/stage_*.log; do [ -f "$f" ] && { echo "== $f"; tail -n 3 "$f"; }; done
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
}

collect() {  # the small files (no weights) in one archive, under the 16 MiB limit on each file brought back
  local out=$1
  tar czf "$out/small_results.tar.gz" --exclude='*.safetensors' --exclude='*.pt' --exclude='*.jsonl.partial' \
    runs/small/*/*.json runs/small/*/*/*.json \
    runs/small/*/*.png runs/small/03_qad_target/*.jsonl runs/small/0[25]_*/*.jsonl runs/small/*/params.resolved.yaml \
    runs/_figures "$LOGS" reports/small 2>/dev/null
  ls -la "$out"
}

case "${1:-}" in
  start)
    . benchmarks/gpu_env.sh
    [ -f "$gguf" ] || { echo "teacher GGUF missing: carry .carry/p1 and .carry/p2 first"; exit 1; }   # $gguf: gpu_env.sh
    shift
    setsid nohup bash "$0" pipeline "$@" > "$LOGS/pipeline.log" 2>&1 < /dev/null &
    echo "started (pid $!)";;
  pipeline)
    shift; pipeline "$@"; echo "$(date +%T) DONE" >> "$LOGS/progress.log";;
  wait)
    end=$(( $(date +%s) + ${2:-540} ))
    while [ "$(date +%s)" -lt "$end" ] && ! grep -q DONE "$LOGS/progress.log" 2>/dev/null; do sleep 10; done
    show_progress; collect "${OUT:-/tmp}";;
  *) echo "usage: $0 start [STAGE ...] | wait SECONDS"; exit 2;;
esac
