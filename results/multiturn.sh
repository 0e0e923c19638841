#!/usr/bin/env bash
# Every command behind results/multiturn/ (issue 93: conversations over a compressed context). Records go to RECORDS
# (default results/multiturn/records, committed). Resumable: a cell whose record exists is skipped.
#   bash results/multiturn.sh [DATA_DIR] [RECORDS] [STAGE ...]
# Each board stage is one process of one thread; on a 2-core machine run two side by side, each on its own tasks
# (TASKS=...), then the rest:
#   TASKS=niah_single_1,niah_single_2 bash results/multiturn.sh ../shared/data results/multiturn/records board &
#   TASKS=qa_1 bash results/multiturn.sh ../shared/data results/multiturn/records board
#   bash results/multiturn.sh ../shared/data results/multiturn/records once pack tables
# Stages:
#   board  +experiment=kv_multiturn for SmolLM2-135M on TASKS, LIMIT documents (default 2): both histories, nested and
#          new_turn. The default tasks are three where its full cache scores in the shared-context leaderboard and
#          answers are short: niah_multivalue and niah_multiquery answers run to 128 tokens, 4 times the cost
#   once   the full cache and the oracle under turns.schedule=once (the context compressed for the first question,
#          never again), the board's lines
#   pack   the records packed into RECORDS/records.jsonl.gz (python -m h2o_eval.results pack), as committed
#   tables results/multiturn/turns.md and turns.pdf, paired_turns.md (the paired tests at each turn), PROVENANCE.md
set -euo pipefail
data=${1:-../shared/data}
out=${2:-results/multiturn/records}
shift $(( $# < 2 ? $# : 2 ))
stages=${*:-board once pack tables}
tasks=${TASKS:-niah_single_1,niah_single_2,qa_1}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
export SOURCE_DATE_EPOCH=0  # matplotlib's PDFs without a creation date: unchanged results, unchanged files
grid() {
    python -m h2o_eval.grid +experiment=kv_multiturn model=smollm2-135m task="$tasks" limit="${LIMIT:-2}" \
        data_dir="$data" results_dir="$out" wandb.mode=disabled threads=1 "$@"
}
board() { grid; }
once() { grid turns.schedule=once policy=full,oracle; }
pack() { python -m h2o_eval.results pack "$out"; }
tables() {
    python -m h2o_eval.plot "$out" --by turn --out results/multiturn
    python -m h2o_eval.plot "$out" --out results/multiturn --provenance
}
for stage in $stages; do "$stage"; done
