#!/usr/bin/env bash
# uv at kvtier's pin, installed on first use into build/uv, then run with the arguments given.
#
# Every venv `make` builds is installed with uv: on the 2-core VM the vLLM venv took 110 s with
# pip and 12 s of it with uv, and `make test` has 12 minutes in all. uv reads no pip.conf, so
# the wheel directories pip is told to search (`find-links`: where the CPU torch wheel lies)
# are handed to it. Usage: scripts/uv.sh pip install -p VENV/bin/python PACKAGE...
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3.11}"
UV_VERSION="0.13.9"
UV_HOME="${KVTIER_UV_HOME:-$ROOT/build/uv}"
UV="$UV_HOME/bin/uv"

have_uv() { [[ -x "$UV" && "$("$UV" --version 2>/dev/null)" == "uv $UV_VERSION"* ]]; }

if ! have_uv; then
    # parallel make targets share one install
    exec 8>"/tmp/kvtier-uv-$(id -u).lock"
    flock 8
    if ! have_uv; then
        printf '[uv %s] installing uv==%s into %s\n' "$(date +%H:%M:%S)" "$UV_VERSION" "$UV_HOME"
        rm -rf "$UV_HOME"
        "$PYTHON" -m venv "$UV_HOME"
        "$UV_HOME/bin/python" -m pip install --quiet --progress-bar off "uv==$UV_VERSION"
    fi
    exec 8>&-
fi
# bytecode at install, as pip compiles it: where PYTHONDONTWRITEBYTECODE is set (this machine
# sets it) nothing would ever be cached, and every process importing torch or vLLM compiled them
# again (the suite ran for 20 minutes instead of 11). UV_COMPILE_BYTECODE=0 skips it.
export UV_COMPILE_BYTECODE="${UV_COMPILE_BYTECODE:-1}"
if [[ -z "${UV_FIND_LINKS:-}" ]]; then
    links="$("$PYTHON" -m pip config get global.find-links 2>/dev/null || true)"
    # pip separates directories with whitespace, uv with commas; a missing one is skipped
    dirs=()
    for d in $links; do
        [[ -d "$d" ]] && dirs+=("$d")
    done
    if ((${#dirs[@]})); then
        UV_FIND_LINKS="$(IFS=,; echo "${dirs[*]}")"
        export UV_FIND_LINKS
    fi
fi
exec "$UV" "$@"
