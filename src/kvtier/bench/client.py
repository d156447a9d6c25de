"""A closed-loop load generator for an OpenAI-compatible `/v1/completions` endpoint.

`concurrency` workers take requests in stream order (so the server sees them in the order the
ceiling simulator replays them), stream each completion over SSE and keep one `Record` per
request in memory. Prompts go as token-id lists; greedy, `ignore_eos`, usage and token ids on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvtier.bench.workload import RequestSpec

Clock = Callable[[], float]

_DONE = "[DONE]"
_DEFAULT_TIMEOUT_S = 300.0


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

    @property
    def ok(self) -> bool:
        """Completed with usage and no error."""
        return self.error is None and self.end is not None and self.completion_tokens is not None

    @property
    def ttft(self) -> float | None:
        """Seconds from send to the first token."""
        return None if self.first_token is None else self.first_token - self.start

    def to_json(self) -> dict[str, Any]:
        """Plain JSON fields."""
        return asdict(self)


@dataclass(slots=True)
class LoadResult:
    """Every record of one load, in stream order, and the wall-clock window it took."""

    records: list[Record]
    started: float
    finished: float

    @property
    def duration_s(self) -> float:
        """From the first send to the last response's end."""
        return self.finished - self.started


class ProtocolError(RuntimeError):
    """The server's stream broke the OpenAI completions contract."""


def completion_body(spec: RequestSpec, model: str | None = None) -> dict[str, Any]:
    """The JSON body for one request: token-id prompt, greedy, ignore_eos, streamed usage."""
    body: dict[str, Any] = {
        "prompt": list(spec.prompt),
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
    concurrency: int,
    model: str | None = None,
    progress: bool = True,
    label: str = "requests",
    console: Console | None = None,
    clock: Clock = time.perf_counter,
    timeout_s: float = _DEFAULT_TIMEOUT_S,
    transport: httpx.AsyncBaseTransport | None = None,
) -> LoadResult:
    """Send every spec with `concurrency` in flight; returns one record per spec, in order.

    A failed request keeps its error text in its record (the load goes on); callers count them.
    """
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        raise ValueError(f"concurrency={concurrency!r} must be an integer >= 1")
    records: list[Record | None] = [None] * len(specs)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(len(specs)):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    # a bar on a pipe or file only adds blank lines
    out = console or Console(stderr=True)
    bar = _progress(out) if progress and out.is_terminal else None
    task = bar.add_task(label, total=len(specs)) if bar is not None else None
    async with httpx.AsyncClient(
        base_url=base_url, timeout=timeout_s, limits=limits, transport=transport
    ) as client:

        async def worker() -> None:
            while True:
                try:
                    i = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                records[i] = await _one(client, specs[i], model, clock)
                if bar is not None and task is not None:
                    bar.advance(task)

        started = clock()
        if bar is not None:
            bar.start()
        try:
            await asyncio.gather(*(worker() for _ in range(min(concurrency, len(specs)))))
        finally:
            if bar is not None:
                bar.stop()
        finished = clock()
    done = [r for r in records if r is not None]
    if len(done) != len(specs):
        raise RuntimeError(f"load ended with {len(specs) - len(done)} requests never sent")
    return LoadResult(done, started, finished)


async def _one(
    client: httpx.AsyncClient, spec: RequestSpec, model: str | None, clock: Clock
) -> Record:
    rec = Record(
        index=spec.index,
        tag=spec.tag,
        prefix_id=spec.prefix_id,
        start=clock(),
        max_tokens=spec.max_tokens,
        sent_prompt_tokens=len(spec.prompt),
    )
    try:
        async with client.stream(
            "POST", "/v1/completions", json=completion_body(spec, model)
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
        if rec.completion_tokens and not rec.output_ids:
            raise ProtocolError(
                "no token_ids in the stream; the server must honour return_token_ids"
            )
    except (httpx.HTTPError, ProtocolError, json.JSONDecodeError, KeyError, TypeError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    return rec


def _absorb(rec: Record, chunk: dict[str, Any], clock: Clock) -> None:
    """Fold one SSE chunk into the record: token ids, the first-token time and the usage."""
    if "error" in chunk:
        raise ProtocolError(f"server error in stream: {chunk['error']}")
    for choice in chunk.get("choices") or ():
        ids = choice.get("token_ids") or []
        if (ids or choice.get("text")) and rec.first_token is None:
            rec.first_token = clock()
        rec.output_ids.extend(int(t) for t in ids)
    usage = chunk.get("usage")
    if usage:
        rec.prompt_tokens = int(usage["prompt_tokens"])
        rec.completion_tokens = int(usage["completion_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        rec.cached_tokens = int(details.get("cached_tokens") or 0)


def write_jsonl(path: str | Path, records: Sequence[Record]) -> Path:
    """Write one JSON object per record (creating parent directories); returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec.to_json(), separators=(",", ":")) + "\n")
    return out


def read_jsonl(path: str | Path) -> list[Record]:
    """Records written by `write_jsonl`."""
    with Path(path).open(encoding="utf-8") as f:
        return [Record(**json.loads(line)) for line in f if line.strip()]


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
