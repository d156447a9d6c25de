"""`vllm bench serve` against a running OpenAI-compatible server, several runs in one process.

Each job is the argument list of `vllm bench serve` (parsed by its own parser and run by its own
`main`, as the CLI does; one interpreter saves vLLM's import per run). Around every run the
server's `/metrics` is scraped, so the test can hold the client's token counts against the
server's counters. Args (JSON): {"base_url": url, "jobs": [{"name": str, "argv": [...]}]}.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import io
import re
import sys
import urllib.request

from kvtier.bench.vllm_load import vllm_version
from tests.vllm.drivers.common import args, emit

_SUMMED = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total")


def scrape(base_url: str) -> dict[str, float]:
    """Sums over label sets of the counters the test compares."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = dict.fromkeys(_SUMMED, 0.0)
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
    return out


def main() -> None:
    md.version = vllm_version
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    a = args()
    runs = []
    for job in a["jobs"]:
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        ns = parser.parse_args(job["argv"])
        before = scrape(a["base_url"])
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            result = bench_main(ns)
        sys.stderr.write(log.getvalue())
        after = scrape(a["base_url"])
        runs.append(
            {
                "name": job["name"],
                "completed": result["completed"],
                "failed": result["failed"],
                "total_input_tokens": result["total_input_tokens"],
                "total_output_tokens": result["total_output_tokens"],
                "errors": [e for e in result.get("errors", []) if e][:3],
                "server": {k: after[k] - before[k] for k in _SUMMED},
                "stdout_tail": log.getvalue()[-1500:],
            }
        )
    emit({"runs": runs})


if __name__ == "__main__":
    main()
