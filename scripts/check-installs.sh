#!/usr/bin/env bash
# Every install the README names, checked as a user gets it: a fresh venv, kvtier's wheel (not
# the source tree), then what that install promises.
#
#   plain      pip install kvtier            kvtier --help, plan, doctor --help, version, and
#                                            every module of the tier, the tools and the vLLM
#                                            connector imports (vLLM itself excepted)
#   [native]   pip install 'kvtier[native]'  kvtier serve --help, model init
#   [bench]    pip install 'kvtier[bench]'   kvtier bench cache --quick on the bundled trace
#
# With PYTHON_VENV=DIR the venv at DIR is used as it is (a fresh one holding torch only, made
# by the caller: tests/test_installs.py shares it with the GPU check's CPU form).
#
# The extras nest (bench > native > plain), so one venv grows one extra at a time and each
# step's checks run before the next extra is installed: a module an install needs but does not
# declare fails the step that needs it. torch is the CPU build from the machine's wheel cache,
# as `make setup` installs it. Usage: scripts/check-installs.sh [WORK_DIR]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${1:-$ROOT/build/install-check}"
PYTHON="${PYTHON:-python3.11}"
VENV="$WORK/venv"
say() { printf '[check-installs %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
start=$SECONDS

rm -rf "$WORK"
mkdir -p "$WORK"
say "building kvtier's wheel"
"$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$WORK/dist" "$ROOT"
WHEEL="$(ls "$WORK"/dist/kvtier-*.whl)"
if [[ -n "${PYTHON_VENV:-}" ]]; then
    VENV="$PYTHON_VENV"
    say "the caller's fresh venv $VENV (torch only)"
else
    say "fresh venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# uv installs what pip would from the same metadata (scripts/uv.sh: several times faster, and
# `make test` has 12 minutes); a dependency the wheel does not declare fails either way
# (no bytecode: each install's commands run once or twice)
PIP=(env UV_COMPILE_BYTECODE=0 "$ROOT/scripts/uv.sh" pip install --quiet -p "$VENV/bin/python")
if [[ -z "${PYTHON_VENV:-}" ]]; then
    "${PIP[@]}" "torch==2.13.0+cpu" || "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
fi
# run from an empty directory: nothing of the source tree may stand in for the install
cd "$WORK"
KV="$VENV/bin/kvtier"

say "plain: pip install kvtier"
"${PIP[@]}" "$WHEEL"
"$KV" --help >/dev/null
"$KV" version
"$KV" doctor --help >/dev/null
"$KV" plan --model llama-3.1-8b --tier-bytes 1GiB --hbm-tokens 4096 --prefixes 4 \
    --prefix-len 2048 --json >"$WORK/plan.json"
# a trace plan without matplotlib: its numbers, and a note instead of the PNG
printf '%s\n' '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}' \
    '{"timestamp": 1, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}' \
    >"$WORK/trace.jsonl"
"$KV" plan --model llama-3.1-8b --tier-bytes 1GiB --hbm-tokens 512 --trace "$WORK/trace.jsonl" \
    --json >"$WORK/plan-trace.json" 2>"$WORK/plan-trace.err"
grep -q "pip install 'kvtier\[bench\]'" "$WORK/plan-trace.err"
"$VENV/bin/python" - <<'PY'
import importlib, json, pkgutil, sys
import kvtier
# the plain install: everything but the native engine and the benches
skip = ("kvtier.native", "kvtier.bench")
failed = []
for mod in pkgutil.walk_packages(kvtier.__path__, "kvtier."):
    if mod.name.startswith(skip):
        continue
    try:
        importlib.import_module(mod.name)
    except ModuleNotFoundError as e:
        # the connector's modules that need vLLM itself are vLLM's install, not ours
        if not (mod.name.startswith("kvtier.vllm.") and (e.name or "").startswith("vllm")):
            failed.append(f"{mod.name}: {e}")
json.load(open("plan.json"))
assert json.load(open("plan-trace.json"))["hit_curve"], "the trace plan drew no hit curve"
if failed:
    sys.exit("the plain install cannot import:\n  " + "\n  ".join(failed))
print("plain install: every module of the tier, tools and connector imports")
PY

say "native: pip install 'kvtier[native]'"
"${PIP[@]}" "$WHEEL[native]"
"$KV" serve --help >/dev/null
"$KV" model init "$WORK/model" >/dev/null
test -f "$WORK/model/config.json"

say "bench: pip install 'kvtier[bench]'"
"${PIP[@]}" "$WHEEL[bench]"
# the bundled trace's rows: they need the packaged data (the other streams, and the retention
# rows, are the same code on generated streams, run by tests/bench/test_cache.py and
# tests/test_cachemodel_retention.py; the whole --quick table is 95 s of CPU, this 10 s)
"$KV" bench cache --quick --workload mooncake-trace --no-retention \
    --json "$WORK/bench-cache.json" >"$WORK/bench-cache.txt"
"$VENV/bin/python" - <<'PY'
import json
doc = json.load(open("bench-cache.json"))
trace = [r for r in doc["rows"] if r["id"].startswith("mooncake_trace.")]
assert trace, "bench cache --quick ran no row on the bundled Mooncake trace"
print(f"bench install: bench cache --quick, {len(doc['rows'])} rows, {len(trace)} on the trace")
PY
say "every install works as the README says ($((SECONDS - start)) s)"
