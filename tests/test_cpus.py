"""CPU lists parse as vLLM writes them, bad ones name the value and the fix, and `lane_cpus`
picks the host's cores minus the compute cores, or nothing when none are left."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier import cpus
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.vllm.cpu_binding import compute_cpus


def test_lists_and_ranges_parse() -> None:
    assert cpus.parse_cpu_list("0") == {0}
    assert cpus.parse_cpu_list("5,2-4") == {2, 3, 4, 5}
    assert cpus.parse_cpu_list(" 0-1 , 6 ") == {0, 1, 6}
    assert cpus.describe(frozenset({0, 1, 2, 5, 7, 8})) == "0-2,5,7-8"
    assert cpus.describe(None) == "unpinned"


@pytest.mark.parametrize("bad", ["", "x", "3-1", "-1", "1,,2", "0-"])
def test_a_bad_list_names_the_value_and_the_fix(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"lane_cpus .* write ids and ranges such as '1'"):
        KVTierConfig(lane_cpus=bad)


def test_auto_is_the_host_minus_the_compute_cores_or_nothing() -> None:
    host = frozenset(range(4))
    assert cpus.lane_cpus("auto", frozenset({0, 1}), host) == {2, 3}
    assert cpus.lane_cpus("auto", host, host) is None
    # a lone free core is the frontend's (API server, scheduler): lanes there cost vLLM 5.6%
    # of its no-reuse throughput on 2 cores, so they stay with the compute threads
    assert cpus.lane_cpus("auto", frozenset({0}), frozenset({0, 1})) is None
    assert cpus.lane_cpus("auto", frozenset({0, 1, 2}), host) is None
    assert cpus.lane_cpus("auto", None, host) is None
    assert cpus.lane_cpus("inherit", frozenset({0}), host) is None
    assert cpus.lane_cpus("1", frozenset({1}), host) == {1}


def test_host_cpus_are_the_cgroups_within_the_parents_plus_the_callers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpuset = tmp_path / "cpuset.cpus.effective"
    cpuset.write_text("0-7\n")
    monkeypatch.setattr(cpus, "_CGROUP_CPUSETS", (tmp_path / "absent", cpuset))
    parent = os.getppid()
    # a server started under `taskset -c 2-5` whose worker thread is bound to core 2
    given = {0: {2}, parent: {2, 3, 4, 5, 9}}

    def affinity(pid: int) -> set[int]:
        if pid not in given:
            raise ProcessLookupError(pid)
        return given[pid]

    monkeypatch.setattr(cpus.os, "sched_getaffinity", affinity)
    assert cpus.host_cpus() == {2, 3, 4, 5}
    del given[parent]  # a parent gone: the cgroup alone bounds the lanes
    assert cpus.host_cpus() == set(range(8))
    monkeypatch.setattr(cpus, "_CGROUP_CPUSETS", (tmp_path / "absent",))
    assert cpus.host_cpus() == set(range(os.cpu_count() or 1)) | {2}


def test_vllm_compute_cores_come_from_its_binding() -> None:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1|4"}
    assert compute_cpus(env, is_cpu=True, ranks_on_host=2) == {0, 1, 4}
    assert compute_cpus(env, is_cpu=False, ranks_on_host=2) is None
    nobind = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert compute_cpus(nobind, is_cpu=True, ranks_on_host=1) is None
    own = frozenset({3})
    # 'auto' (the default): the worker's own binding, when no other local rank has cores
    assert compute_cpus({}, is_cpu=True, ranks_on_host=1, own_cpus=lambda: own) == own
    assert compute_cpus({}, is_cpu=True, ranks_on_host=2, own_cpus=lambda: own) is None
    with pytest.raises(ConfigError, match="VLLM_CPU_OMP_THREADS_BIND '0-x'"):
        compute_cpus({"VLLM_CPU_OMP_THREADS_BIND": "0-x"}, is_cpu=True, ranks_on_host=1)
