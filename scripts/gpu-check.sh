#!/usr/bin/env bash
# The GPU check: the layout matrix on the device, the codec self-test, `kvtier bench tier
# --device` (save/load at 4, 16 and 64 chunks per step against raw pinned copies, a one-chunk
# load's latency, the forward under a save burst) and the native two-pass restore, printed as
# one table (scripts/gpu_check.py).
#
# Target machine: one CUDA GPU, a python3 with a CUDA build of torch, no network.
#   here (network):   scripts/gpu-check.sh --prepare [--python-version 3.12]
#                     # wheels for that Python into build/wheels (default 3.12, about 30 MB)
#   there (carry build/wheels with the tree):
#                     scripts/gpu-check.sh               # --device cuda (default)
#   anywhere:         scripts/gpu-check.sh --device cpu  # the same checks on host tensors
# Extra arguments go to gpu_check.py (--quick, --out DIR). PYTHON picks the interpreter
# (default python3); WHEELS the wheel directory; GPU_CHECK_SITE where the missing packages are
# installed (default build/gpu-check-site-cpXY, reused for the same packages at the same pins).
# `make test` runs the CPU form end to end, the offline install included
# (tests/test_installs.py).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="${WHEELS:-$ROOT/build/wheels}"
PYTHON="${PYTHON:-python3}"
# what the checks import (no server, no plotting, no shared store); torch is the machine's
NEEDS=(numpy blake3 xxhash cryptography msgspec pyzmq prometheus-client pyyaml typer rich httpx
       safetensors tokenizers pytest pytest-timeout hypothesis)

say() { printf '[gpu-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

pins() {  # kvtier's pins where it has them, so the device runs what the tests ran here
    "$1" - "$ROOT/pyproject.toml" "${NEEDS[@]}" <<'PY'
import re, sys, tomllib
d = tomllib.load(open(sys.argv[1], "rb"))["project"]
specs = d["dependencies"] + [s for extra in d["optional-dependencies"].values() for s in extra]
pins = {re.split(r"[=<>!~ \[]", s, maxsplit=1)[0].lower(): s for s in specs}
print(" ".join(pins.get(n, n) for n in sys.argv[2:]))
PY
}

if [[ "${1:-}" == "--prepare" ]]; then
    version=3.12  # the GPU machine's Python (its own CUDA torch)
    [[ "${2:-}" == "--python-version" ]] && version="${3:?--python-version needs X.Y}"
    host="$(command -v python3.11 || command -v python3)"
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2207  # the pin list is meant to split
    specs=($(pins "$host"))
    say "downloading wheels for CPython $version (manylinux x86_64) into $WHEELS"
    "$host" -m pip download --quiet --only-binary=:all: --dest "$WHEELS" \
        --python-version "$version" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 --platform linux_x86_64 \
        "${specs[@]}"
    say "done: $(du -sh "$WHEELS" | cut -f1); carry build/wheels to the device machine"
    exit 0
fi

args=("$@")
[[ " ${args[*]:-} " == *" --device "* ]] || args=(--device cuda "${args[@]}")

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "gpu-check: $PYTHON has no torch; install a CUDA build of torch first" >&2
    exit 2
fi
if [[ " ${args[*]} " == *" --device cuda"* ]] && \
   ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: $PYTHON's torch $("$PYTHON" -c 'import torch; print(torch.__version__)') sees" \
         "no CUDA device (a CPU build, no driver, or CUDA_VISIBLE_DEVICES empty); run on the" \
         "GPU machine, or pass --device cpu for the same checks on host tensors" >&2
    exit 2
fi
missing_in() {  # the NEEDS a Python cannot import (by distribution name)
    "$1" - "${NEEDS[@]}" <<'PY'
import importlib.metadata as md, sys
out = []
for name in sys.argv[1:]:
    try:
        md.version(name)
    except md.PackageNotFoundError:
        out.append(name)
print(" ".join(out))
PY
}
RUN="$PYTHON"
SITE=""
missing="$(missing_in "$PYTHON")"
if [[ -n "$missing" ]]; then
    if [[ ! -d "$WHEELS" ]]; then
        echo "gpu-check: $PYTHON lacks $missing and $WHEELS does not exist; run" \
             "'scripts/gpu-check.sh --prepare --python-version $("$PYTHON" -c \
             'import sys; print("%d.%d" % sys.version_info[:2])')' on a machine with network and" \
             "carry build/wheels" >&2
        exit 2
    fi
    # the missing packages go to a directory of their own, ahead of the machine's site-packages
    # (no venv: a device image may lack ensurepip); the machine's torch stays the one imported
    tag="$("$PYTHON" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"
    SITE="${GPU_CHECK_SITE:-$ROOT/build/gpu-check-site-$tag}"
    # shellcheck disable=SC2207
    want=($(pins "$PYTHON"))
    # the site is reused only for the same missing packages at the same pins
    stamp="$missing | ${want[*]}"
    if [[ ! -f "$SITE/.complete" || "$(cat "$SITE/.complete")" != "$stamp" ]]; then
        say "installing from $WHEELS (no network) into $SITE: $missing"
        rm -rf "$SITE"
        picked=()
        for spec in "${want[@]}"; do
            name="${spec%%[=<>!~ []*}"
            [[ " $missing " == *" $name "* ]] && picked+=("$spec")
        done
        "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" --target "$SITE" \
            "${picked[@]}"
        echo "$stamp" > "$SITE/.complete"
    else
        say "reusing $SITE (the same packages at the same pins; delete it to reinstall)"
    fi
fi
cd "$ROOT"
PYTHONPATH="$ROOT/src:$ROOT${SITE:+:$SITE}" exec "$RUN" scripts/gpu_check.py "${args[@]}"
