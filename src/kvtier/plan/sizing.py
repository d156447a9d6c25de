"""The plan itself: the model's bytes per token per rank, the HBM pool and the tier in tokens,
the workload's reuse against the window, fill times and the break-even read bandwidth."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.cachemodel.reuse import ReuseProfile
from kvtier.errors import ConfigError, LayoutError
from kvtier.layout import KVGeometry, bytes_per_token_from_hf, normalize_dtype
from kvtier.plan.hybrid import tier_bytes_per_token
from kvtier.plan.window import (
    ABOVE_TIER,
    TraceCeilings,
    Verdict,
    trace_ceilings,
    window_verdict,
)
from kvtier.plan.workload import SyntheticWorkload, Trace, Workload, check_int, trace_reuse_profile

GB = 10**9


@dataclass(frozen=True, slots=True)
class PlanResult:
    """Everything `kvtier plan` reports; sizes are per rank unless a name says otherwise."""

    model: str
    geometry: KVGeometry
    block_size: int
    hbm_pool_tokens: int
    hbm_from: str  # "--hbm-tokens" or "--hbm-bytes"
    tier_bytes: int
    tier_tokens: int
    workload: Workload
    reuse_distance_tokens: int | None  # synthetic: the pool's; trace: the median
    reuse_p90_tokens: int | None
    reusable_tokens: int
    verdict: Verdict
    store_gbps: float
    prefill_tokens_per_s: float | None
    profile: ReuseProfile | None = None
    ceilings: TraceCeilings | None = None
    ceiling_note: str = ""
    warnings: tuple[str, ...] = field(default_factory=tuple)
    # bytes the tier stores per cached token (a sliding-window hybrid stores less; 0: the same)
    tier_bytes_per_token: int = 0
    chunk_size: int = 256

    @property
    def state_records(self) -> int:
        """Chunk-sized records one stored boundary's state takes on a rank (0: no state layers):
        a state hybrid stores its state layers' state once per boundary, beside the chunks."""
        g = self.geometry
        if not g.state_bytes:
            return 0
        return -(-g.state_bytes // max(1, self.chunk_size * self.tier_token_bytes))

    @property
    def tier_token_bytes(self) -> int:
        """Per-rank bytes the tier stores per cached token."""
        return self.tier_bytes_per_token or self.bytes_per_token

    @property
    def bytes_per_token(self) -> int:
        """KV bytes per token on one rank."""
        return self.geometry.bytes_per_token

    @property
    def total_bytes_per_token(self) -> int:
        """KV bytes per token over every TP rank (replicated copies included)."""
        return self.geometry.total_bytes_per_token

    @property
    def hbm_pool_bytes(self) -> int:
        """Bytes of the HBM pool on one rank."""
        return self.hbm_pool_tokens * self.bytes_per_token

    @property
    def tier_bytes_all_ranks(self) -> int:
        """Host memory the tier pins over all TP ranks (check it against each NUMA node)."""
        return self.tier_bytes * self.geometry.tp_size

    @property
    def reusable_bytes(self) -> int:
        """Per-rank bytes of the reusable working set: what the tier should hold."""
        return self.reusable_tokens * self.tier_token_bytes

    @property
    def tier_over_reusable(self) -> float | None:
        """Tier size over the reusable working set (None when nothing is reusable)."""
        return self.tier_bytes / self.reusable_bytes if self.reusable_bytes else None

    @property
    def tier_fill_s(self) -> float:
        """Seconds to fill the whole tier at the store bandwidth."""
        return self.tier_bytes / (self.store_gbps * GB)

    @property
    def working_set_fill_s(self) -> float:
        """Seconds before steady-state reuse: the reusable set (at most the tier) stored once."""
        return min(self.reusable_bytes, self.tier_bytes) / (self.store_gbps * GB)

    @property
    def break_even_gbps(self) -> float | None:
        """Per-rank read GB/s at which loading a token costs as much as recomputing it: the
        bytes a load reads per token (what the tier stores of it) times the prefill rate."""
        if self.prefill_tokens_per_s is None:
            return None
        return self.tier_token_bytes * self.prefill_tokens_per_s / GB

    def to_json(self) -> dict[str, Any]:
        """Every quantity as plain JSON (bytes in B, bandwidths in GB/s, times in s)."""
        g = self.geometry
        return {
            "model": self.model,
            "kind": g.kind,
            "num_layers": g.num_layers,
            "kv_dtype": g.kv_dtype,
            "tp": g.tp_size,
            "block_size": self.block_size,
            "bytes_per_token_per_rank": self.bytes_per_token,
            "bytes_per_token_all_ranks": self.total_bytes_per_token,
            "tier_bytes_per_token_per_rank": self.tier_token_bytes,
            "replicated_across_tp": g.replicated_across_tp,
            "hbm_pool_tokens": self.hbm_pool_tokens,
            "hbm_pool_bytes": self.hbm_pool_bytes,
            "hbm_from": self.hbm_from,
            "tier_bytes": self.tier_bytes,
            "tier_tokens": self.tier_tokens,
            "tier_bytes_all_ranks": self.tier_bytes_all_ranks,
            "workload": self.workload.to_json(),
            "reuse_distance_tokens": self.reuse_distance_tokens,
            "reuse_p90_tokens": self.reuse_p90_tokens,
            "reuse_profile": self.profile.to_json() if self.profile else None,
            "window": {"hbm_pool_tokens": self.hbm_pool_tokens, "tier_tokens": self.tier_tokens},
            "verdict": self.verdict.to_json(),
            "reusable_tokens": self.reusable_tokens,
            "reusable_bytes": self.reusable_bytes,
            "tier_over_reusable": self.tier_over_reusable,
            "store_gbps": self.store_gbps,
            "tier_fill_s": self.tier_fill_s,
            "working_set_fill_s": self.working_set_fill_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "break_even_gbps": self.break_even_gbps,
            "ceilings": self.ceilings.to_json() if self.ceilings else None,
            "ceiling_note": self.ceiling_note,
            "warnings": list(self.warnings),
        }


def plan(
    config: Mapping[str, object],
    *,
    tier_bytes: int,
    workload: Workload,
    model: str = "",
    kv_dtype: str = "auto",
    tp: int = 1,
    block_size: int = 16,
    hbm_tokens: int | None = None,
    hbm_bytes: int | None = None,
    store_gbps: float = 5.0,
    prefill_tokens_per_s: float | None = None,
    index_dtype: str = "fp8",
    include_mtp: bool = False,
    chunk_size: int = 256,
) -> PlanResult:
    """Size the pool and tier of `config` (an HF config dict) for `workload`; pure, no I/O.

    The HBM pool is per rank, as `hbm_tokens` or as `hbm_bytes` (rounded down to whole
    `block_size` blocks); `tier_bytes` is per rank. Raises ConfigError/LayoutError naming the flag.
    """
    _check_flags(tp, block_size, tier_bytes, store_gbps, prefill_tokens_per_s)
    check_int("--chunk-size", chunk_size, 1)
    geometry = _geometry(config, model, tp, kv_dtype, index_dtype, include_mtp)
    bpt = geometry.bytes_per_token
    hbm_pool, hbm_from = _hbm_pool_tokens(hbm_tokens, hbm_bytes, bpt, block_size)
    # a sliding-window hybrid's records hold only the window of its sliding layers
    tier_bpt = tier_bytes_per_token(config, geometry, chunk_size=chunk_size, block_size=block_size)
    tier_tokens = tier_bytes // tier_bpt
    if tier_tokens == 0:
        raise ConfigError(
            f"--tier-bytes {tier_bytes} holds no token of {tier_bpt:,} bytes per rank; give at "
            f"least {tier_bpt} bytes, e.g. 64GiB"
        )
    reuse = _reuse(workload, hbm_pool, tier_tokens)
    # the bytes a tier needs for a reuse are those it stores per token (a hybrid's are fewer)
    verdict = window_verdict(reuse.distance, hbm_pool, tier_tokens, tier_bpt)
    return PlanResult(
        model=model,
        geometry=geometry,
        block_size=block_size,
        hbm_pool_tokens=hbm_pool,
        hbm_from=hbm_from,
        tier_bytes=tier_bytes,
        tier_tokens=tier_tokens,
        workload=workload,
        reuse_distance_tokens=reuse.distance,
        reuse_p90_tokens=reuse.p90,
        reusable_tokens=reuse.reusable,
        verdict=verdict,
        store_gbps=float(store_gbps),
        prefill_tokens_per_s=(
            None if prefill_tokens_per_s is None else float(prefill_tokens_per_s)
        ),
        profile=reuse.profile,
        ceilings=reuse.ceilings,
        ceiling_note=reuse.note,
        warnings=_warnings(verdict, hbm_pool, tier_tokens, tier_bytes, reuse.reusable * tier_bpt),
        chunk_size=chunk_size,
        tier_bytes_per_token=tier_bpt if tier_bpt != bpt else 0,
    )


def _check_flags(
    tp: int,
    block_size: int,
    tier_bytes: int,
    store_gbps: float,
    prefill_tokens_per_s: float | None,
) -> None:
    check_int("--tp", tp, 1)
    check_int("--block-size", block_size, 1)
    check_int("--tier-bytes", tier_bytes, 1)
    if not (isinstance(store_gbps, int | float) and math.isfinite(store_gbps) and store_gbps > 0):
        raise ConfigError(f"--store-gbps {store_gbps!r} must be a number of GB/s > 0, e.g. 5")
    if prefill_tokens_per_s is not None and not (
        isinstance(prefill_tokens_per_s, int | float)
        and math.isfinite(prefill_tokens_per_s)
        and prefill_tokens_per_s > 0
    ):
        raise ConfigError(
            f"--prefill-tokens-per-s {prefill_tokens_per_s!r} must be a rate > 0, e.g. 14000"
        )


def _geometry(
    config: Mapping[str, object],
    model: str,
    tp: int,
    kv_dtype: str,
    index_dtype: str,
    include_mtp: bool,
) -> KVGeometry:
    """The KV geometry of `config` at `tp`; errors name the flag to change."""
    for flag, name in (("--kv-dtype", kv_dtype), ("--index-dtype", index_dtype)):
        if name != "auto" or flag != "--kv-dtype":
            try:
                normalize_dtype(name)
            except LayoutError as exc:
                raise ConfigError(f"{flag}: {exc}") from exc
    try:
        return bytes_per_token_from_hf(
            config, tp_size=tp, kv_dtype=kv_dtype, index_dtype=index_dtype, include_mtp=include_mtp
        )
    except LayoutError as exc:
        raise LayoutError(
            f"--model {model or '(config)'}: {exc} (check --kv-dtype, --tp and the config)"
        ) from exc


@dataclass(frozen=True, slots=True)
class _Reuse:
    """The workload's reuse: distance (synthetic: the pool's; trace: the median), p90, the
    reusable tokens, and for a trace its profile and ceilings; `note` says how ceilings came."""

    distance: int | None
    p90: int | None
    reusable: int
    note: str
    profile: ReuseProfile | None = None
    ceilings: TraceCeilings | None = None


def _reuse(workload: Workload, hbm_pool: int, tier_tokens: int) -> _Reuse:
    if isinstance(workload, SyntheticWorkload):
        return _Reuse(
            workload.reuse_distance_tokens,
            None,
            workload.reusable_tokens,
            "not simulated: a synthetic pool has no request stream; pass --trace, or measure "
            "with kvtier bench e2e",
        )
    if isinstance(workload, Trace):
        profile = trace_reuse_profile(workload, hbm_pool, tier_tokens)
        ceilings, note = trace_ceilings(workload, hbm_pool, tier_tokens)
        return _Reuse(profile.median, profile.p90, profile.reusable_tokens, note, profile, ceilings)
    raise ConfigError(
        f"workload {workload!r} is neither a SyntheticWorkload nor a Trace; "
        "pass --prefixes/--prefix-len or --trace"
    )


def _warnings(
    verdict: Verdict, hbm_pool: int, tier_tokens: int, tier_bytes: int, reusable_bytes: int
) -> tuple[str, ...]:
    warnings: list[str] = []
    if tier_tokens <= hbm_pool:
        warnings.append(
            f"the tier ({tier_tokens:,} tokens) is no larger than the HBM pool ({hbm_pool:,} "
            "tokens): the window (HBM pool, tier] is empty, so the tier can never hit; "
            "raise --tier-bytes or lower the HBM pool"
        )
    if verdict.bad:
        warnings.append(verdict.message)
    if verdict.kind != ABOVE_TIER and reusable_bytes > tier_bytes:
        warnings.append(
            f"the tier ({tier_bytes:,} B) is smaller than the reusable working set "
            f"({reusable_bytes:,} B per rank): expect evictions of reusable prefixes"
        )
    return tuple(warnings)


def _hbm_pool_tokens(
    hbm_tokens: int | None, hbm_bytes: int | None, bpt: int, block_size: int
) -> tuple[int, str]:
    if hbm_tokens is not None and hbm_bytes is not None:
        raise ConfigError(
            f"the HBM pool is given twice (--hbm-tokens {hbm_tokens} and --hbm-bytes "
            f"{hbm_bytes}); pass only one of them"
        )
    if hbm_tokens is not None:
        check_int("--hbm-tokens", hbm_tokens, 1)
        return hbm_tokens, "--hbm-tokens"
    if hbm_bytes is not None:
        check_int("--hbm-bytes", hbm_bytes, 1)
        block_bytes = bpt * block_size
        blocks = hbm_bytes // block_bytes
        if blocks == 0:
            raise ConfigError(
                f"--hbm-bytes {hbm_bytes} holds no block of {block_size} tokens x {bpt:,} bytes "
                f"per rank ({block_bytes:,} B); give the KV pool per rank, e.g. 80GiB"
            )
        return blocks * block_size, "--hbm-bytes"
    raise ConfigError(
        "the HBM pool is missing; pass --hbm-tokens N (KV-cache tokens per rank, e.g. "
        "num_gpu_blocks x block_size) or --hbm-bytes SIZE (KV pool bytes per rank, e.g. 80GiB)"
    )
