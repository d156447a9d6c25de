"""The layer contract (docs/architecture.md): imports go down the stack, never up, never between
the two hosts, nothing below the tools imports `kvtier.bench`, and nothing in kvtier imports
the test tree (`tests`: the fault harness, the redis launcher).

    foundation < store | lookup < offload < native | vllm < tools

Every module under src/kvtier is parsed with `ast`; every kvtier import counts, at module level,
inside functions and under `TYPE_CHECKING`, and so does a lazy `"kvtier.x.y:attr"` path string
(the CLI's command table, a native connector spec), because it is imported when it runs.
"""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

FOUNDATION = frozenset(
    {
        "__init__",
        "config",
        "topology",
        "layout",
        "keys",
        "metrics",
        "errors",
        "identity",
        "remote_endpoint",
        "cpus",
        "private_file",
        "numbers",
        "data",
        "throttled_log",
    }
)
TOOLS = frozenset(
    {"cli", "bench", "plan", "doctor", "scrape", "cachemodel", "config_docs"}
)

_BELOW_TOOLS = FOUNDATION | {"store", "lookup", "offload", "native", "vllm"}

# What each top-level unit of kvtier may import, besides itself.
MAY_IMPORT: dict[str, frozenset[str]] = {
    **{unit: FOUNDATION for unit in FOUNDATION},
    "store": FOUNDATION,
    "lookup": FOUNDATION,
    "offload": FOUNDATION | {"store", "lookup"},
    "native": FOUNDATION | {"store", "lookup", "offload"},
    "vllm": FOUNDATION | {"store", "lookup", "offload"},
    **{unit: _BELOW_TOOLS | TOOLS for unit in TOOLS},
}

# Units allowed to import kvtier.bench: the CLI that drives it and bench itself.
BENCH_USERS = frozenset({"cli", "bench"})

_LAZY_PATH = re.compile(r"^(kvtier(?:\.\w+)*):\w+$")


@dataclass(frozen=True)
class Import:
    """One kvtier import: who imports what, and on which line."""

    importer: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} (line {self.line}) imports {self.target}"


