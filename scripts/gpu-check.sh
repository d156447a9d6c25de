#!/usr/bin/env bash
# The GPU check: the layout matrix on the device, the codec self-test, `bench tier --device`,
# the native two-pass restore at TP=1 and the transfer pipeline (save/load GB/s of a 64-chunk
# step vs raw pinned cudaMemcpyAsync, lane CPU time per GB, step time offload on vs off under a
# save burst), printed as one table (scripts/gpu_check.py, scripts/gpu_pipeline.py).
#
# Target machine: one CUDA GPU, python3 with a CUDA build of torch, no vLLM, no network.
#   here (network):   scripts/gpu-check.sh --prepare     # wheels into build/wheels (~30 MB)
#   there (carry build/wheels with the tree):
#                     scripts/gpu-check.sh               # --device cuda (default)
#   anywhere:         scripts/gpu-check.sh --device cpu  # same checks on host tensors
# Extra arguments go to gpu_check.py (--quick, --out DIR).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WHEELS="$ROOT/build/wheels"
VENV="$ROOT/build/gpu-check-venv"
PYTHON="${PYTHON:-python3}"
# what the checks import (no server, no plotting, no redis); torch comes from the machine
NEEDS=(numpy blake3 xxhash msgspec pyzmq prometheus-client pyyaml typer rich safetensors
       tokenizers pytest pytest-timeout)

say() { printf '[gpu-check %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [[ "${1:-}" == "--prepare" ]]; then
    mkdir -p "$WHEELS"
    # kvtier's pins where it has them, so the device runs what the tests ran here
    pins="$("$PYTHON" - "$ROOT/pyproject.toml" "${NEEDS[@]}" <<'PY'
import re, sys, tomllib
d = tomllib.load(open(sys.argv[1], "rb"))["project"]
specs = d["dependencies"] + [s for extra in d["optional-dependencies"].values() for s in extra]
pins = {re.split(r"[=<>!~ ]", s, maxsplit=1)[0].lower(): s for s in specs}
print(" ".join(pins.get(n, n) for n in sys.argv[2:]))
PY
)"
    say "downloading wheels for $("$PYTHON" -V) into $WHEELS: $pins"
    # shellcheck disable=SC2086  # the pin list is meant to split
    "$PYTHON" -m pip download --quiet --only-binary=:all: --dest "$WHEELS" $pins
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
missing_in() {
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
if [[ -n "$(missing_in "$PYTHON")" ]]; then
    if [[ ! -x "$VENV/bin/python" ]]; then
        say "venv $VENV over the machine's torch (--system-site-packages)"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    fi
    RUN="$VENV/bin/python"
    missing="$(missing_in "$RUN")"
    if [[ -n "$missing" ]]; then
        say "installing from $WHEELS (no network): $missing"
        # shellcheck disable=SC2086
        "$RUN" -m pip install --quiet --no-index --find-links "$WHEELS" $missing
    fi
fi
cd "$ROOT"
PYTHONPATH="$ROOT/src:$ROOT" exec "$RUN" scripts/gpu_check.py "${args[@]}"
