"""Cache-hit ceilings simulated on the exact requests sent, in send order.

Three numbers, each as hit tokens over prompt tokens:

* HBM alone: an LRU of `hbm_blocks` blocks of `block_size` tokens named by chained prefix hashes,
  each prompt touched tail first (the OFF arm's prediction: the engine's own prefix cache);
* HBM + tier: the same HBM in front of the offline-optimal tier of `tier_chunks` chunks of
  `chunk_size` tokens (Belady over the prompts' chunk chains, `kvtier.cachemodel.optimum`): no
  tier policy of that size serves more of its own chunks;
* infinite: every block ever computed stays (a hard upper bound on any arm);

and, given the tier's admission mode, one prediction that is no bound:

* kvtier: the same HBM in front of kvtier's own tier of that size, the real `TierStack` and
  admission policy driven as the scheduler and worker drive them (`kvtier.cachemodel.predict`):
  what the ON arm should read, so a live run that falls short of it says where to look.

The rules follow the engine and kvtier: a hit never covers the last prompt token (it is computed
to get logits), the tier counts whole leading chunks, a load starts at the HBM floor and counts
`min(tier hit, n - 1) - HBM hit` tokens, and loads shorter than `min_load_tokens` are skipped.
Requests run one at a time: concurrency can only lose hits that a sequential run would find.

Given each request's output ids, the HBM also keeps the full blocks of the generated tokens
(prompt + output minus the last token, whose KV is never computed), as vLLM and the native
engine do, so a next turn that starts with prompt + output finds them; the tier stores prompt
chunks only. `counted` limits the totals to some requests (a start-cut window) while every
request still warms the caches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.bench.workload import check_positive
from kvtier.cachemodel.optimum import optimal_leading
from kvtier.cachemodel.predict import drive_tier
from kvtier.cachemodel.stream import ChainIds, ChainLRU, from_prompts
from kvtier.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Ceiling:
    """Hit tokens of one simulated cache over a request stream."""

    name: str
    requests: int
    prompt_tokens: int
    hbm_hit_tokens: int
    external_hit_tokens: int = 0

    @property
    def hit_tokens(self) -> int:
        """HBM plus tier hits."""
        return self.hbm_hit_tokens + self.external_hit_tokens

    @property
    def hit_rate(self) -> float:
        """All hits over prompt tokens (0.0 for an empty stream)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def hbm_rate(self) -> float:
        """HBM hits over prompt tokens."""
        return self.hbm_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def external_rate(self) -> float:
        """Tier hits over prompt tokens."""
        return self.external_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict[str, object]:
        """Counts and rates as plain JSON."""
        return {
            "name": self.name,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "hbm_hit_tokens": self.hbm_hit_tokens,
            "external_hit_tokens": self.external_hit_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_rate,
            "hbm_rate": self.hbm_rate,
            "external_rate": self.external_rate,
        }


