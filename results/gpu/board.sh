#!/usr/bin/env bash
# Issue 92's GPU check, one call: a document's stacked cells on Llama-3-8B's shapes (random bf16 weights, random ids,
# as benchmarks.gpu takes them), decode steps at 1, 17 and 61 stacked rows with CUDA graphs off and on (the same
# tokens both ways), then H2O's TTFT at 32k and its largest batch against plain generate.
#
#     bash results/gpu/board.sh [OUT]        # OUT: results/gpu/board_<commit>, or $OUT on the device machine
#
# Run it where h2o_eval is importable (../shared/GPU.md: the carried wheels and PYTHONPATH; the grid also needs
# hydra-core and transformers' `kernels`). It writes each benchmark's own output, one file each, as it goes, so a run
# cut short keeps what it measured. With KVPRESS=DIR (kvpress 0.5.5 and its transformers installed there, as
# GPU.md says) it first runs the board's cells on niah_single_1 (a noise haystack: no data file) through the grid
# and through kvpress's pipeline on the same card, 32 new tokens, kvpress's cells at budget 0.5.
set -euo pipefail
commit=$(git rev-parse --short HEAD 2>/dev/null || echo "${COMMIT:-unknown}")
out=${1:-results/gpu/board_$commit}
mkdir -p "$out"
if [[ -n "${KVPRESS:-}" ]]; then
    timeout 420 python -m h2o_eval.benchmarks.board_compare --kvpress "$KVPRESS" --task niah_single_1 \
        --model shape-llama-3-8b --device cuda --new-tokens 32 --rounds 1 --kvpress-budget 0.5 \
        | tee "$out/board_compare.md" || echo "board_compare failed (exit $?): the checks below still run"
fi
cells17=full,knorm,snapkv,streaming,tova
cells61=$cells17,h2o,local,heavy,random,keydiff,pyramidkv,expected_attention,criticalkv,adakv,observed_attention,lagkv
for policies in full "$cells17" "$cells61"; do
    python -m h2o_eval.benchmarks.stacked_decode --model shape-llama-3-8b --device cuda --length 4096 --rows 1 \
        --question 32 --new-tokens 32 --graphs off,on --policies "$policies" | tee -a "$out/stacked.txt"
done
python -m h2o_eval.benchmarks.gpu --model shape-llama-3-8b --lengths 32768 --batch 1 --policies h2o \
    --graphs on off --rounds 3 --out "$out/ttft_32k.md"
python -m h2o_eval.benchmarks.gpu --model shape-llama-3-8b --lengths 32768 --batch max --policies h2o \
    --graphs on --rounds 1 --out "$out/batch_max_32k.md"
