"""The packaging split: the tier, the vLLM connector and the `kvtier` command need no extra
(`kvtier[native]`: the engine and its HTTP server, `kvtier[bench]`: plotting), the vLLM venv
installs exactly what the connector imports, and a command that needs an extra says which."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PKG = SRC / "kvtier"

# what `kvtier[native]`, `kvtier[bench]` and `[dev]` install (top-level import names)
EXTRAS = ("fastapi", "starlette", "uvicorn", "pydantic", "jinja2", "safetensors", "tokenizers",
          "matplotlib", "psutil")  # fmt: skip

# the connector's imports that vLLM itself brings
FROM_VLLM = frozenset({"vllm", "torch", "numpy", "huggingface_hub"})
# import name -> distribution, for the packages scripts/setup-vllm-env.sh installs
DIST_OF = {"zmq": "pyzmq", "prometheus_client": "prometheus-client", "yaml": "pyyaml",
           "glide_sync": "valkey-glide-sync", "glide_shared": "valkey-glide-sync"}  # fmt: skip

# refuses the extras' modules for the rest of the process, as an install without them would
_BLOCKER = f"""
import importlib.abc, sys
BLOCKED = {EXTRAS!r}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None
sys.meta_path.insert(0, Refuse())
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BLOCKER + code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        check=False,
    )


def _modules(*units: str) -> list[str]:
    out = []
    for unit in units:
        base = PKG / unit
        paths = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
        for p in paths:
            parts = list(p.relative_to(SRC).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out.append(".".join(parts))
    return out


def test_the_tier_and_the_core_tools_run_without_any_extra(tmp_path: Path) -> None:
    core = _modules(
        "config", "topology", "layout", "keys", "metrics", "errors", "identity",
        "remote_endpoint", "store", "lookup", "offload", "cli", "plan",
        "doctor", "scrape", "cachemodel", "config_docs",
    )  # fmt: skip
    code = f"""
import importlib
for m in {core!r}:
    importlib.import_module(m)
import torch
from kvtier.config import KVTierConfig
from kvtier.metrics import Metrics
from kvtier.store.factory import build_stack
cfg = KVTierConfig(memory_bytes=4 * 4096, disk_bytes=1 << 20, disk_dir={str(tmp_path)!r})
stack = build_stack(cfg, bytes(range(16)), 4096, Metrics(rank=0))
key, payload = bytes(16), bytes(range(256)) * 16
assert stack.put(key, payload) and stack.flush(10.0)
dst = torch.zeros(4096, dtype=torch.uint8)
print("READ", stack.read_into(key, dst), bytes(dst.numpy()) == payload, stack.tiers)
stack.close()
"""
    out = _run(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "READ memory True ['memory', 'disk']" in out.stdout, out.stdout[-2000:]


def test_the_blocker_does_refuse_an_extra() -> None:
    """The check above would prove nothing if the finder let the modules through."""
    out = _run("import kvtier.native.server\n")
    assert out.returncode != 0 and "blocked" in out.stderr


def _third_party(path: Path) -> set[str]:
    """Top-level non-stdlib, non-kvtier modules `path` imports anywhere (functions included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name.partition(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n not in ("kvtier",)}


def _kvtier_closure(start: list[str]) -> set[Path]:
    """Files of every kvtier module reachable from `start` by kvtier imports (lazy ones too)."""
    from tests.test_layers import imports_of

    seen: set[Path] = set()
    todo = [PKG.joinpath(*m.split(".")[1:]) for m in start]
    while todo:
        base = todo.pop()
        path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if not path.is_file() or path in seen:
            continue
        seen.add(path)
        for imp in imports_of(SRC, path):
            todo.append(PKG.joinpath(*imp.target.split(".")[1:]))
    return seen


def test_the_vllm_venv_installs_exactly_what_the_connector_imports() -> None:
    files = _kvtier_closure(_modules("vllm"))
    assert not any(p.is_relative_to(PKG / "native") or p.is_relative_to(PKG / "bench")
                   for p in files)  # fmt: skip
    imported = set().union(*(_third_party(p) for p in files)) - {"__future__"}
    assert not imported & set(EXTRAS), sorted(imported & set(EXTRAS))
    script = (ROOT / "scripts" / "setup-vllm-env.sh").read_text()
    listed = set(re.search(r"^KVTIER_RUNTIME=\(([^)]*)\)", script, re.M).group(1).split())  # type: ignore[union-attr]
    needed = {DIST_OF.get(n, n) for n in imported - FROM_VLLM}
    assert needed == listed, f"connector imports {sorted(needed)}, script installs {sorted(listed)}"


def test_every_connector_dependency_is_a_core_dependency() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[=<>!~ \[]", d, maxsplit=1)[0] for d in project["dependencies"]}
    files = _kvtier_closure(_modules("vllm", "store", "lookup", "offload"))
    imported = set().union(*(_third_party(p) for p in files)) - {"__future__", "vllm"}
    missing = {DIST_OF.get(n, n).replace("_", "-") for n in imported} - core - {"huggingface-hub"}
    assert not missing, f"imported by the connector path but not core dependencies: {missing}"
    for extra in ("native", "bench", "dev"):
        assert extra in project["optional-dependencies"]


@pytest.mark.parametrize(
    ("argv", "extra"),
    [(["model", "init", "{tmp}/m"], "native"), (["serve", "{tmp}/m"], "native")],
)
def test_a_command_without_its_extra_names_the_pip_install(
    tmp_path: Path, argv: list[str], extra: str
) -> None:
    args = [a.format(tmp=tmp_path) for a in argv]
    out = _run(f"from kvtier.cli import main\nmain({args!r})\n")
    assert out.returncode == 2, (out.stdout[-2000:], out.stderr[-2000:])
    assert f"pip install 'kvtier[{extra}]'" in out.stderr
