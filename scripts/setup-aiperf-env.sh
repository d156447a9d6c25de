#!/usr/bin/env bash
# Build (or reuse) .venv-aiperf: aiperf 0.13.0, the field's benchmark client, in its own venv.
#
# aiperf pins its own dependency versions (pydantic, rich, pyzmq, prometheus-client...), so it
# lives apart from the main .venv; the tests drive its CLI through subprocesses. The venv is
# reused while its stamp matches this script. Usage: scripts/setup-aiperf-env.sh [VENV_DIR]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv-aiperf}"
PYTHON="${PYTHON:-python3.11}"
STAMP="$VENV/.kvtier-aiperf-stamp"
AIPERF_SPEC="aiperf==0.13.0"

say() { printf '[setup-aiperf-env %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

exec 9>"/tmp/kvtier-setup-aiperf-env-$(id -u).lock"
flock 9

want_stamp="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"
if [[ -x "$VENV/bin/aiperf" && -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" ]]; then
    say "reusing $VENV (stamp matches)"
    exit 0
fi

start=$SECONDS
if [[ -e "$VENV" ]]; then
    say "stamp missing or stale: rebuilding $VENV"
    rm -rf "$VENV"
fi
say "creating venv with $PYTHON"
"$PYTHON" -m venv "$VENV"
say "installing $AIPERF_SPEC"
# uv (scripts/uv.sh): pip took 68 s here on the 2-core VM. No bytecode at install: compiling
# its 15,000 modules cost 31 s of CPU (24 s against 8 s on 2 cores, beside the vLLM env's
# install) for the few aiperf runs of a test session, and `make test` lets those runs write
# the bytecode of what they import
UV_COMPILE_BYTECODE=0 "$ROOT/scripts/uv.sh" pip install --quiet -p "$VENV/bin/python" "$AIPERF_SPEC"

say "checking the CLI"
"$VENV/bin/aiperf" --version

echo "$want_stamp" >"$STAMP"
say "done in $((SECONDS - start)) s; size $(du -sh "$VENV" | cut -f1)"
