"""The connector's lifecycle contract through `vllm.LLM`, in one engine (memory + disk tier, KV
events published over zmq and read back by a subscriber here):

1. store: pass 1 saves every prompt; the memory tier holds a few chunks, the disk all of them;
2. by source: after a prefix-cache reset, pass 2 restores recent prompts from host memory and
   older ones from disk (`vllm:prompt_tokens_cached_by_source`);
3. one read: two requests with the same prefix at once: one tier load, the other waits for it
   and finds the prefix in vLLM's own cache;
4. reset: `reset_prefix_cache(reset_connector=True)` returns True, the next pass finds nothing
   in the tier (a new namespace epoch): it recomputes every prompt, batched as passes 2 and 5
   are, and is their reference; a pass after that restores again;
5. twins reference: after one more connector reset, the two-request batch of phase 3 computed
   with nothing in the tier (the reference phase 3's outputs are compared with).

Outputs are only compared between passes that submit the same prompts in the same batch (bf16
numerics follow the batch shape and the CPU's kernels): pass 1 runs one prompt at a time so the
memory tier ends up holding the last prompts, and is nobody's reference.

Phase markers `KVTIER_PHASE <name>` go to stderr so the test can count each phase's
`Retrieved` lines. Args (JSON): model, extra, disk_dir, events_endpoint.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from tests.vllm.drivers.common import (
    args,
    delta,
    emit,
    kernel_report,
    kv_transfer_config,
    llm_metrics,
    make_llm,
    make_prompts,
    reset_prefix_cache,
)


def phase(name: str) -> None:
    print(f"KVTIER_PHASE {name}", file=sys.stderr, flush=True)


class Subscriber(threading.Thread):
    """Collects vLLM's published KV-event batches (msgpack `KVEventBatch`) until stopped."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        import zmq

        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.events: list[Any] = []
        self.stop = threading.Event()

    def run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            frames = self.sock.recv_multipart()
            self.events.extend(decoder.decode(frames[-1]).events)


def summarize(events: list[Any]) -> dict[str, Any]:
    """Stored/removed block hashes per medium (hex or int text), and counts."""
    out: dict[str, Any] = {}
    for e in events:
        kind = type(e).__name__
        medium = getattr(e, "medium", None) or "none"
        locality = getattr(e, "locality", None) or ""
        key = f"{kind}:{medium}{':' + locality if locality else ''}"
        bucket = out.setdefault(key, {"events": 0, "hashes": []})
        bucket["events"] += 1
        for h in getattr(e, "block_hashes", []):
            bucket["hashes"].append(h.hex() if isinstance(h, bytes) else str(h))
        if kind == "BlockStored" and medium != "GPU" and medium != "none":
            bucket.setdefault("tokens_per_event", set()).add(len(e.token_ids))
    for bucket in out.values():
        if "tokens_per_event" in bucket:
            bucket["tokens_per_event"] = sorted(bucket["tokens_per_event"])
    return out


def main() -> None:
    a = args()
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = make_prompts(6, 600, step=11, seed=3)  # two 256-token chunks each
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    extra = {**a["extra"], "disk_dir": a["disk_dir"], "disk_bytes": "64MiB"}
    subscriber = Subscriber(a["events_endpoint"])
    llm = make_llm(
        a["model"],
        kv_transfer_config(extra),
        kv_events_config={
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": a["events_endpoint"],
        },
    )
    subscriber.start()

    def run(ps: list[list[int]]) -> list[list[int]]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp)
        return [list(o.outputs[0].token_ids) for o in outs]

    def reset(**kw: bool) -> None:
        reset_prefix_cache(llm, **kw)

    result: dict[str, Any] = {}
    phase("store")
    m0 = llm_metrics(llm)
    # one request at a time, so the memory tier holds the last prompts and the disk all
    out1 = [run([p])[0] for p in prompts]
    reset()
    phase("by_source")
    m1 = llm_metrics(llm)
    out2 = run(prompts)
    m2 = llm_metrics(llm)
    result["by_source"] = delta(m2, m1)
    reset()
    phase("one_read")
    twins = run([prompts[-1], prompts[-1]])
    m3 = llm_metrics(llm)
    result["one_read"] = delta(m3, m2)
    reset(reset_connector=True)
    phase("after_reset")
    out4 = run(prompts)
    m4 = llm_metrics(llm)
    result["after_reset"] = delta(m4, m3)
    reset()
    phase("new_epoch")
    out5 = run(prompts)
    m5 = llm_metrics(llm)
    result["new_epoch"] = delta(m5, m4)
    reset(reset_connector=True)
    phase("twins_ref")
    twins_ref = run([prompts[-1], prompts[-1]])
    result["twins_ref_hits"] = delta(llm_metrics(llm), m5)
    phase("end")
    subscriber.stop.set()
    subscriber.join(5)
    result.update(
        out1=out1, out2=out2, twins=twins, out4=out4, out5=out5, twins_ref=twins_ref,
        store=delta(m1, m0), events=summarize(subscriber.events),
        prompt_lens=[len(p) for p in prompts], kernels=kernel_report(),
    )  # fmt: skip
    emit(result)


if __name__ == "__main__":
    main()
