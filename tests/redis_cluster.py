"""A real Redis Cluster on loopback for the shared-tier tests: three masters, three replicas,
started by the tests themselves (`redis-server --cluster-enabled yes` + `redis-cli --cluster
create`). One cluster per test module: import `redis_cluster` into the module as a fixture.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_local import LocalCluster


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[LocalCluster]:
    """The module's cluster (3 masters + 3 replicas, 1 s node timeout)."""
    with LocalCluster(masters=3, replicas=1) as cluster:
        yield cluster


def flush(cluster: LocalCluster) -> None:
    """Empty every master (replicas follow)."""
    for master in cluster.masters():
        admin = cluster.node(master).client()
        try:
            admin.flushall()
        finally:
            admin.close()


def command_calls(cluster: LocalCluster, addr: str, command: str) -> int:
    """How often node `addr` ran `command` since its stats were last reset."""
    admin = cluster.node(addr).client()
    try:
        stats = admin.info("commandstats")
    finally:
        admin.close()
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def reset_stats(cluster: LocalCluster) -> None:
    """CONFIG RESETSTAT on every live node."""
    for node in cluster.live():
        admin = node.client()
        try:
            admin.config_resetstat()
        finally:
            admin.close()
