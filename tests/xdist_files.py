"""How `make test` spreads the suite over pytest-xdist workers: a test file is one unit (its
module fixtures, a vLLM run or a server, are built once), files that share an expensive session
fixture are one unit, and the slowest units go first, so the run ends on short tests and both
workers finish together.

xdist's own `--dist loadgroup` groups nothing under pytest 9 (it renames `item._nodeid`, which
pytest 9 no longer reads), so the grouping is a scheduler of our own
(`pytest_xdist_make_scheduler` in tests/conftest.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from xdist.scheduler import LoadScopeScheduling

if TYPE_CHECKING:
    from xdist.workermanage import WorkerController

# files whose tests use the `vllm_served` session fixture (a vLLM server's two passes, ~30 s):
# one unit, so one worker builds it (tests/test_xdist_files.py keeps this list true)
SHARED_UNITS = {
    "tests/deploy/test_deploy.py": "vllm_served",
    "tests/vllm/test_serve_vllm.py": "vllm_served",
    "tests/vllm/test_parity_vllm.py": "vllm_served",
}
# the slowest units (the durations every run prints), longest first; the rest keep their order
SLOW_FIRST = (
    "tests/bench/test_e2e_vllm.py",
    "tests/test_installs.py",
    "tests/vllm/test_dp2_vllm.py",
    "tests/vllm/test_state_hybrid_vllm.py",
    "tests/vllm/test_hybrid_vllm.py",
    "vllm_served",
    "tests/native/test_clients.py",
    "tests/vllm/test_tp2_vllm.py",
    "tests/vllm/test_lifecycle_vllm.py",
    "tests/bench/test_bench_tier.py",
    "tests/vllm/test_abort_vllm.py",
    "tests/bench/test_e2e.py",
    "tests/native/test_shared_tier.py",
    "tests/vllm/test_pd_vllm.py",
    "tests/vllm/test_load_cost_vllm.py",
    "tests/bench/test_loadcost.py",
    "tests/faults/test_fault_suite.py",
    "tests/native/test_faults.py",
    "tests/store/test_remote_cluster.py",
    "tests/native/test_fuzz_api.py",
)


def unit_of(nodeid: str) -> str:
    """The scheduling unit of a test: its file, or the shared unit its file belongs to."""
    path = nodeid.split("::", 1)[0]
    return SHARED_UNITS.get(path, path)


class FileScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with test files (and shared units) as scopes, slowest first."""

    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid)

    def _assign_work_unit(self, node: WorkerController) -> None:
        # the queue is whole at the first assignment (inside `schedule`): order it once
        if not self._ordered:
            self._ordered = True
            rank = {unit: i for i, unit in enumerate(SLOW_FIRST)}
            units = sorted(self.workqueue.items(), key=lambda kv: rank.get(kv[0], len(rank)))
            self.workqueue.clear()
            self.workqueue.update(units)
        super()._assign_work_unit(node)