def module_name(root: Path, path: Path) -> str:
    """`root/kvtier/store/disk.py` -> `kvtier.store.disk`; a package's `__init__` is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def unit_of(module: str) -> str:
    """The layer unit of a kvtier module: its top-level name (`kvtier.store.disk` -> `store`),
    or `__init__` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(root: Path, module: str) -> bool:
    base = root.joinpath(*module.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(root: Path, path: Path) -> list[Import]:
    """Every kvtier module that the file at `path` imports, wherever the import statement sits."""
    module = module_name(root, path)
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            # `from kvtier.bench import arms` imports the module kvtier.bench.arms;
            # `from kvtier.config import KVTierConfig` imports kvtier.config
            names = [f"{source}.{a.name}" for a in node.names]
            subs = [name for name in names if _is_module(root, name)]
            targets = subs if len(subs) == len(node.names) else [source, *subs]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            lazy = _LAZY_PATH.match(node.value)
            targets = [lazy.group(1)] if lazy else []
        found += [
            Import(module, t, node.lineno)
            for t in targets
            if t == "kvtier" or t.startswith("kvtier.")
        ]
    return found


def all_imports(root: Path) -> list[Import]:
    """The kvtier imports of every module under `root/kvtier`."""
    paths = sorted((root / "kvtier").rglob("*.py"))
    return [imp for path in paths for imp in imports_of(root, path)]


def violations(root: Path) -> list[str]:
    """Every import that breaks the contract, as readable lines; empty when the tree keeps it."""
    bad: list[str] = []
    for imp in all_imports(root):
        src, dst = unit_of(imp.importer), unit_of(imp.target)
        if src not in MAY_IMPORT:
            bad.append(f"{imp.importer} is in no layer: add {src!r} to MAY_IMPORT")
            continue
        if dst != src and dst not in MAY_IMPORT[src]:
            bad.append(f"{imp}: {src} may import only {sorted(MAY_IMPORT[src])}")
        if dst == "bench" and src not in BENCH_USERS:
            bad.append(f"{imp}: only {sorted(BENCH_USERS)} may import kvtier.bench")
    return bad


def test_src_keeps_the_layer_contract() -> None:
    bad = violations(SRC)
    assert not bad, "layer contract broken:\n" + "\n".join(bad)


def test_every_module_has_a_layer() -> None:
    units = {unit_of(module_name(SRC, p)) for p in (SRC / "kvtier").rglob("*.py")}
    assert units <= set(MAY_IMPORT), f"modules in no layer: {sorted(units - set(MAY_IMPORT))}"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / "kvtier" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


_CLEAN = {
    "__init__.py": "",
    "config.py": "from kvtier import errors\n",
    "errors.py": "",
    "store/__init__.py": "",
    "store/memory.py": "from kvtier.config import X\n",
    "lookup/__init__.py": "",
    "offload/__init__.py": "",
    "offload/worker.py": "from kvtier.store import memory\nimport kvtier.lookup\n",
    "native/__init__.py": "",
    "vllm/__init__.py": "",
    "bench/__init__.py": "",
    "bench/arms.py": "",
    "cli.py": "CMD = 'kvtier.bench.arms:main'\n",
}


def test_checker_passes_a_clean_tree(tmp_path: Path) -> None:
    assert violations(_tree(tmp_path, _CLEAN)) == []


@pytest.mark.parametrize(
    ("rel", "text", "expected"),
    [
        # up the stack, inside a function
        ("store/memory.py", "def f():\n    from kvtier.offload import worker\n", "store may"),
        # sideways between store and lookup
        ("lookup/client.py", "from kvtier.store.memory import M\n", "lookup may import"),
        # between the hosts
        ("vllm/connector.py", "import kvtier.native.engine\n", "vllm may import"),
        # a host reaching up into the tools
        ("native/server.py", "from kvtier import cli\n", "native may import"),
        # foundation reaching into a layer above, relatively
        ("keys.py", "from .store import memory\n", "keys may import"),
        # a tool below cli importing bench, through a lazy path string
        ("doctor.py", "CHECK = 'kvtier.bench.arms:run'\n", "may import kvtier.bench"),
        # a module in no layer
        ("extras/thing.py", "import kvtier.config\n", "in no layer"),
    ],
)
def test_checker_fails_a_wrong_import(tmp_path: Path, rel: str, text: str, expected: str) -> None:
    bad = violations(_tree(tmp_path, {**_CLEAN, rel: text}))
    assert len(bad) == 1 and expected in bad[0], bad
    assert f"kvtier.{rel[:-3].replace('/', '.')}" in bad[0]


def test_checker_fails_the_real_tree_with_one_wrong_import(tmp_path: Path) -> None:
    """A copy of src/kvtier with one import from the native engine into the vLLM host fails on
    exactly that line."""
    shutil.copytree(SRC / "kvtier", tmp_path / "kvtier", ignore=shutil.ignore_patterns("*.pyc"))
    engine = tmp_path / "kvtier" / "native" / "engine.py"
    text = engine.read_text()
    engine.write_text(text + "\n\ndef _wrong() -> None:\n    from kvtier.vllm import connector\n")
    bad = violations(tmp_path)
    line = len(text.splitlines()) + 4
    assert bad == [
        f"kvtier.native.engine (line {line}) imports kvtier.vllm.connector: native may import "
        f"only {sorted(MAY_IMPORT['native'])}"
    ]


_TESTS_LAZY_PATH = re.compile(r"^tests(?:\.\w+)+:\w+$")


def imports_of_tests(root: Path) -> list[str]:
    """Every place under `root/kvtier` that imports the test tree (`tests`, `tests.x`, or a lazy
    `"tests.x:attr"` path): the fault harness and the redis launcher live there, never in kvtier."""
    found: list[str] = []
    for path in sorted((root / "kvtier").rglob("*.py")):
        module = module_name(root, path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = [node.value] if _TESTS_LAZY_PATH.match(node.value) else []
            found += [
                f"{module} (line {node.lineno}) imports {name}"
                for name in names
                if name == "tests" or name.startswith("tests.")
            ]
    return found


def test_src_never_imports_the_tests() -> None:
    assert imports_of_tests(SRC) == []


def test_an_import_of_the_tests_is_found(tmp_path: Path) -> None:
    files = {
        **_CLEAN,
        "bench/tier.py": "def f():\n    from tests.redis_local import RedisServer\n",
        "cli.py": "CMD = 'tests.faults.inject:build_connector'\n",
    }
    assert imports_of_tests(_tree(tmp_path, files)) == [
        "kvtier.bench.tier (line 2) imports tests.redis_local",
        "kvtier.cli (line 1) imports tests.faults.inject:build_connector",
    ]


def bench_cycles(root: Path) -> list[list[str]]:
    """Import cycles among the modules of kvtier.bench (lazy imports included)."""
    graph: dict[str, set[str]] = {}
    for imp in all_imports(root):
        if imp.importer.startswith("kvtier.bench.") and imp.target.startswith("kvtier.bench."):
            graph.setdefault(imp.importer, set()).add(imp.target)
    cycles: list[list[str]] = []

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif len(path) < len(graph) + 1:
                walk(nxt, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return cycles


def test_bench_modules_import_no_cycle() -> None:
    assert bench_cycles(SRC) == []


def test_a_bench_cycle_is_found(tmp_path: Path) -> None:
    bench = tmp_path / "kvtier" / "bench"
    bench.mkdir(parents=True)
    (bench / "__init__.py").write_text("")
    (bench / "a.py").write_text("from kvtier.bench.b import x\n")
    (bench / "b.py").write_text("def f():\n    from kvtier.bench.a import y\n")
    assert ["kvtier.bench.a", "kvtier.bench.b", "kvtier.bench.a"] in bench_cycles(tmp_path)
