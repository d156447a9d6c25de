"""`kvtier bench load-cost`: a shared store slower than the prefill, made from real parts (the
user's Valkey/Redis behind a throttling TCP proxy, `bench/throttle.py`), and the native engine
restoring prompts from it under each load policy.

1. A writer engine serves every prompt once with the store reached directly, and waits until
   every chunk is written behind.
2. Fresh engines, open side by side, restore the prompts one at a time through the proxy, each
   prompt's time to its first token measured: no offload (twice: the A/A pair),
   `load_policy: cost`, `always`; every prompt goes through all four before the next.
3. Mixed: a prompt's head is in the engine's memory tier (served alone first), its tail only in
   the slow store: the head is loaded and the tail recomputed.
4. Sweep: one cost-policy engine while the proxy's rate steps across the break-even (the store
   rate at which a load takes the prefill's time), counting the decisions in each step.
"""

from __future__ import annotations

import copy
import math
import random
import secrets
import shutil
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis

from kvtier.bench import analysis
from kvtier.bench.e2e import KV_DTYPE, ensure_model, model_config
from kvtier.bench.table import Report, Row, Target, write_json
from kvtier.bench.throttle import ThrottledProxy
from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.layout import bytes_per_token_from_hf
from kvtier.lookup.endpoints import make_run_dir
from kvtier.native import Engine, EngineConfig
from kvtier.native.offload import connector_spec
from kvtier.native.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
OFF, OFF_AGAIN, COST, ALWAYS = "off", "off_again", "cost", "always"
# the bound: with the store below break-even, ON's TTFT within 3% of OFF's (beyond the
# A/A pair's own spread)
SLOW_TTFT_BOUND = 1.03
# a TTFT verdict fails only when the median per-prompt ratio is past the bound by more than this
# many of its bootstrap standard errors: on 2 cores one restore moves by 5-10%, and a verdict
# that fails on that teaches users to ignore it
NOISE_SE = 2.0
# the mixed case's first prompt loads its tail from the slow store (it teaches the engine the
# store's speed): its TTFT verdict is judged from the prompts after it, at least this many
# (the quick form's 2 mixed prompts leave 1: the median of 2 was half the teaching one's)
MIXED_MIN_JUDGED = 3
# the sweep's rates, as multiples of the break-even (the store rate at which a load, by the
# default 10% margin, just beats the prefill): below, 20% below, 20% above, above, and 20%
# below again; the hysteresis band is 10% either side
SWEEP = (0.5, 0.8, 1.2, 2.0, 0.8)
MARGIN = 0.1
FAST = 2e9  # bytes/s: the proxy at a rate no store link here reaches (the sweep's warm-up)


@dataclass(frozen=True)
class Plan:
    """The workload's sizes."""

    prompts: int = 16
    prompt_tokens: int = 256
    chunk: int = 64
    head_chunks: int = 2
    mixed: int = 12  # the first teaches the engine the store's speed
    sweep_prompts: int = 10  # per sweep step
    slow_bytes_per_s: float = 4 * 2**20
    latency_s: float = 0.0005
    # the cost engine's probe interval: its restores interleave with three other engines', so
    # a prompt takes about four restores' time; 8 s keeps about one probe in its 16 restores
    probe_s: float = 8.0
    # the small preset: its prefill is slow enough per KV byte that a store behind this
    # bench's Python proxy can read on both sides of the break-even (the sweep needs that)
    model_preset: str = "small"
    # the sweep's engine probes a turned-away store about once per this many prompts (its
    # steps are a few prompts long): often enough to see a rate rise within a step, rarely
    # enough that most prompts show the standing decision
    sweep_probe_every: int = 2


# the tests' form: no sweep (its steps need more requests than a test affords); the cost
# model's hysteresis and probes are proven in tests/offload/test_cost.py
QUICK = Plan(prompts=3, prompt_tokens=96, chunk=32, mixed=2, sweep_prompts=0, model_preset="tiny")


@dataclass
class Arm:
    """One engine's measured requests."""

    ttft_s: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


