"""A load generator for an OpenAI-compatible `/v1/completions` endpoint (asyncio + httpx).

Closed loop: `concurrency` workers take the lowest-index request that is ready (a later turn of
a conversation is ready once its previous turn ended), so the server sees requests in about the
order the ceiling simulator replays them. Open loop: every request is sent at its `arrival`
(Poisson or a trace's timestamps), a later turn no earlier than its previous turn's end.
`duration_s` stops new sends after that many seconds; requests in flight finish.

Each completion streams over SSE into one `Record`: send, first-token, every token's arrival
(for inter-token latency), end, usage (prompt and cached tokens) and output ids. Prompts go as
token-id lists; greedy, `ignore_eos`, usage and token ids on.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvtier.bench.workload import RequestSpec, extend_prompt, read_lines, write_lines

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[None]]

OUTPUTS = "outputs"  # later turns carry the previous turn's real output ids
STANDIN = "standin"  # later turns carry the workload's seeded stand-in
HISTORY_MODES = (OUTPUTS, STANDIN)

STOP_ALL_SENT = "all_sent"
STOP_DURATION = "duration"

_DONE = "[DONE]"
DEFAULT_TIMEOUT_S = 300.0  # a request with no response for this long fails


@dataclass(slots=True)
class Record:
    """One request as the client saw it; times in seconds on the load's clock."""

    index: int
    tag: str
    prefix_id: int | None
    start: float
    first_token: float | None = None
    end: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    max_tokens: int = 0
    sent_prompt_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    error: str | None = None
    conversation: int | None = None
    turn: int = 0
    scheduled: float | None = None  # open loop: when it was due (it may go out later)
    token_times: list[float] = field(default_factory=list)  # one per output token
    sent: bool = True  # False: skipped (its previous turn failed), the server never saw it
    output_text: str | None = None  # a load engine that returns text, not ids (vllm-bench)

    @property
    def ok(self) -> bool:
        """Completed with usage and no error."""
        return self.error is None and self.end is not None and self.completion_tokens is not None

    @property
    def ttft(self) -> float | None:
        """Seconds from send to the first token."""
        return None if self.first_token is None else self.first_token - self.start

    def itl(self) -> list[float]:
        """Seconds between consecutive output tokens (tokens of one chunk are 0 apart)."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def to_json(self) -> dict[str, Any]:
        """Plain JSON fields."""
        return asdict(self)


@dataclass(slots=True)
class LoadResult:
    """Every record of one load, in stream order, and the wall-clock window it took.

    With a duration, requests not yet sent when it ran out have no record (`unsent` of them).
    """

    records: list[Record]
    started: float
    finished: float
    unsent: int = 0
    stopped_by: str = STOP_ALL_SENT

    @property
    def duration_s(self) -> float:
        """From the first send to the last response's end."""
        return self.finished - self.started


@dataclass(frozen=True, slots=True)
class LoadOptions:
    """How a run drives each load: `run_load`'s keyword arguments that stay fixed across arms."""

    concurrency: int | None = 4
    open_loop: bool = False
    duration_s: float | None = None
    history: str = OUTPUTS
    require_token_ids: bool = False
    model: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)  # may hold a key

    def describe(self) -> dict[str, Any]:
        """The options as JSON, header values left out (they may be credentials)."""
        return {**asdict(self), "headers": sorted(self.headers)}


class ProtocolError(RuntimeError):
    """The server's stream broke the OpenAI completions contract."""


