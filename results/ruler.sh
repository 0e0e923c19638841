#!/usr/bin/env bash
# Every command behind results/ruler/ (RULER's thirteen tasks, the scorers of 2026, the leaderboard; see
# results/README.md). Records go to RECORDS/<stage> (default results/ruler/records, which is committed: the tables
# can be rebuilt from it anywhere, and a run of many hours can go on over several machines). Resumable: a setting
# whose record exists is skipped, so run it again after any interruption; a unit stopped part way left its answers in
# RECORDS/<stage>/partial/ (JSON, not ignored by git there): commit them with the records to go on on another machine.
#   bash results/ruler.sh [DATA_DIR] [RECORDS] [STAGE ...]
# Each stage is one process of one thread at a time; on a 2-core machine run two lanes side by side, then tables:
#   bash results/ruler.sh ../shared/data results/ruler/records scorers full floor &
#   bash results/ruler.sh ../shared/data results/ruler/records scorers_gemma full_gemma leaderboard
#   bash results/ruler.sh ../shared/data results/ruler/records pack tables
# Stages:
#   scorers       issue 29: the new scorers and the oracle beside the full cache, niah_single_2, context protocol,
#                 budgets 25/50/75 %, SmolLM2 at 2k (20 documents)
#   scorers_gemma the same on Gemma 3 at 4k (10 documents)
#   full          the full cache on RULER's 13 tasks at 4k, RULER's documents (one question each), SmolLM2, 40 per
#                 task (FULL_LIMIT=10 runs the first 10 of them)
#   full_gemma    the same for Gemma 3 270M
#   floor         h2o, local and snapkv at 25 % on niah_single_2 at 4k (context protocol, the policies' own
#                 decoding), SmolLM2, 10 documents, against the news-haystack grid's 0.20 floor
#   leaderboard   +experiment=kv_leaderboard_shared: SmolLM2, 4 questions per haystack, 10 haystacks per task (cwe, fwe
#                 and qa_2, which ask one question: 40), 12 policies x 4 ratios; Gemma 3 with 5 haystacks (cwe, fwe,
#                 qa_2: 20). qa_2's ten paragraphs per question fill 4k: in SmolLM2's tokens two questions' leave no room for
#                 a distractor and three do not fit, so it asks one, as RULER does.
#                 Units of a task and 3 policies; two lanes split them: LANE=0/2 ... leaderboard & LANE=1/2 ...
#                 (the lanes of one machine take cwe, fwe and qa_2's units one at a time: SmolLM2's peak at 13 GB)
#   leaderboard_1q +experiment=kv_leaderboard (one question per context): SmolLM2 on ONE_TASKS (niah_single_2 and
#                 qa_1), ONE_LIMIT documents (default 40): 12 policies, kvpress's other presses (issue 61) and the
#                 board's kvpress/ configurations x 6 ratios (kvpress's 4, 0.9375 and 0.96875), and knorm at 5
#                 thresholds; LANE=i/n splits its units
#   board_1q      +experiment=kv_leaderboard as it is: RULER's 13 tasks (or BOARD_TASKS=a,b), ONE_LIMIT documents
#                 (default 40), BOARD_MODEL (default smollm2-135m); a unit is a task's 61 cells; LANE=i/n
#   pack          each stage's records packed into RECORDS/<stage>/records.jsonl.gz (python -m h2o_eval.results pack),
#                 as they are committed; a later run beside a pack skips what it holds and writes loose records, which
#                 packing again folds in
#   tables        results/ruler/<stage>: tables, paired tests, the headline and the leaderboard (per task under
#                 leaderboard/tasks) and PROVENANCE.md (the records' commits, dates, machine time and settings),
#                 from RECORDS/<stage>
set -euo pipefail
data=${1:-../shared/data}
out=${2:-results/ruler/records}
shift $(( $# < 2 ? $# : 2 ))
stages=${*:-scorers scorers_gemma full floor full_gemma leaderboard pack tables}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
export SOURCE_DATE_EPOCH=0  # matplotlib's PDFs without a creation date: unchanged results, unchanged files
grid() { python -m h2o_eval.grid data_dir="$data" wandb.mode=disabled threads=1 "$@"; }

ruler_tasks=niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,niah_multivalue,niah_multiquery,vt,cwe,fwe,qa_1,qa_2
scorer_policies=full,oracle,expected_attention,keydiff,kvzip,criticalkv,snapkv,knorm,streaming
board_tasks=niah_single_2,niah_single_1,niah_multivalue,niah_multiquery,niah_single_3,niah_multikey_1,fwe,qa_2,vt,qa_1,cwe,niah_multikey_2,niah_multikey_3
# The leaderboard's 12 policies in 4 groups of about equal cost (KVzip's repeat and the oracle's answers apart).
board_groups=(full,kvzip,snapkv oracle,streaming,knorm expected_attention,keydiff,h2o criticalkv,random,tova)

scorer_grid() {  # scorer_grid MODEL LENGTH DOCUMENTS BATCH FOLDER
    grid model="$1" task=niah_single_2 task.length="$2" ++task.max_new_tokens=32 limit="$3" batch_size="$4" \
        policy=$scorer_policies budget=0.25,0.5,0.75 protocol=context results_dir="$out/$5"
}
scorers() { scorer_grid smollm2-135m 2048 20 4 scorers; }
scorers_gemma() { scorer_grid gemma3-270m 4096 10 2 scorers_gemma; }
full() {
    for task in ${ruler_tasks//,/ }; do
        grid model=smollm2-135m task=$task limit="${FULL_LIMIT:-40}" batch_size=4 policy=full protocol=context \
            results_dir="$out/full"
    done
}
full_gemma() {
    for task in ${ruler_tasks//,/ }; do
        grid model=gemma3-270m task=$task limit=10 batch_size=2 policy=full protocol=context results_dir="$out/full"
    done
}
floor() {
    grid model=smollm2-135m task=niah_single_2 limit=10 batch_size=4 policy=full,h2o,local,snapkv budget=0.25 \
        protocol=context results_dir="$out/floor"
}
board() {  # board MODEL HAYSTACKS BATCH [OVERRIDE...]: 4 questions per haystack; cwe, fwe and qa_2 (one question) on 4x
    # the documents. One unit is a task and a group of policies (their records are written when the unit ends), the
    # tasks where the full cache scores highest first; LANE=i/n runs every n-th unit from the i-th.
    local model=$1 limit=$2 batch=$3 lane=${LANE:-0/1} unit=0 task group exclusive
    shift 3
    local -a size
    for task in ${board_tasks//,/ }; do
        case $task in
            cwe | fwe | qa_2) size=(task.questions=1 limit=$((4 * limit)) batch_size=$((2 * batch))) exclusive=true ;;
            *) size=(limit="$limit" batch_size="$batch") exclusive=false ;;
        esac
        for group in "${board_groups[@]}"; do
            (( unit++ % ${lane#*/} == ${lane%/*} )) || continue
            {  # 4 contexts a batch: SmolLM2's unit peaks at 12.5-13.2 GB, two at once were OOM-killed on 24 GiB
                ! $exclusive || flock 9
                grid +experiment=kv_leaderboard_shared model="$model" task="$task" "${size[@]}" policy="$group" \
                    results_dir="$out/leaderboard" "$@"
            } 9>"${TMPDIR:-/tmp}/h2o_eval_board.lock"
        done
    done
}
leaderboard() {
    # The cells decode together (the preset's stack_cells): Gemma's answers run to 128 tokens, and SmolLM2's to about 120 on
    # niah_multivalue, niah_multiquery and cwe (its niah_single_1/_2 and niah_multikey_1/_2, whose answers end
    # after about 9 tokens, ran one cell at a time: the same answers up to float rounding).
    board smollm2-135m 10 2
    board gemma3-270m 5 1
}
leaderboard_1q() {
    # kvpress's protocol (+experiment=kv_leaderboard, one question per context) beside the shared-context one:
    # SmolLM2 on ONE_TASKS (default niah_single_2 qa_1), ONE_LIMIT documents (default 40). A unit is a task and a
    # group: the first leaderboard's 12 policies, then the presses added for issue 61, each at 6 ratios, then knorm at
    # five thresholds (kvpress's DMSPress: one record each, whatever the budget), which remove 6 % to 86 % of a context,
    # then the board entries whose parameters kvpress's board sets apart from this project's defaults (issue 69).
    # LANE=i/n runs every n-th unit from the i-th. One document a batch: a unit of 36 cells peaks near 8 GB.
    local lane=${LANE:-0/1} unit=0 task group six=budget=0.75,0.5,0.25,0.125,0.0625,0.03125
    local -a groups=(
        "policy=full,oracle,kvzip,snapkv,streaming,knorm $six"
        "policy=expected_attention,keydiff,h2o,criticalkv,random,tova $six"
        "policy=observed_attention,lagkv,cur,non_causal_attention,leverage,compactor $six"
        "policy=chunkkv,entropy_gated_chunkkv,finch $six"
        "policy=adakv policy.base=compactor $six"
        "policy=kvpress/snapkv,kvpress/pyramidkv,kvpress/expected_attention,kvpress/random $six"
        "policy=knorm threshold=-22,-20,-18,-16,-14"
    )
    for task in ${ONE_TASKS:-niah_single_2 qa_1}; do
        for group in "${groups[@]}"; do
            (( unit++ % ${lane#*/} == ${lane%/*} )) || continue
            # shellcheck disable=SC2086  # a group is several overrides
            grid +experiment=kv_leaderboard model=smollm2-135m task="$task" limit="${ONE_LIMIT:-40}" batch_size=1 \
                $group results_dir="$out/leaderboard_1q"
        done
    done
}
board_1q() {
    # The whole one-question board (issue 69): +experiment=kv_leaderboard as it is, RULER's 13 tasks, ONE_LIMIT
    # documents (default 40), BOARD_MODEL (default smollm2-135m; gemma3-270m: about as many CPU-hours, see
    # docs/costs.md), into a folder of its own (niah_single_2's and qa_1's SmolLM2 cells that leaderboard_1q had run
    # were copied there). A unit is a task: the preset's 61 cells share each document's prompt pass and decode
    # stacked (SmolLM2: 7.8 GB at peak). niah_single_1 and niah_multivalue's first 29 cells ran in quarters of the 16
    # policies, each paying the prompt pass: niah_single_1 took 2.70 CPU-hours, where the 61 cells' parts estimate 1.97.
    # LANE=i/n runs every n-th task from the i-th, of BOARD_TASKS (default: all 13, in board_tasks' order); cells with
    # records are skipped, a unit stopped part way takes up its answers when run again, and a unit another lane is
    # computing is waited for (its lock), then skipped.
    local lane=${LANE:-0/1} unit=0 task tasks=${BOARD_TASKS:-$board_tasks}
    for task in ${tasks//,/ }; do
        (( unit++ % ${lane#*/} == ${lane%/*} )) || continue
        grid +experiment=kv_leaderboard model="${BOARD_MODEL:-smollm2-135m}" task="$task" limit="${ONE_LIMIT:-40}" \
            batch_size=1 results_dir="$out/board_1q"
    done
}
pack() {
    local folder
    for folder in scorers scorers_gemma full floor leaderboard leaderboard_1q board_1q; do
        [ ! -d "$out/$folder" ] || python -m h2o_eval.results pack "$out/$folder"
    done
}
tables() {
    local folder
    for folder in scorers scorers_gemma full floor leaderboard leaderboard_1q board_1q; do
        [ -d "$out/$folder" ] || { echo "no records in $out/$folder: results/ruler/$folder left as committed"; continue; }
        case $folder in
            scorers | scorers_gemma) python -m h2o_eval.plot "$out/$folder" --out "results/ruler/$folder" --at 0.25 0.5 0.75 ;;
            floor) python -m h2o_eval.plot "$out/$folder" --out "results/ruler/$folder" --at 0.25 ;;
            full) python -m h2o_eval.plot "$out/$folder" --out "results/ruler/$folder" ;;
            leaderboard | leaderboard_1q | board_1q)  # and per task: its figure, every cell's score, each policy paired against the full cache
                python -m h2o_eval.plot "$out/$folder" --out "results/ruler/$folder" --leaderboard
                python -m h2o_eval.plot "$out/$folder" --out "results/ruler/$folder/tasks"
                # beside the one-question boards: the shared-context board's records of the same model and tasks
                [ "$folder" != leaderboard_1q ] || python -m h2o_eval.plot "$out/leaderboard" --task niah_single_2 qa_1 \
                    --model smollm2-135m --leaderboard --out "results/ruler/$folder/shared"
                [ "$folder" != board_1q ] || python -m h2o_eval.plot "$out/leaderboard" --model smollm2-135m \
                    --task "$(python -m h2o_eval.results list "$out/$folder" | sed -n 's/^smollm2-135m__\(.*\)-4096__.*\.json$/\1/p' | sort -u | paste -sd,)" \
                    --leaderboard --out "results/ruler/$folder/shared" ;;
        esac
        # where the records came from (per commit: count, dates, machine time, threads, versions, settings)
        python -m h2o_eval.plot "$out/$folder" --out "results/ruler/$folder" --provenance
    done
}
for stage in $stages; do "$stage"; done
