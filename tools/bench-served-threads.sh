#!/usr/bin/env bash
# A served engine's CPU thread count against the load, the client on the same host: `tritium serve
# --num-threads N` behind `tritium openai`, swept with `tritium bench serve --backend openai` over concurrencies
# 1, 2, 4, 8, 16 and 32 (2 x N requests each, at least 8; ~128 prompt / 128 greedy output tokens, ignore_eos).
#   tools/bench-served-threads.sh [OUT_DIR]
# THREADS (default "1 2") lists the counts to serve with, in order ("auto": the engine's own rule, no
# --num-threads; a count may repeat, for ABBA pairs); CONCURRENCIES (default "1 2 4 8 16 32") the load points.
# Each run's serve.json and serve.png land in OUT_DIR/run<K>-threads-<N>-c<C>/. Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-bench_results/served_threads}
mkdir -p "$out"
pids=()
trap 'kill "${pids[@]}" 2> /dev/null || true' EXIT

wait_url() {
    for _ in $(seq 1 300); do curl -sf "$1" > /dev/null && return 0; sleep 1; done
    echo "not ready: $1" >&2; return 1
}

run=0
for threads in ${THREADS:-1 2}; do
    run=$((run + 1))
    flags=()
    [ "$threads" = auto ] || flags=(--num-threads "$threads")
    .venv/bin/tritium serve "${flags[@]}" > "$out/run$run-threads-$threads-serve.log" 2>&1 &
    pids=($!)
    wait_url http://127.0.0.1:8000/v2/health/ready
    .venv/bin/tritium openai --upstream 127.0.0.1:8001 --port 9000 --model tritium \
        > "$out/run$run-threads-$threads-openai.log" 2>&1 &
    pids+=($!)
    wait_url http://127.0.0.1:9000/v1/models
    for c in ${CONCURRENCIES:-1 2 4 8 16 32}; do
        n=$((c * 2 > 8 ? c * 2 : 8))
        .venv/bin/tritium bench serve --backend openai --url http://127.0.0.1:9000/v1 --model tritium \
            --concurrency "$c" --num-requests "$n" --output-len 128 --out-dir "$out/run$run-threads-$threads-c$c" | tail -2 \
            || echo "threads=$threads c=$c: some requests failed (see above)"
    done
    kill "${pids[@]}" 2> /dev/null || true; wait "${pids[@]}" 2> /dev/null || true
    sleep 3
done