def completion_body(
    spec: RequestSpec, model: str | None = None, prompt: Sequence[int] | None = None
) -> dict[str, Any]:
    """The JSON body for one request: token-id prompt (`prompt` overrides the spec's), greedy,
    ignore_eos, streamed usage and token ids."""
    body: dict[str, Any] = {
        "prompt": list(spec.prompt if prompt is None else prompt),
        "max_tokens": spec.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if model is not None:
        body["model"] = model
    return body


async def run_load(
    base_url: str,
    specs: Sequence[RequestSpec],
    *,
    concurrency: int | None = None,
    open_loop: bool = False,
    duration_s: float | None = None,
    history: str = OUTPUTS,
    require_token_ids: bool = True,
    model: str | None = None,
    progress: bool = True,
    label: str = "requests",
    console: Console | None = None,
    clock: Clock = time.perf_counter,
    sleep: Sleep = asyncio.sleep,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    transport: httpx.AsyncBaseTransport | None = None,
    headers: Mapping[str, str] | None = None,
) -> LoadResult:
    """Send the specs closed-loop (`concurrency` in flight) or open-loop (each at its
    `arrival`, `concurrency` then an optional cap); returns one record per request sent, in
    stream order.

    A failed request keeps its error text in its record (the load goes on); a later turn of a
    failed one is recorded as skipped, never sent. With `history` "outputs" a later turn carries
    its previous turn's real output ids (which the server must return), else the stand-in.
    """
    if open_loop:
        if concurrency is not None:
            _check_concurrency(concurrency)
        missing = [s.index for s in specs if s.arrival is None]
        if missing:
            raise ValueError(f"open loop needs an arrival on every request; {missing[:5]} lack one")
    else:
        _check_concurrency(concurrency)
    if duration_s is not None and not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration_s={duration_s!r} must be a positive number of seconds")
    if history not in HISTORY_MODES:
        raise ValueError(f"history={history!r} must be one of {HISTORY_MODES}")
    load = _Load(specs, history, require_token_ids, model, clock)
    cap = concurrency or max(1, len(specs))
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    # a bar on a pipe or file only adds blank lines
    out = console or Console(stderr=True)
    bar = None
    if progress and out.is_terminal:
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn())
        bar = Progress(*columns, TimeElapsedColumn(), console=out, transient=True)
    task = bar.add_task(label, total=len(specs)) if bar is not None else None

    def tick() -> None:
        if bar is not None and task is not None:
            bar.advance(task)

    async with httpx.AsyncClient(
        base_url=base_url,
        timeout=timeout_s,
        limits=limits,
        transport=transport,
        headers=dict(headers or {}),
    ) as client:
        load.client = client
        load.started = clock()
        load.duration_s = duration_s
        if bar is not None:
            bar.start()
        try:
            if open_loop:
                await _open_loop(load, concurrency, sleep, tick)
            else:
                assert concurrency is not None
                await _closed_loop(load, concurrency, tick)
        finally:
            if bar is not None:
                bar.stop()
        finished = clock()
    done = [load.records[s.index] for s in specs if s.index in load.records]
    unsent = len(specs) - len(done)
    if unsent and duration_s is None:
        raise RuntimeError(f"load ended with {unsent} requests never sent")
    return LoadResult(
        done, load.started, finished, unsent, STOP_DURATION if unsent else STOP_ALL_SENT
    )


def _check_concurrency(concurrency: int | None) -> None:
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r} must be an integer >= 1")


class _Load:
    """The shared state of one load: specs by index, the prompts sent and the records."""

    def __init__(
        self,
        specs: Sequence[RequestSpec],
        history: str,
        require_token_ids: bool,
        model: str | None,
        clock: Clock,
    ) -> None:
        self.by_index = {s.index: s for s in specs}
        if len(self.by_index) != len(specs):
            raise ValueError("the stream repeats a request index; every index must be unique")
        self.children: dict[int, list[int]] = {}
        for s in specs:
            if s.parent is not None:
                if s.parent not in self.by_index or s.parent >= s.index:
                    raise ValueError(
                        f"request {s.index} continues request {s.parent}, which is not an "
                        "earlier request of the stream; keep whole conversations in order"
                    )
                self.children.setdefault(s.parent, []).append(s.index)
        self.history = history
        self.require_token_ids = require_token_ids or (history == OUTPUTS and bool(self.children))
        self.model = model
        self.clock = clock
        self.prompts: dict[int, tuple[int, ...]] = {}
        self.records: dict[int, Record] = {}
        self.client: httpx.AsyncClient | None = None
        self.started = 0.0
        self.duration_s: float | None = None

    def expired(self) -> bool:
        """Whether the duration (if any) has run out: no new sends."""
        return self.duration_s is not None and self.clock() - self.started >= self.duration_s

    async def send(self, i: int, scheduled: float | None = None) -> Record:
        """Send request `i` (a later turn with its previous turn's real output, or skipped when
        that turn failed) and keep its record."""
        spec = self.by_index[i]
        prompt = spec.prompt
        if spec.parent is not None:
            parent = self.records.get(spec.parent)
            if parent is None or not parent.ok:
                rec = _record(spec, self.clock(), len(spec.prompt))
                rec.sent = False
                rec.error = f"skipped: previous turn (request {spec.parent}) did not complete"
                rec.scheduled = scheduled
                self.records[i] = rec
                return rec
            if self.history == OUTPUTS:
                prompt = extend_prompt(spec, self.prompts[spec.parent], parent.output_ids)
        if i in self.children:
            self.prompts[i] = prompt
        assert self.client is not None
        rec = await _one(self.client, spec, prompt, self)
        rec.scheduled = scheduled
        self.records[i] = rec
        return rec


