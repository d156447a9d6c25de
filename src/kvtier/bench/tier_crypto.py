"""`kvtier bench tier` rows for encryption at rest: the disk and remote tiers' put and get of
4 MiB chunks with `encrypt_at_rest` (AES-GCM) next to the same tiers authenticating only (a
keyed BLAKE3 tag, the default), under one secret, interleaved rep by rep. Target: encrypted at
least 0.7x of authenticated-only."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvtier.bench.table import Report, Target
from kvtier.bench.tier_common import Keys, Plan, Progress, gbps_row, interleave
from kvtier.config import mask_url
from kvtier.keys import digest16
from kvtier.metrics import Metrics
from kvtier.store.disk import DiskTier
from kvtier.store.record import HEADER_BYTES, RecordCodec, RecordKeys
from kvtier.store.remote import RemoteTier

ENC_CHUNK = 4 << 20
ENC_RATIO_TARGET = 0.7
_NS = digest16("kvtier.bench.tier.crypto", ("ns",))


def bench_encryption(
    report: Report, plan: Plan, disk_root: Path, remote_url: str | None, say: Progress
) -> None:
    """Add the encrypted-vs-authenticated rows of the disk tier and, with `remote_url`, of the
    remote tier on that store (the records it wrote deleted after)."""
    keys = RecordKeys.derive(secrets.token_bytes(32))
    codecs = {"plain": RecordCodec(_NS, keys), "enc": RecordCodec(_NS, keys, encrypt=True)}
    payload = np.random.default_rng(7).integers(0, 256, ENC_CHUNK, dtype=np.uint8)
    note = report.note(
        "encrypted = AES-GCM (encrypt_at_rest: true; fresh nonce per record, the header as "
        "associated data), raw = the same tier authenticating only (a keyed BLAKE3 tag, the "
        "default); both under one secret, 4 MiB chunks, interleaved rep by rep"
    )
    rounds = plan.disk_warmup + plan.disk_reps
    disk_root.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench-crypto-", dir=disk_root))
    say(f"encryption at rest: disk tier put + get, {rounds} rounds ({root})")
    try:
        budget = plan.disk_files * (ENC_CHUNK + HEADER_BYTES)
        tiers = {n: DiskTier(root / n, budget, _NS, Metrics(0), codec=c) for n, c in codecs.items()}
        try:
            puts, gets = _put_get(tiers, payload, plan, lambda t, k: t.get(k))
        finally:
            for t in tiers.values():
                t.close()
    finally:
        shutil.rmtree(root)
    _rows(report, "disk", f"disk {note}", puts, gets)
    if remote_url is None:
        return
    say(f"encryption at rest: remote tier put + get on {mask_url(remote_url)}")
    dst = torch.empty(ENC_CHUNK, dtype=torch.uint8)
    tiers_r = {n: RemoteTier(remote_url, _NS, Metrics(0), payload_bytes=ENC_CHUNK, codec=c,
                             timeout_ms=2000, write_timeout_ms=5000)
               for n, c in codecs.items()}  # fmt: skip
    written: dict[str, list[bytes]] = {}
    try:
        puts, gets = _put_get(
            tiers_r, payload, plan, lambda t, k: t.read_into(k, dst) or None, written
        )
    finally:
        for name, t in tiers_r.items():
            # the user's store: leave none of the bench's records behind
            for key in set(written.get(name, ())):
                t.delete(key)
            t.close()
    _rows(report, "remote", "remote", puts, gets)


def _put_get(
    tiers: dict[str, DiskTier] | dict[str, RemoteTier],
    payload: np.ndarray,
    plan: Plan,
    read: Callable[..., object],
    written: dict[str, list[bytes]] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Interleaved puts, then reads of the last record, per tier; both read back checked.
    `written` (filled per tier name) collects the keys put, for the caller to delete."""
    import time

    view = memoryview(payload)
    written = {} if written is None else written
    written.update({n: [] for n in tiers})
    keys = Keys("crypto")

    def put(name: str) -> Callable[[], float]:
        def run() -> float:
            key = keys.next()
            t = time.perf_counter()
            ok = tiers[name].put(key, view)  # type: ignore[attr-defined]
            dt = time.perf_counter() - t
            if not ok:
                raise RuntimeError(f"the {name} tier refused a put")
            written[name].append(key)
            return dt

        return run

    def get(name: str) -> Callable[[], float]:
        def run() -> float:
            t = time.perf_counter()
            got = read(tiers[name], written[name][-1])
            dt = time.perf_counter() - t
            if got is None:
                # a tier degrades a failed read to a miss: say which failures can cause it
                raise RuntimeError(
                    f"the {name} tier missed the record it just stored: a read that timed out, "
                    "a store failure or a record that failed verification reads as a miss (the "
                    "log line above names which); on a busy machine or store, rerun when it is "
                    "quieter"
                )
            return dt

        return run

    rounds = plan.disk_warmup + plan.disk_reps
    puts = interleave({n: put(n) for n in tiers}, plan.disk_warmup, rounds)
    gets = interleave({n: get(n) for n in tiers}, plan.disk_warmup, rounds)
    for name, tier in tiers.items():
        back = tier.get(written[name][-1])  # type: ignore[attr-defined]
        if back is None or bytes(back) != payload.tobytes():
            raise RuntimeError(f"the {name} tier read back other bytes than were stored")
    return puts, gets


def _rows(
    report: Report,
    tier: str,
    label: str,
    puts: dict[str, list[float]],
    gets: dict[str, list[float]],
) -> None:
    target = Target("ratio", ">=", ENC_RATIO_TARGET)
    gbps_row(report, f"{tier}.write.put_encrypted", f"{label}: put, encrypted", ENC_CHUNK,
              puts["enc"], puts["plain"], target)  # fmt: skip
    gbps_row(report, f"{tier}.read.get_encrypted", f"{tier}: get, encrypted", ENC_CHUNK,
              gets["enc"], gets["plain"], target)  # fmt: skip
