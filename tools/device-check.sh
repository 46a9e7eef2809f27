#!/usr/bin/env bash
# gpu-check on a lent GPU machine as it is (no network, the image's python and packages):
#   here:        make device-bundle      (fills build/device: wheels the image lacks, the model's tokenizer)
#   the device:  bash tools/device-check.sh [gpu-check options]   carrying build/device
# Installs the carried wheels the image lacks into build/device-run/site, links the package view
# build/device-run/view/tritium -> backend/, kernels/, client/, and runs gpu-check on a random-weights
# checkpoint with the default model's shapes and tokenizer (built on the GPU), within a time budget; results in
# $OUT (the device tool brings that folder back), else bench_results/gpu_check, rewritten after every step.
# `--smoke` runs it on a CPU under the Triton interpreter. Environment: PYTHON (default python3),
# DEVICE_BUNDLE (build/device), DEVICE_BUDGET_S (seconds after which no step starts, default 400),
# DEVICE_TIMEOUT_S (hard stop of gpu-check, default 470).
set -euo pipefail
cd "$(dirname "$0")/.."
# Before any python starts: the repository root must not be on sys.path, or its kernels/ would pass for the
# `kernels` package transformers probes.
export PYTHONSAFEPATH=1
start=$(date +%s)
python=${PYTHON:-python3}
bundle=${DEVICE_BUNDLE:-build/device}
run=build/device-run
out=${OUT:-bench_results/gpu_check}

if [ ! -f "$bundle/manifest.json" ]; then
    echo "error: $bundle/manifest.json is missing: run \`make device-bundle\` on the development machine and carry" \
         "$bundle with the call (docs/gpu-check.md); stopping before anything else" >&2
    exit 2
fi

"$python" -c 'import sys, torch, triton, numpy, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, "
      f"available: {torch.cuda.is_available()}), triton {triton.__version__}, numpy {numpy.__version__}, "
      f"transformers {transformers.__version__}", flush=True)'
# best effort: without the carried wheels gpu-check still runs (matplotlib missing: no PNG, the JSON has the figures)
"$python" client/checks/device_bundle.py install --bundle "$bundle" --target "$run/site" ||
    echo "warning: the carried wheels did not install; gpu-check runs without them" >&2

mkdir -p "$run/view/tritium"
touch "$run/view/tritium/__init__.py"
for pkg in backend kernels client; do
    ln -sfn "$PWD/$pkg" "$run/view/tritium/$pkg"
done
export PYTHONPATH="$PWD/$run/view:$PWD/$run/site${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/$run/triton-cache}  # empty on a fresh machine: counts cold compiles
export MPLCONFIGDIR=${MPLCONFIGDIR:-$PWD/$run/matplotlib}
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
TRITIUM_GIT_COMMIT=$("$python" -c 'import json, sys; print(json.load(open(sys.argv[1])).get("git_commit") or "")' \
    "$bundle/manifest.json")
export TRITIUM_GIT_COMMIT  # the commit the bundle was made at, for a copy of the tree without .git
echo "setup took $(($(date +%s) - start)) s" >&2

status=0
timeout -k 15 "${DEVICE_TIMEOUT_S:-470}" "$python" -m tritium.client.checks.gpu_check --out "$out" --model random \
    --model-files "$bundle/model" --budget-s "${DEVICE_BUDGET_S:-400}" "$@" || status=$?
[ "$status" -eq 124 ] && echo "gpu-check stopped after ${DEVICE_TIMEOUT_S:-470} s; $out has the steps it finished" >&2
echo "device-check took $(($(date +%s) - start)) s, exit status $status; results in $out" >&2
exit "$status"
