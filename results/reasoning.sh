#!/usr/bin/env bash
# Every command behind results/reasoning/ (issue 71: reasoning under decode-time eviction). Records go to RECORDS
# (default results/reasoning/records, committed). Resumable: a cell whose record exists is skipped.
#   bash results/reasoning.sh [DATA_DIR] [RECORDS] [STAGE ...]
# Each board stage is one process of one thread; on a 2-core machine run two side by side (TASK=math500 or gsm8k runs
# one task of a stage), then tables:
#   TASK=math500 bash results/reasoning.sh ../shared/data results/reasoning/records gemma &
#   TASK=gsm8k bash results/reasoning.sh ../shared/data results/reasoning/records gemma
#   bash results/reasoning.sh ../shared/data results/reasoning/records pack tables
# Stages:
#   smollm2   +experiment=reasoning for SmolLM2-135M: MATH-500 and GSM8K, LIMIT problems (default the preset's)
#   gemma     the same for Gemma 3 270M
#   pack      the records packed into RECORDS/records.jsonl.gz (python -m h2o_eval.results pack), as committed
#   tables    results/reasoning/board.md (the budget in tokens as rows, a column per policy: agreement, the kept trace,
#             accuracy, the generated length, each class's share, the evicting share); results/reasoning/<metric>/:
#             the scores with signal against the budget, with paired tests against the full cache (the others:
#             plot --metric NAME); PROVENANCE.md from the records
set -euo pipefail
data=${1:-../shared/data}
out=${2:-results/reasoning/records}
shift $(( $# < 2 ? $# : 2 ))
stages=${*:-smollm2 gemma pack tables}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
export SOURCE_DATE_EPOCH=0  # matplotlib's PDFs without a creation date: unchanged results, unchanged files
board() {
    python -m h2o_eval.grid +experiment=reasoning model="$1" ${LIMIT:+limit=$LIMIT} ${TASK:+task=$TASK} data_dir="$data" \
        results_dir="$out" wandb.mode=disabled threads=1
}
smollm2() { board smollm2-135m; }
gemma() { board gemma3-270m; }
pack() { python -m h2o_eval.results pack "$out"; }
tables() {
    python -m h2o_eval.plot "$out" --board --out results/reasoning
    for metric in agreement same_trace first_departure generated_tokens loop; do
        python -m h2o_eval.plot "$out" --metric "$metric" --out "results/reasoning/$metric" --at 64 128 256
    done
    python -m h2o_eval.plot "$out" --out results/reasoning --provenance
}
for stage in $stages; do "$stage"; done
