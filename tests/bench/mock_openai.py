"""A stdlib OpenAI-completions mock for bench tests: `python mock_openai.py PORT [options]`.

Greedy-like outputs (a pure function of the prompt), streamed one token per SSE chunk with
`token_ids`; prefix caching over 16-token chained blocks in an LRU of `--hbm-blocks` blocks
(decode blocks included), with `usage.prompt_tokens_details.cached_tokens` and vLLM-named
counters on `/metrics` (`--no-metrics` answers 404 there instead).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BLOCK = 16
BYTES_PER_BLOCK = 4096


class Cache:
    """An LRU of chained block ids; counts what a vLLM server would."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.lock = threading.Lock()
        self.counters = {"prompt_tokens": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0}

    def keys(self, ids: list[int]) -> list[tuple[int, ...]]:
        return [tuple(ids[: (i + 1) * BLOCK]) for i in range(len(ids) // BLOCK)]

    def admit(self, prompt: list[int], output: list[int]) -> int:
        with self.lock:
            n = len(prompt)
            hit = 0
            for key in self.keys(prompt)[: (n - 1) // BLOCK]:
                if key not in self.blocks:
                    break
                hit += BLOCK
            for key in reversed(self.keys(prompt + output[:-1])):
                self.blocks[key] = None
                self.blocks.move_to_end(key)
                if self.capacity is not None and len(self.blocks) > self.capacity:
                    self.blocks.popitem(last=False)
            self.counters["prompt_tokens"] += n
            self.counters["prefix_cache_queries"] += n
            self.counters["prefix_cache_hits"] += hit
            return hit

    def metrics(self, capacity: int | None) -> str:
        with self.lock:
            lines = []
            for name, value in self.counters.items():
                lines += [
                    f"# TYPE vllm:{name} counter",
                    f'vllm:{name}_total{{model_name="mock"}} {value}',
                ]
            lines += [
                "# TYPE vllm:cache_config_info gauge",
                f'vllm:cache_config_info{{block_size="{BLOCK}",num_gpu_blocks="{capacity}"}} 1.0',
                "# TYPE kvtier_tier_residency_bytes gauge",
                f'kvtier_tier_residency_bytes{{rank="0",tier="memory"}} '
                f"{len(self.blocks) * BYTES_PER_BLOCK}",
            ]
            return "\n".join(lines) + "\n"


def make_handler(cache: Cache, args: argparse.Namespace) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *a: object) -> None:  # quiet
            return

        def _json(self, code: int, doc: object) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": "mock", "object": "model"}]})
            elif self.path == "/metrics" and not args.no_metrics:
                body = cache.metrics(args.hbm_blocks).encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            length = int(self.headers.get("content-length", 0))
            raw = self.rfile.read(length)
            if self.path.startswith("/reset_prefix_cache"):
                with cache.lock:
                    cache.blocks.clear()
                self._json(200, {"status": "ok"})
                return
            if self.path != "/v1/completions":
                self._json(404, {"error": "not found"})
                return
            body = json.loads(raw)
            prompt = [int(t) for t in body["prompt"]]
            n_out = int(body["max_tokens"])
            output = [3 + (sum(prompt[-4:]) + 7 * k) % 500 for k in range(n_out)]
            cached = cache.admit(prompt, output)
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("connection", "close")
            self.end_headers()
            for t in output:
                time.sleep(args.token_s)  # a decode step
                chunk = {"choices": [{"index": 0, "text": "x", "token_ids": [t]}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": n_out,
                "total_tokens": len(prompt) + n_out,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            self.close_connection = True

    return Handler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("port", type=int)
    p.add_argument("--hbm-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=BLOCK)
    p.add_argument("--no-metrics", action="store_true")
    p.add_argument("--token-s", type=float, default=0.001)
    args = p.parse_args()
    cache = Cache(args.hbm_blocks)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(cache, args))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