async def _closed_loop(load: _Load, concurrency: int, tick: Callable[[], None]) -> None:
    ready = sorted(i for i, s in load.by_index.items() if s.parent is None)
    heapq.heapify(ready)
    cond = asyncio.Condition()
    in_flight = 0

    async def worker() -> None:
        nonlocal in_flight
        while True:
            async with cond:
                while True:
                    if load.expired():
                        return
                    if ready:
                        break
                    if in_flight == 0:
                        return  # nothing in flight can make another request ready
                    await cond.wait()
                i = heapq.heappop(ready)
                in_flight += 1
            try:
                await load.send(i)
            finally:
                async with cond:
                    in_flight -= 1
                    for child in load.children.get(i, ()):
                        heapq.heappush(ready, child)
                    cond.notify_all()
                tick()

    n = min(concurrency, len(load.by_index))
    await asyncio.gather(*(worker() for _ in range(n)))


async def _open_loop(
    load: _Load, concurrency: int | None, sleep: Sleep, tick: Callable[[], None]
) -> None:
    sem = asyncio.Semaphore(concurrency) if concurrency is not None else None
    ended = {i: asyncio.Event() for i in load.by_index}

    async def one(i: int) -> None:
        spec = load.by_index[i]
        assert spec.arrival is not None
        due = load.started + spec.arrival
        try:
            if load.duration_s is not None and spec.arrival >= load.duration_s:
                return
            wait = due - load.clock()
            if wait > 0:
                await sleep(wait)
            if spec.parent is not None:
                await ended[spec.parent].wait()
                if spec.parent not in load.records:
                    return  # the previous turn was never sent: neither is this one
            if load.expired():
                return
            if sem is None:
                await load.send(i, due)
            else:
                async with sem:
                    await load.send(i, due)
        finally:
            ended[i].set()
            tick()

    await asyncio.gather(*(one(i) for i in sorted(load.by_index)))


def _record(spec: RequestSpec, start: float, prompt_len: int) -> Record:
    return Record(
        index=spec.index,
        tag=spec.tag,
        prefix_id=spec.prefix_id,
        start=start,
        max_tokens=spec.max_tokens,
        sent_prompt_tokens=prompt_len,
        conversation=spec.conversation,
        turn=spec.turn,
    )


async def _one(
    client: httpx.AsyncClient, spec: RequestSpec, prompt: Sequence[int], load: _Load
) -> Record:
    clock = load.clock
    rec = _record(spec, clock(), len(prompt))
    try:
        async with client.stream(
            "POST", "/v1/completions", json=completion_body(spec, load.model, prompt)
        ) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                raise ProtocolError(f"HTTP {resp.status_code}: {text[:500]}")
            saw_done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == _DONE:
                    saw_done = True
                    break
                _absorb(rec, json.loads(payload), clock)
        rec.end = clock()
        if not saw_done:
            raise ProtocolError("stream ended without 'data: [DONE]'")
        if rec.completion_tokens is None:
            raise ProtocolError("no usage chunk; the server must honour stream_options")
        if load.require_token_ids and rec.completion_tokens and not rec.output_ids:
            raise ProtocolError(
                "no token_ids in the stream; the server must honour return_token_ids (or send "
                "later turns with the seeded stand-in: workload.history=standin)"
            )
    except (httpx.HTTPError, ProtocolError, json.JSONDecodeError, KeyError, TypeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


def _absorb(rec: Record, chunk: dict[str, Any], clock: Clock) -> None:
    """Fold one SSE chunk into the record: token ids and their arrival times, the first-token
    time and the usage."""
    if "error" in chunk:
        raise ProtocolError(f"server error in stream: {chunk['error']}")
    now: float | None = None
    for choice in chunk.get("choices") or ():
        ids = choice.get("token_ids") or []
        # without token ids, a chunk with text stands for one token
        n = len(ids) if ids else (1 if choice.get("text") else 0)
        if n:
            if now is None:
                now = clock()
            if rec.first_token is None:
                rec.first_token = now
            rec.token_times.extend([now] * n)
        rec.output_ids.extend(int(t) for t in ids)
    usage = chunk.get("usage")
    if usage:
        rec.prompt_tokens = int(usage["prompt_tokens"])
        rec.completion_tokens = int(usage["completion_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)


def write_jsonl(path: str | Path, records: Sequence[Record]) -> Path:
    """Write one JSON object per record (creating parent directories); returns the path."""
    return write_lines(path, (r.to_json() for r in records))


def read_jsonl(path: str | Path) -> list[Record]:
    """Records written by `write_jsonl`."""
    return [Record(**doc) for doc in read_lines(path)]