@contextmanager
def engine(model: Path, kv: KVTierConfig | None) -> Iterator[Engine]:
    """A native engine on one thread, with kvtier when `kv` is given (its lookup sockets in a
    short private run directory, removed afterwards)."""
    cfg = EngineConfig(num_threads=1, num_blocks=4096)
    if kv is None:
        with Engine(model, cfg) as eng:
            yield eng
        return
    run_dir = make_run_dir("kvtier-load-cost-")
    try:
        with Engine(model, cfg, connector_spec(kv, model, run_dir=run_dir)) as eng:
            yield eng
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def tier_stack(eng: Engine) -> Any:
    """The TP=1 engine's tier stack (to drain its write-behind)."""
    return eng.executor.runner.connector.worker.stack  # type: ignore[union-attr]


def timed(
    eng: Engine, prompts: Sequence[list[int]], arm: Arm, before: Callable[[], object] = lambda: None
) -> None:
    """Each prompt alone, its time to the first token; HBM forgets every prefix between them,
    so what is not recomputed came from the tier; `before` runs ahead of each (untimed)."""
    for p in prompts:
        before()
        eng.reset_prefix_cache()
        t0 = time.perf_counter()
        (out,) = eng.generate([p], GREEDY)
        arm.ttft_s.append(time.perf_counter() - t0)
        arm.outputs.append(list(out.output_token_ids))


def decisions(eng: Engine) -> dict[str, float]:
    """The scheduler's load decisions (`decision/tier`: runs) and prediction counts."""
    m = eng.connector.metrics  # type: ignore[union-attr]
    out: dict[str, float] = {}
    for fam in m.registry.collect():
        for s in fam.samples:
            if s.name == "kvtier_load_decisions_total":
                out[f"{s.labels['tier']}/{s.labels['decision']}"] = s.value
            elif s.name in (
                "kvtier_load_mispredictions_total",
                "kvtier_load_prediction_ratio_count",
            ):
                out[s.name.removeprefix("kvtier_")] = s.value
            elif s.name == "kvtier_skipped_loads_total" and s.value:
                out[f"skipped/{s.labels['reason']}"] = s.value
    return out


@contextmanager
def _proxy(url: str, rate: float, latency_s: float) -> Iterator[ThrottledProxy]:
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "valkey") or not parts.hostname:
        raise ConfigError(
            f"--remote-url {url!r} must be redis://HOST:PORT of one Valkey/Redis server (the "
            "bench puts a TCP proxy in front of it; TLS and clusters are not proxied)"
        )
    with ThrottledProxy((parts.hostname, parts.port or 6379), rate, latency_s) as proxy:
        yield proxy


