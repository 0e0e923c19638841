#!/usr/bin/env bash
# The replication on SmolLM2-135M with the local data: every command behind results/replication/ (see results/README.md).
# Resumable: a setting whose record exists is skipped, so run it again after any interruption.
#   bash results/replicate.sh [DATA_DIR] [RUNS_DIR]
set -euo pipefail
data=${1:-../shared/data}
runs=${2:-results/runs}
# Two runners side by side, one core each: on 2 cores, two processes of 2 threads each thrash (5x slower).
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
sweep() { python -m h2o_eval --multirun model=smollm2-135m data_dir="$data" results_dir="$runs" wandb.mode=disabled "$@"; }

ll5="task=copa,rte,openbookqa,winogrande,piqa limit=100"  # the first 100 documents of each (all of COPA)
mathqa="task=mathqa limit=50"                             # 5 choices of long text: the costliest task

headline_and_summaries() {
    # full cache, H2O and local at 20 % (simulate protocol), then summarisation, then the other budgets
    sweep $ll5 policy=full,h2o,local budget=0.2
    sweep $mathqa policy=full,h2o,local budget=0.2
    sweep task=xsum,cnn_dailymail limit=50 num_fewshot=0 policy=full,h2o,local budget=0.2
    sweep $ll5 policy=h2o,local budget=0.05,0.1,0.5
    sweep $mathqa policy=h2o,local budget=0.05,0.1,0.5
}

reference_prefill_and_budgets() {
    # the authors' simulation, the deployment protocol at 20 %, then the other budgets from the other end
    sweep $ll5 policy=h2o_reference budget=0.05,0.1,0.2,0.5
    sweep $mathqa policy=h2o_reference budget=0.05,0.1,0.2,0.5
    sweep $ll5 policy=h2o,local budget=0.2 protocol=prefill
    sweep $mathqa policy=h2o,local budget=0.2 protocol=prefill
    sweep $mathqa policy=h2o,local budget=0.05,0.1,0.5
    sweep $ll5 policy=h2o,local budget=0.05,0.1,0.5
}

headline_and_summaries > "$runs.runner1.log" 2>&1 &
first=$!
reference_prefill_and_budgets > "$runs.runner2.log" 2>&1 &
second=$!
status=0
wait $first || status=$?
wait $second || status=$?
[ $status -eq 0 ] || { echo "a sweep failed: see $runs.runner*.log, then run this again" >&2; exit $status; }

# the published summary: tables and accuracy-vs-budget figures, and the section 3 observations
python -m h2o_eval.plot "$runs" --out results/replication --at 0.2
python -m h2o_eval.analyze --model smollm2-135m --task piqa --num-fewshot 5 --limit 30 --data-dir "$data" \
    --out results/replication/observations
