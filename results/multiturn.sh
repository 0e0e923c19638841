#!/usr/bin/env bash
# Every command behind results/multiturn/ (issue 93: conversations over a compressed context). Records go to RECORDS
# (default results/multiturn/records, committed). Resumable: a cell whose record exists is skipped.
#   bash results/multiturn.sh [DATA_DIR] [RECORDS] [STAGE ...]
# The board stage takes its groups of cells one at a time, and a second process of the same stage takes the groups
# the first has not (a group is locked while computed): on a 2-core machine run two side by side, then the rest:
#   bash results/multiturn.sh ../shared/data results/multiturn/records board &
#   bash results/multiturn.sh ../shared/data results/multiturn/records board
#   bash results/multiturn.sh ../shared/data results/multiturn/records once pack tables
# Stages:
#   board  +experiment=kv_multiturn for SmolLM2-135M on TASKS (default the four where its full cache scores most in
#          the shared-context leaderboard), LIMIT documents (default 2): both histories, nested and new_turn
#   once   the full cache and the oracle under turns.schedule=once (the context compressed for the first question,
#          never again), the board's lines
#   pack   the records packed into RECORDS/records.jsonl.gz (python -m h2o_eval.results pack), as committed
#   tables results/multiturn/turns.md and turns.png, the paired tests at each turn, PROVENANCE.md from the records
set -euo pipefail
data=${1:-../shared/data}
out=${2:-results/multiturn/records}
shift $(( $# < 2 ? $# : 2 ))
stages=${*:-board once pack tables}
tasks=${TASKS:-niah_single_1,niah_single_2,niah_multivalue,niah_multiquery}
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