def simulate(
    prompts: Iterable[Sequence[int]],
    *,
    block_size: int,
    hbm_blocks: int | None,
    chunk_size: int | None = None,
    tier_chunks: int = 0,
    min_load_tokens: int = 0,
    name: str = "",
    outputs: Iterable[Sequence[int]] | None = None,
    counted: Iterable[bool] | None = None,
    policy: str | None = None,
    step_tokens: int | None = None,
) -> Ceiling:
    """Replay `prompts` in order through an HBM LRU (`hbm_blocks` None: unbounded) and, when
    `chunk_size` and `tier_chunks` are given, a chunk tier behind it: the offline optimum, or
    with `policy` (an admission mode) kvtier's real tier.

    `outputs` (one id sequence per prompt) puts each request's generated blocks in HBM too;
    `counted` (one flag per prompt) counts only the flagged requests in the totals;
    `step_tokens` (the engine's token budget per step) saves a long prefill step by step."""
    check_positive(block_size=block_size)
    if hbm_blocks is not None and hbm_blocks < 0:
        raise ConfigError(f"hbm_blocks={hbm_blocks} is negative; use 0 or more blocks")
    if tier_chunks < 0 or min_load_tokens < 0:
        raise ConfigError(
            f"tier_chunks={tier_chunks}, min_load_tokens={min_load_tokens}: use values >= 0"
        )
    use_tier = tier_chunks > 0
    if use_tier:
        if chunk_size is None:
            raise ConfigError("a tier needs chunk_size; pass chunk_size= with tier_chunks=")
        check_positive(chunk_size=chunk_size)
        if chunk_size % block_size:
            raise ConfigError(
                f"chunk_size={chunk_size} is not a multiple of block_size={block_size}"
            )
    hbm, blocks = ChainLRU(hbm_blocks), ChainIds(block_size)
    stream = [list(p) for p in prompts]
    outs: list[Sequence[int] | None] = [None] * len(stream) if outputs is None else list(outputs)
    flags = [True] * len(stream) if counted is None else list(counted)
    if len(outs) != len(stream) or len(flags) != len(stream):
        raise ConfigError(
            f"{len(outs)} outputs and {len(flags)} counted flags for {len(stream)} prompts; "
            "give exactly one of each per prompt"
        )
    for i, prompt in enumerate(stream):
        if not prompt:
            raise ConfigError(f"request {i} has an empty prompt; every prompt needs tokens")
    # the HBM hit of each request: the HBM holds what every request computed or loaded, so
    # it does not depend on the tier
    hits = []
    for prompt, output in zip(stream, outs, strict=True):
        n = len(prompt)
        block_ids = blocks.of(prompt)
        # the last token is always computed: only blocks inside the first n - 1 tokens can hit
        hits.append(hbm.leading(block_ids[: (n - 1) // block_size]) * block_size)
        if output:
            # the last generated token is sampled, never fed back: its KV is not computed
            block_ids = blocks.of(prompt + list(output[:-1]))
        hbm.touch_chain(block_ids)
    # the tier's leading chunks at each lookup
    leads = [0] * len(stream)
    if use_tier:
        assert chunk_size is not None
        chunked = from_prompts(stream, chunk_size)
        if policy is None:
            leads = optimal_leading(chunked, tier_chunks)
        else:
            floors = [h // chunk_size for h in hits]
            min_chunks = max(1, -(-min_load_tokens // chunk_size))
            step = max(1, step_tokens // chunk_size) if step_tokens else None
            leads = drive_tier(
                chunked, tier_chunks, floors, min_load=min_chunks, admission=policy,
                step_chunks=step, self_test=True,
            ).leads  # fmt: skip
    requests = prompt_tokens = hbm_hits = ext_hits = 0
    for prompt, count, lead, h in zip(stream, flags, leads, hits, strict=True):
        n = len(prompt)
        ext = 0
        if use_tier:
            assert chunk_size is not None
            end = min(lead * chunk_size, n - 1)
            if end > h and end - h >= min_load_tokens:
                ext = end - h
        if count:
            requests += 1
            prompt_tokens += n
            hbm_hits += h
            ext_hits += ext
    return Ceiling(name, requests, prompt_tokens, hbm_hits, ext_hits)


def ceilings(
    prompts: Sequence[Sequence[int]],
    block_size: int,
    hbm_blocks: int | None,
    chunk_size: int | None = None,
    tier_chunks: int | None = None,
    min_load_tokens: int = 0,
    *,
    outputs: Sequence[Sequence[int]] | None = None,
    counted: Sequence[bool] | None = None,
    policy: str | None = None,
    step_tokens: int | None = None,
) -> dict[str, Ceiling]:
    """The ceilings by name: "hbm" (an LRU of `hbm_blocks`) and "hbm+tier" (that LRU in front of
    the offline-optimal tier of `tier_chunks` chunks) where those sizes are given, and
    "infinite" (every block ever computed stays: no arm can hit more); with `policy` (the tier's
    admission mode) also "kvtier", the prediction of kvtier's own tier of that size."""
    common: dict[str, Any] = {"block_size": block_size, "outputs": outputs, "counted": counted}
    out = {}
    if hbm_blocks:
        out["hbm"] = simulate(prompts, hbm_blocks=hbm_blocks, name="hbm", **common)
        if chunk_size and tier_chunks:
            out["hbm+tier"] = simulate(
                prompts,
                hbm_blocks=hbm_blocks,
                chunk_size=chunk_size,
                tier_chunks=tier_chunks,
                min_load_tokens=min_load_tokens,
                name="hbm+tier",
                **common,
            )
            if policy is not None:
                out["kvtier"] = simulate(
                    prompts,
                    hbm_blocks=hbm_blocks,
                    chunk_size=chunk_size,
                    tier_chunks=tier_chunks,
                    min_load_tokens=min_load_tokens,
                    name="kvtier",
                    policy=policy,
                    step_tokens=step_tokens,
                    **common,
                )
    out["infinite"] = simulate(prompts, hbm_blocks=None, name="infinite", **common)
    return out