def run(
    remote_url: str,
    *,
    quick: bool = False,
    model_dir: Path | None = None,
    json_path: Path | None = None,
    progress: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The whole bench (see the module); the report, also written as JSON."""
    plan = QUICK if quick else Plan()
    model = ensure_model(model_dir, plan.model_preset)
    vocab = int(model_config(model)["vocab_size"])
    tenant = f"bench-{secrets.token_hex(4)}"  # a namespace of its own on the user's store
    key = secrets.token_hex(32)

    def kv(url: str, **extra: Any) -> KVTierConfig:
        extra.setdefault("load_probe_s", plan.probe_s)
        return KVTierConfig(
            chunk_size=plan.chunk, memory_bytes="64MiB", remote_url=url, record_key=key,
            tenant=tenant, lookup_timeout_ms=2000, **extra,
        )  # fmt: skip

    restore = prompts_of(plan.prompts, plan.prompt_tokens, vocab, 1)
    mixed = prompts_of(plan.mixed, plan.prompt_tokens, vocab, 2)
    sweep = [
        prompts_of(plan.sweep_prompts, plan.prompt_tokens, vocab, 10 + i)
        for i in range(len(SWEEP) if plan.sweep_prompts else 0)
    ]
    warm = prompts_of(4 if plan.sweep_prompts else 0, plan.prompt_tokens, vocab, 3)
    everything = restore + mixed + warm + [p for step in sweep for p in step]
    progress(f"writer: {len(everything)} prompts of {plan.prompt_tokens} tokens into the store")
    write_behind(model, kv(remote_url), everything)
    with _proxy(remote_url, plan.slow_bytes_per_s, plan.latency_s) as proxy:
        slow = proxy.url()
        arms = policy_arms(model, restore, kv(slow), kv(slow, load_policy="always"), progress)
        mixed_arms = _mixed(model, plan, mixed, kv(slow), proxy, progress)
        steps, break_even = [], 0.0
        if sweep:
            steps, break_even = _sweep(
                model, kv(slow), proxy, remote_url, plan, warm, sweep, progress
            )
    report = _report(plan, arms, mixed_arms, steps, break_even)
    doc = report.to_json()
    write_json(json_path or Path("runs") / "bench-load-cost.json", doc)
    return doc


def write_behind(model: Path, kv: KVTierConfig, prompts: Sequence[list[int]]) -> None:
    """A writer engine serves `prompts` once and waits until its tiers wrote them behind."""
    with engine(model, kv) as eng:
        eng.generate(list(prompts), GREEDY)
        if not tier_stack(eng).flush(60.0):
            raise RuntimeError("the writer's write-behind did not drain within 60 s")


def policy_arms(
    model: Path,
    restore: Sequence[list[int]],
    cost: KVTierConfig,
    always: KVTierConfig,
    progress: Callable[[str], None],
    before: Callable[[], object] = lambda: None,
) -> dict[str, Arm]:
    """Fresh engines, open side by side, restore each prompt alone: no offload, `cost`,
    `always`, no offload again (the A/A pair). Each prompt goes through every arm before the
    next, the arms' order rotating from prompt to prompt, so a shift in the machine's speed
    mid-run lands on every arm alike (run one arm after another, a VM here moved 28% between
    two arms of the same engine); `before` runs ahead of each restore."""
    configs = ((OFF, None), (COST, cost), (ALWAYS, always), (OFF_AGAIN, None))
    arms: dict[str, Arm] = {name: Arm() for name, _ in configs}
    progress(f"[{', '.join(arms)}] {len(restore)} restores each, interleaved, one at a time")
    with ExitStack() as stack:
        engines = {name: stack.enter_context(engine(model, kv)) for name, kv in configs}
        for i, prompt in enumerate(restore):
            for name, _ in configs[i % len(configs) :] + configs[: i % len(configs)]:
                timed(engines[name], [prompt], arms[name], before)
        for name, kv in configs:
            if kv is not None:
                arms[name].metrics = decisions(engines[name])
    return arms


def _delivered(proxy: ThrottledProxy, remote_url: str, nbytes: int) -> float:
    """Bytes/s the proxy really delivers at its current rate (a Python proxy on a busy
    machine falls short of a high cap): the best of three reads of an `nbytes` value."""
    parts = urlsplit(remote_url)
    auth = {"username": parts.username, "password": parts.password}
    direct = redis.Redis(host=parts.hostname, port=parts.port or 6379, **auth)
    slow = redis.Redis(host="127.0.0.1", port=proxy.port, **auth)
    key = f"kvtier-bench-load-cost-{secrets.token_hex(4)}"
    try:
        direct.set(key, b"\0" * nbytes)
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            slow.get(key)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best
    finally:
        direct.delete(key)
        direct.close()
        slow.close()


def _break_even(eng: Engine, model: Path, tokens: int, delivered: float) -> float:
    """Bytes/s a store must read at for a load of `tokens` to beat their prefill by the
    margin, by the engine's own model after its warm-up: its learnt prefill time, and its
    learnt read time at the proxy's `delivered` rate less the bytes' own time there (the fixed
    cost of a load: lookup, lane wake-up, the store's round trips)."""
    nbytes = bytes_per_token_from_hf(
        model_config(model), tp_size=1, kv_dtype=KV_DTYPE
    ).bytes_for_tokens(tokens)
    cost = eng.connector.core.gate.cost  # type: ignore[union-attr]
    fixed = max(0.0, cost.tier("remote").seconds(tokens) - nbytes / delivered)
    budget = cost.prefill.marginal_seconds(0, tokens) / (1 + MARGIN) - fixed
    if budget <= 0:
        raise RuntimeError(
            f"a load's fixed cost ({fixed * 1e3:.1f} ms) exceeds the prefill of {tokens} tokens "
            f"({cost.prefill.marginal_seconds(0, tokens) * 1e3:.1f} ms) by the margin: no store "
            "rate breaks even; use longer prompts"
        )
    return nbytes / budget


def _mixed(
    model: Path,
    plan: Plan,
    prompts: Sequence[list[int]],
    config: KVTierConfig,
    proxy: ThrottledProxy,
    progress: Callable[[str], None],
) -> dict[str, Arm]:
    """The cost engine serves each prompt's head first; then both engines, open side by side,
    restore each whole prompt, their order alternating. The heads are in the store (the
    writer wrote whole prompts): they are read through the proxy at full speed, so the memory
    tier holds them; then the store is slow again for the timed prompts."""
    heads = [p[: plan.head_chunks * plan.chunk] for p in prompts]
    out: dict[str, Arm] = {OFF: Arm(), COST: Arm()}
    progress(f"[mixed off, cost] {len(prompts)} prompts, head in memory, tail in the store")
    with ExitStack() as stack:
        engines = {OFF: stack.enter_context(engine(model, None)),
                   COST: stack.enter_context(engine(model, config))}  # fmt: skip
        proxy.set_rate(FAST)
        with _setup_reads(engines[COST], "remote"):
            engines[COST].generate(heads, GREEDY)
        proxy.set_rate(plan.slow_bytes_per_s)
        before = decisions(engines[COST])
        for i, prompt in enumerate(prompts):
            for name in (OFF, COST) if i % 2 == 0 else (COST, OFF):
                timed(engines[name], [prompt], out[name])
        after = decisions(engines[COST])
    out[COST].metrics = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return out


@contextmanager
def _setup_reads(eng: Engine | None, tier: str) -> Iterator[None]:
    """Reads made inside are this bench's setup (the mixed heads, read at full speed), not the
    store's speed: `tier`'s read model, its standing decision and its probe clock go back to
    what they were, so the timed prompts meet the model as the slow arm's fresh engine does."""
    if eng is None:
        yield
        return
    cost = eng.connector.core.gate.cost  # type: ignore[union-attr]
    saved = copy.deepcopy((cost.tiers[tier], cost.state.get(tier), cost.last_probe.get(tier)))
    yield
    cost.tiers[tier] = saved[0]
    for table, value in ((cost.state, saved[1]), (cost.last_probe, saved[2])):
        table.pop(tier, None)
        if value is not None:
            table[tier] = value


@dataclass
class Step:
    """One sweep step: the store's rate and what the cost policy decided for its prompts."""

    rate: float
    times: float  # the rate over the break-even
    decisions: list[str]  # per prompt: "load" or "recompute" (its remote run)


def _sweep(
    model: Path,
    config: KVTierConfig,
    proxy: ThrottledProxy,
    remote_url: str,
    plan: Plan,
    warm: Sequence[list[int]],
    prompts: Sequence[Sequence[list[int]]],
    progress: Callable[[str], None],
) -> tuple[list[Step], float]:
    """One engine, the store's rate stepped across its break-even; the break-even is taken
    from the engine's prefill model after warm-up prompts (recomputed: not in the store)."""
    steps: list[Step] = []
    vocab = int(model_config(model)["vocab_size"])
    fresh = prompts_of(4, plan.prompt_tokens, vocab, 99)
    with engine(model, config) as eng:
        # warm-up: prompts recomputed (the prefill model), then stored ones loaded from the
        # store at full speed (the fixed cost of a load)
        pace = Arm()
        timed(eng, fresh, pace)
        proxy.set_rate(FAST)
        timed(eng, warm, Arm())
        cost = eng.connector.core.gate.cost  # type: ignore[union-attr]
        # a probe interval in this machine's prompts (a wall-clock one shorter than a prompt
        # would make every turned-away prompt a probe)
        cost.probe_s = plan.sweep_probe_every * statistics.median(pace.ttft_s)
        nbytes = bytes_per_token_from_hf(
            model_config(model), tp_size=1, kv_dtype=KV_DTYPE
        ).bytes_for_tokens(plan.prompt_tokens)
        delivered = _delivered(proxy, remote_url, nbytes)
        progress(
            f"[sweep] warm-up: a {nbytes / 2**20:.1f} MiB load predicted "
            f"{cost.tier('remote').seconds(plan.prompt_tokens) * 1e3:.1f} ms through the proxy "
            f"({delivered / 1e6:.0f} MB/s), its prefill "
            f"{cost.prefill.marginal_seconds(0, plan.prompt_tokens) * 1e3:.1f} ms"
        )
        break_even = _break_even(eng, model, plan.prompt_tokens, delivered)
        for times, batch in zip(SWEEP, prompts, strict=True):
            proxy.set_rate(times * break_even)
            progress(f"[sweep] store at {times:g}x the break-even ({proxy.rate / 1e6:.1f} MB/s)")
            step = Step(proxy.rate, times, [])
            for p in batch:
                before = decisions(eng)
                timed(eng, [p], Arm())
                after = decisions(eng)
                made = [
                    d
                    for d in ("load", "probe", "recompute")
                    if after.get(f"remote/{d}", 0.0) > before.get(f"remote/{d}", 0.0)
                ]
                step.decisions.append(made[0] if made else "none")
            steps.append(step)
    return steps, break_even


def p50_ms(arm: Arm) -> float:
    return statistics.median(arm.ttft_s) * 1e3


def each_ms(arm: Arm) -> str:
    """Every prompt's TTFT in ms, in prompt order (the JSON's record of the pairing)."""
    return " ".join(f"{t * 1e3:.1f}" for t in arm.ttft_s)


def paired(arm: Arm, base: Sequence[float]) -> tuple[float, float]:
    """The median over prompts of `arm`'s TTFT over `base`'s for the same prompt (run back to
    back), and that median's bootstrap standard error."""
    return analysis.median_se([a / b for a, b in zip(arm.ttft_s, base, strict=True)])


def noise_bound(se: float) -> float:
    """The issue's 3% plus what the measured noise allows (NOISE_SE standard errors)."""
    return SLOW_TTFT_BOUND + NOISE_SE * se


def beyond_aa(row: Row, aa: float) -> Row:
    """`row` (a TTFT over no offload's), UNDETERMINED where it missed while the A/A pair (no
    offload over itself) moved past the 3% too: the machine's noise, not the policy's."""
    if row.passed is False and abs(aa - 1.0) > SLOW_TTFT_BOUND - 1.0:
        return row.undetermined(f"the A/A pair itself moved to {aa:.3f}x, past the 3%")
    return row


def mixed_ttft_row(cost: Arm, off: Arm) -> Row:
    """The mixed case's TTFT over no offload's, judged from the prompts after the first (it
    teaches the engine the store's speed by loading its tail); fewer than `MIXED_MIN_JUDGED`
    of them: UNDETERMINED."""
    after = Arm(ttft_s=cost.ttft_s[1:] or cost.ttft_s)
    ratio, se = paired(after, off.ttft_s[1:] or off.ttft_s)
    row = Row("mixed.cost.ttft", "mixed: head in memory, tail only in the slow store, over no "
              "offload, TTFT per prompt after the first, median", ratio, "x",
              target=Target("value", "<=", noise_bound(se)),
              detail={"se": se, "p50_ms": p50_ms(cost), "off_p50_ms": p50_ms(off),
                      "ttft_ms": each_ms(cost), "off_ttft_ms": each_ms(off),
                      **cost.metrics})  # fmt: skip
    if len(cost.ttft_s) - 1 < MIXED_MIN_JUDGED:
        return row.undetermined(
            f"{len(cost.ttft_s) - 1} prompt(s) after the teaching one, judged from "
            f"{MIXED_MIN_JUDGED}"
        )
    return row


def policy_rows(
    r: Report, arms: dict[str, Arm], *, prefix: str, tier: str, slow: str, note: str
) -> int:
    """The rows of one slow tier's restores (ids `prefix.*`): the A/A pair, `cost` and `always`
    TTFT over no offload's, prompt by prompt, the runs `cost` loaded from `tier`; returns the
    first tokens of every arm unequal to no offload's."""
    off, again = arms[OFF].ttft_s, arms[OFF_AGAIN].ttft_s
    # each prompt's no-offload TTFT: the mean of the A/A pair's two restores of it
    base = [(a + b) / 2 for a, b in zip(off, again, strict=True)]
    aa, aa_se = paired(arms[OFF_AGAIN], off)
    p50s = {"off_p50_ms": statistics.median(off + again) * 1e3}
    r.add(Row(f"{prefix}.aa.ttft", "A/A: no offload over no offload, TTFT per prompt, median "
              f"{note}", aa, "x", detail={"se": aa_se, "p50_ms": p50_ms(arms[OFF_AGAIN]),
                                          "first_p50_ms": p50_ms(arms[OFF]),
                                          "ttft_ms": each_ms(arms[OFF_AGAIN]),
                                          "first_ttft_ms": each_ms(arms[OFF])}))  # fmt: skip
    cost, se = paired(arms[COST], base)
    r.add(beyond_aa(Row(f"{prefix}.cost.ttft", f"load_policy cost over no offload, TTFT per "
              f"prompt, median (bound: 1.03 + {NOISE_SE:g} standard errors): the {slow}'s hits "
              "recomputed", cost, "x", target=Target("value", "<=", noise_bound(se)),
              detail={"se": se, "aa": aa, "p50_ms": p50_ms(arms[COST]), **p50s,
                      "ttft_ms": each_ms(arms[COST]), **arms[COST].metrics}), aa))  # fmt: skip
    always, always_se = paired(arms[ALWAYS], base)
    r.add(Row(f"{prefix}.always.ttft", "load_policy always over no offload, TTFT per prompt, "
              f"median: every hit read from the {slow}", always, "x",
              detail={"se": always_se, "p50_ms": p50_ms(arms[ALWAYS]), **p50s,
                      "ttft_ms": each_ms(arms[ALWAYS]), **arms[ALWAYS].metrics}))  # fmt: skip
    loaded = sum(v for k, v in arms[COST].metrics.items() if k.startswith(f"{tier}/load"))
    r.add(Row(f"{prefix}.cost.{tier}_loads", f"load_policy cost: {tier} runs loaded (the first "
              "teaches the model; the rest recompute)", loaded, "runs",
              target=Target("value", "<=", 2)))  # fmt: skip
    return sum(
        a != b
        for name in (OFF_AGAIN, COST, ALWAYS)
        for a, b in zip(arms[name].outputs, arms[OFF].outputs, strict=True)
    )


def _report(
    plan: Plan, arms: dict[str, Arm], mixed: dict[str, Arm], steps: list[Step], break_even: float
) -> Report:
    r = Report("load-cost", "kvtier bench load-cost: load or recompute from a slow shared store")
    note = r.note(
        f"{plan.prompts} prompts of {plan.prompt_tokens} tokens ({plan.chunk}-token chunks), each "
        "restored alone by each arm's engine (the arms interleaved prompt by prompt) from a real "
        "Valkey/Redis, its only copy, behind a "
        f"proxy capping answers at {plan.slow_bytes_per_s / 2**20:g} MiB/s "
        f"(+{plan.latency_s * 1e3:g} ms); the time to the first token"
    )
    mism = policy_rows(r, arms, prefix="slow", tier="remote", slow="slow store", note=note)
    mism += sum(a != b for a, b in zip(mixed[COST].outputs, mixed[OFF].outputs, strict=True))
    r.add(Row("outputs.mismatches", "first tokens unequal to no offload's (every arm, same batch "
              "shape)", mism, "prompts", target=Target("value", "<=", 0)))  # fmt: skip
    mm = mixed[COST].metrics
    r.add(mixed_ttft_row(mixed[COST], mixed[OFF]))
    split = min(mm.get("memory/load", 0.0), mm.get("remote/recompute", 0.0))
    r.add(Row("mixed.cost.split", "mixed: prompts whose head was loaded and tail recomputed "
              "(the first may load the tail: it teaches the engine the store's speed)",
              split, "prompts", target=Target("value", ">=", plan.mixed - 1)))  # fmt: skip
    flips = 0
    for i, s in enumerate(steps):
        want = "load" if s.times > 1 else "recompute"
        # the step's second half: the model has seen the new rate (a probe, or its own loads)
        settled = [d for d in s.decisions[len(s.decisions) // 2 :] if d != "probe"]
        flips += sum(a != b for a, b in zip(settled, settled[1:], strict=False))
        # information, not a verdict: the break-even is the engine's own noisy model's, and
        # on a shared 2-core machine a falling rate takes the read model several loads to
        # follow; the switching and its hysteresis are proven in tests/offload/test_cost.py
        r.add(Row(f"sweep.{i}.decided", f"sweep: store at {s.times:g}x the break-even "
                  f"({s.rate / 1e6:.1f} MB/s), second half of its prompts {want} (share)",
                  sum(d == want for d in settled) / max(1, len(settled)), "share",
                  detail={"decisions": ",".join(s.decisions)}))  # fmt: skip
    if steps:
        r.add(Row("sweep.flips", "sweep: decision changes within a step once settled "
                  "(oscillation)", flips, "flips",
                  detail={"break_even_mb_s": break_even / 1e6}))  # fmt: skip
    return r
