"""`vllm serve` (through .venv-vllm/bin/vllm-cli) with KVTierConnector, driven over HTTP.

Pass 1 completes every prompt, `POST /reset_prefix_cache` (VLLM_SERVER_DEV_MODE=1) empties
vLLM's prefix cache, pass 2 repeats them; then `/metrics` is read once vLLM has counted every
prompt. Prints texts and token ids, cached tokens, the cache counters, the whole /metrics page
and the server's kvtier log lines.
Args (JSON): model, extra, and optionally n, base_len, max_tokens, startup_timeout_s, serve_args
(extra `vllm serve` arguments), dp_ranks (send prompt i to data-parallel engine i % dp_ranks),
hostile_ids (after the counters are read: a prefix-cache reset, then the first prompt under
client `X-Request-Id` headers of 300 and 4000 characters, so a tier lookup runs under each, then
a plain request: their statuses and cached tokens), retention (then the first prompt with a
retention hint in `kv_transfer_params`, and with a bad one: what each response carries back).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench.ports import free_port
from tests.vllm.drivers.common import args, emit, kv_transfer_config, make_prompts

_STARTED = "Application startup complete"
_VLLM_LABELS = ("model_name", "engine")
_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
    "vllm:prompt_tokens_cached_total",
)


class ServerLog:
    """Copies the server's merged output to our stderr and signals the startup line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self.started = threading.Event()
        self.exited = threading.Event()
        self._proc = proc
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            sys.stderr.write(line)
            self.lines.append(line.rstrip("\n"))
            if _STARTED in line:
                self.started.set()
        self.exited.set()
        self.started.set()  # wake a waiter: the server died before it started

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def http(
    method: str,
    url: str,
    body: dict[str, Any] | None = None,
    timeout: float = 60,
    headers: dict[str, str] | None = None,
) -> Any:
    """One HTTP call; JSON in and out (text for /metrics)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read().decode()
    return json.loads(raw) if resp.headers.get_content_type() == "application/json" else raw


def healthy(url: str) -> bool:
    """True once the server accepts connections and answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False


def counters(text: str) -> dict[str, float]:
    """Sum of each cache counter over its label sets in a /metrics page."""
    out = dict.fromkeys(_COUNTERS, 0.0)
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


def kvtier_samples(text: str) -> dict[str, float]:
    """Every `kvtier_*_total` sample of a /metrics page as `name{kvtier labels}` -> value
    (vLLM's model_name/engine labels dropped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(kvtier_[a-z_]+_total)(?:\{([^}]*)\})?\s+([0-9.eE+-]+)$", line)
        if not m:
            continue
        labels = dict(re.findall(r'([a-zA-Z_]+)="([^"]*)"', m.group(2) or ""))
        kept = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k not in _VLLM_LABELS)
        key = f"{m.group(1)}{{{kept}}}"
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `check` until it holds, or raise naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.2)


def hostile_ids(base: str, prompt: list[int], max_tokens: int) -> list[dict[str, Any]]:
    """The prompt under client request ids kvtier must not choke on (vLLM takes the
    X-Request-Id header as the request id), then a plain request: status and cached tokens."""
    http("POST", f"{base}/reset_prefix_cache")
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}  # fmt: skip
    out = []
    for rid in ("x" * 300, "y#lk" * 1000, None):
        try:
            r = http("POST", f"{base}/v1/completions", body, timeout=120,
                     headers={"X-Request-Id": rid} if rid else None)  # fmt: skip
            details = (r.get("usage") or {}).get("prompt_tokens_details") or {}
            out.append({"id_chars": len(rid or ""), "status": 200,
                        "cached": details.get("cached_tokens", 0)})  # fmt: skip
        except urllib.error.HTTPError as e:
            out.append({"id_chars": len(rid or ""), "status": e.code, "cached": 0})
        except (urllib.error.URLError, ConnectionError) as e:
            out.append({"id_chars": len(rid or ""), "status": 0, "error": str(e)})
    return out


def retention_hints(base: str, prompt: list[int]) -> list[Any]:
    """The prompt with retention hints in `kv_transfer_params` (OpenAI's names), then a bad
    one: the `kv_transfer_params` each response carries back."""
    out = []
    for params in (
        {"prompt_cache_key": "conv-1", "prompt_cache_retention": "24h", "user": "alice"},
        {"prompt_cache_retention": "forever"},
    ):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0.0,
                "kv_transfer_params": params}  # fmt: skip
        out.append(http("POST", f"{base}/v1/completions", body).get("kv_transfer_params"))
    return out


def main() -> None:
    a = args()
    prompts = make_prompts(a.get("n", 2), a.get("base_len", 600))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cli = Path(sys.executable).with_name("vllm-cli")
    cmd = [
        str(cli), "serve", a["model"],
        "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "2048",
        "--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(kv_transfer_config(a["extra"])),
        *a.get("serve_args", []),
    ]  # fmt: skip
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    # the OpenAI server needs the multiprocess engine client
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    log = ServerLog(proc)
    result: dict[str, Any] = {"port": port}
    try:
        if not log.started.wait(a.get("startup_timeout_s", 240)) or log.exited.is_set():
            raise RuntimeError(f"vllm serve did not start (exit code {proc.poll()})")
        # uvicorn logs startup complete before its socket listens: wait for /health to answer
        wait_until(lambda: healthy(f"{base}/health"), 60, f"{base}/health to answer")
        result["startup_s"] = round(time.perf_counter() - t0, 2)

        def complete() -> list[dict[str, Any]]:
            out = []
            for i, p in enumerate(prompts):
                body = {
                    "model": "tiny",
                    "prompt": p,
                    "max_tokens": a.get("max_tokens", 16),
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                }
                # dp_ranks: prompt i goes to engine i % dp_ranks in both passes, so its second
                # pass meets the engine whose private tier saved it
                dp = a.get("dp_ranks")
                headers = {"X-data-parallel-rank": str(i % dp)} if dp else None
                r = http("POST", f"{base}/v1/completions", body, headers=headers)
                details = (r.get("usage") or {}).get("prompt_tokens_details") or {}
                choice = r["choices"][0]
                out.append(
                    {
                        "text": choice["text"],
                        "token_ids": choice.get("token_ids"),
                        "cached": details.get("cached_tokens", 0),
                    }
                )
            return out

        pass1 = complete()
        http("POST", f"{base}/reset_prefix_cache")
        pass2 = complete()
        want = 2.0 * sum(len(p) for p in prompts)
        page: dict[str, str] = {}

        def counted() -> bool:
            page["text"] = http("GET", f"{base}/metrics")
            return counters(page["text"])["vllm:prefix_cache_queries_total"] >= want

        wait_until(counted, 30, f"vllm:prefix_cache_queries_total to reach {want}")
        result["lines_before_hostile"] = sum(1 for line in list(log.lines) if "kvtier" in line)
        if a.get("hostile_ids"):
            result["hostile"] = hostile_ids(base, prompts[0], a.get("max_tokens", 16))
        if a.get("retention"):
            result["retention"] = retention_hints(base, prompts[0])
        result.update(
            {
                "prompt_lens": [len(p) for p in prompts],
                "pass1": pass1,
                "pass2": pass2,
                "metrics": counters(page["text"]),
                "kvtier": kvtier_samples(page["text"]),
                "metrics_text": page["text"],
            }
        )
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.join(10)
    result["kvtier_lines"] = [line for line in log.lines if "kvtier" in line]
    result["exit_code"] = proc.returncode
    emit(result)


if __name__ == "__main__":
    main()
