"""`kvtier bench load-cost --disk DIR`: the disk tier on a device slower than the prefill, made
from real parts (`bench/disk_throttle.py`: a block-I/O cgroup caps this process's reads of the
device, the tier files' page cache dropped before each restore), and the native engine
restoring prompts from it under each load policy.

1. A writer engine serves every prompt once; its disk tier writes them behind.
2. Fresh engines, open side by side (an empty memory tier each; `cost` and `always` each on a
   copy of the written disk tier, as one live process holds a disk directory), restore the
   prompts one at a time, interleaved, each prompt's time to its first token measured: no
   offload (twice: the A/A pair), `load_policy: cost`, `always`.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench.disk_throttle import ThrottledDisk
from kvtier.bench.e2e import ensure_model, model_config
from kvtier.bench.loadcost import (
    QUICK,
    Arm,
    Plan,
    policy_arms,
    policy_rows,
    prompts_of,
    write_behind,
)
from kvtier.bench.table import Report, Row, Target, write_json
from kvtier.config import KVTierConfig

QUICK_RATE = 512 * 2**10  # bytes/s
DISK_PROBE_FACTOR = 3.0


def run(
    directory: Path | None = None,
    *,
    quick: bool = False,
    model_dir: Path | None = None,
    json_path: Path | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The whole bench (see the module) with the disk tier in `directory` (default: a fresh
    one under the system's temporary directory); the report, also written as JSON."""
    plan = QUICK if quick else Plan()
    # the quick form's tiny model computes its 96-token prompts in tens of ms, as long as a
    # 4 MiB/s read of their few chunks takes on a busy machine: its disk is slower still
    rate = QUICK_RATE if quick else plan.slow_bytes_per_s
    model = ensure_model(model_dir, plan.model_preset)
    vocab = int(model_config(model)["vocab_size"])
    with tempfile.TemporaryDirectory(prefix="kvtier-load-cost-disk-", dir=directory) as root:
        # the throttle and its page-cache drops cover both copies of the tier
        throttle = ThrottledDisk(Path(root), rate)  # refuses a tmpfs before any run
        tier, copy = Path(root) / "cost", Path(root) / "always"

        def kv(directory: Path, **extra: Any) -> KVTierConfig:
            # the always arm's restores each wait about a second on the throttled disk, so a
            # round of the four arms takes twice the store bench's: a 3x longer probe interval
            # keeps about one probe in the run (each probe is a slow load the verdict counts)
            extra.setdefault("load_probe_s", DISK_PROBE_FACTOR * plan.probe_s)
            return KVTierConfig(
                chunk_size=plan.chunk, memory_bytes="64MiB", disk_dir=str(directory),
                disk_bytes="256MiB", lookup_timeout_ms=2000, **extra,
            )  # fmt: skip

        restore = prompts_of(plan.prompts, plan.prompt_tokens, vocab, 1)
        progress(f"writer: {len(restore)} prompts of {plan.prompt_tokens} tokens to {tier}")
        write_behind(model, kv(tier), restore)
        shutil.copytree(tier, copy)
        progress(f"restores read the disk at {rate / 2**20:g} MiB/s")
        with throttle:
            arms = policy_arms(
                model, restore, kv(tier), kv(copy, load_policy="always"), progress,
                throttle.drop_cache,
            )  # fmt: skip
    doc = _report(plan, arms, rate).to_json()
    write_json(json_path or Path("runs") / "bench-load-cost-disk.json", doc)
    return doc


def _report(plan: Plan, arms: dict[str, Arm], rate: float) -> Report:
    r = Report("load-cost-disk", "kvtier bench load-cost --disk: load or recompute, slow disk")
    note = (
        f"({plan.prompts} prompts of {plan.prompt_tokens} tokens, each restored alone by a "
        f"fresh engine from a disk tier read at {rate / 2**20:g} MiB/s)"
    )
    mism = policy_rows(r, arms, prefix="disk", tier="disk", slow="slow disk", note=note)
    r.add(Row("disk.outputs.mismatches", "first tokens unequal to no offload's (every arm, same "
              "batch shape)", mism, "prompts", target=Target("value", "<=", 0)))  # fmt: skip
    return r
