#!/usr/bin/env bash
# The lent GPU machine's image emulated on a CPU (`make emulated-image-check`, run by CI after `make test`):
# a separate venv build/emulated with the versions that matter there (triton 3.6, numpy 2, transformers 5; torch
# is the CPU wheel of constraints.txt's pin) and none of the project's other dependencies; then the device
# command itself (tools/device-check.sh --smoke: carried wheels, package view, random checkpoints, the
# interpreter) and the kernel compile check (sm_90) under triton 3.6. Needs .venv (make setup) for
# the bundle's model files; PyPI for the venv and the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python=${PYTHON:-python3}
env=build/emulated
torch=$(grep -m1 '^torch==' constraints.txt)
requirements=("$torch" "numpy>=2,<3" "transformers>=5,<6" "tokenizers" "safetensors")
stamp="$env/.installed triton==3.6.0 ${requirements[*]}"
if [ ! -f "$env/.installed" ] || [ "$(cat "$env/.installed")" != "$stamp" ]; then
    rm -rf "$env"
    "$python" -m venv "$env"
    "$env/bin/pip" install --quiet "${requirements[@]}"
    "$env/bin/pip" install --quiet --no-deps triton==3.6.0  # torch's CPU wheel does not pin triton
    echo "$stamp" > "$env/.installed"
fi
"$env/bin/python" -c 'import torch, triton, numpy, transformers
assert triton.__version__.startswith("3.6") and numpy.__version__.startswith("2"), (triton.__version__, numpy.__version__)'
echo "emulated venv ready after $(($(date +%s) - start)) s" >&2

version=$("$env/bin/python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
.venv/bin/python -m tritium.client.checks.device_bundle prepare --dest build/emulated-bundle --python-version "$version"
out=build/emulated-check/gpu_check
rm -rf "$out"
PYTHON="$env/bin/python" DEVICE_BUNDLE=build/emulated-bundle OUT="$out" bash tools/device-check.sh --smoke
"$env/bin/python" - "$out/gpu_check.json" <<'PY'
import json, sys
data = json.load(open(sys.argv[1]))
status = {s["number"]: s["status"] for s in data["steps"]}
assert data["passed"] and data["complete"], status
assert data["machine"]["triton"].startswith("3.6"), data["machine"]
assert all(s != "not run" for s in status.values()), status
print("device command smoke under the emulated image:", status)
PY
echo "device command smoke done after $(($(date +%s) - start)) s" >&2

# sm_90 only: the lent H200 (`make test` checks sm_80 and sm_90 under triton 3.7). Under 3.6 every variant must
# compile; spills are listed, not failed (3.7's check fails on them): they cost speed, not correctness, and
# register allocation differs between releases.
PYTHONPATH="$PWD/build/device-run/view" "$env/bin/python" -m tritium.kernels.compile_check --arch 90 --jobs "$(nproc)" --json \
    > build/emulated-check/compile_check.jsonl || true
"$env/bin/python" - build/emulated-check/compile_check.jsonl <<'PY'
import json, sys
results = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
assert results, "the compile check produced nothing"
errors = [r for r in results if not r["ok"] or r.get("error")]
spills = [r for r in results if r["ok"] and r["arch"] == 90 and (r["spill_stores"] or r["spill_loads"])]
for r in spills:
    print(f"spill sm_90 {r['kernel']} {r['dtype']} {r['constexprs']}: {r['spill_stores']}/{r['spill_loads']} B")
for r in errors:
    print(f"FAIL sm_{r['arch']} {r['kernel']} {r['dtype']} {r['constexprs']}: {r['error']}")
print(f"compile check under triton 3.6: {len(results)} variants, {len(errors)} failed to compile, "
      f"{len(spills)} spill on sm_90")
sys.exit(1 if errors else 0)
PY
echo "emulated-image-check passed in $(($(date +%s) - start)) s" >&2
