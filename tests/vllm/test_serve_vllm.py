"""`vllm serve` with KVTierConnector: completions over HTTP restore from the tier after vLLM's
prefix cache is reset, `/metrics` (vLLM's and kvtier's families) closes the identities, and
`kvtier doctor` passes on it."""

from __future__ import annotations

import re

from kvtier.doctor import Status, diagnose
from tests.vllm.conftest import CHUNK, loadable_tokens, retrieved_lines


def test_serve_restores_over_http_and_metrics_close(vllm_served: dict) -> None:
    # one `vllm serve` run per session, shared with the native-vs-vLLM and deploy tests
    r = vllm_served
    want = loadable_tokens(r["prompt_lens"], CHUNK)
    m = r["metrics"]

    assert r["exit_code"] == 0
    # drained server: every queried token missed HBM was asked of the connector, and nothing else
    assert (
        m["vllm:prefix_cache_queries_total"] - m["vllm:prefix_cache_hits_total"]
        == m["vllm:external_prefix_cache_queries_total"]
    )
    assert m["vllm:prefix_cache_queries_total"] == 2 * sum(r["prompt_lens"])
    assert m["vllm:prefix_cache_hits_total"] == 0
    assert m["vllm:external_prefix_cache_hits_total"] == want > 0
    assert m["vllm:prompt_tokens_cached_total"] == want
    # per request: pass 2 says where its prefix came from, and decodes the same text
    assert [x["cached"] for x in r["pass1"]] == [0] * len(r["prompt_lens"])
    assert sum(x["cached"] for x in r["pass2"]) == want
    assert [x["text"] for x in r["pass2"]] == [x["text"] for x in r["pass1"]]
    # the server's worker logged every load, and kvtier's families on vLLM's own /metrics
    # close the second identity: sum over ranks of retrieved tokens / TP == external hits
    before = "\n".join(r["kvtier_lines"][: r["lines_before_hostile"]])
    lines = retrieved_lines(before)
    assert [(x.rank, x.world, x.failed) for x in lines] == [(0, 1, None)] * len(r["prompt_lens"])
    assert sum(x.got for x in lines) == m["vllm:external_prefix_cache_hits_total"]
    kv = r["kvtier"]
    assert kv["kvtier_retrieved_tokens_total{rank=0}"] == m["vllm:external_prefix_cache_hits_total"]
    assert kv["kvtier_stored_tokens_total{rank=0}"] == want
    assert not [k for k in kv if k.startswith("kvtier_load_failures_total")]
    assert "kvtier: lookup client on ranks [0] (world=1)" in before

    # and `kvtier doctor` reads a vLLM server's /metrics like a native one: nothing fails
    checks = {c.name: c for c in diagnose(r["metrics_text"], before, 1)}
    failed = {name: c.detail for name, c in checks.items() if c.status is Status.FAIL}
    assert not failed, failed
    for name in ("lookup client on every rank", "every rank retrieving", "identities"):
        assert checks[name].status is Status.PASS, (name, checks[name].detail)


def test_a_client_request_id_of_any_length_is_served_and_the_server_lives(
    vllm_served: dict,
) -> None:
    """vLLM takes a client's X-Request-Id header as the request id; kvtier built its lookup id
    from it and refused one over 256 characters inside the scheduler's hook, which ended
    EngineCore: the long-id request got a 500 and every later request a refused connection."""
    r = vllm_served
    assert [x["id_chars"] for x in r["hostile"]] == [300, 4000, 0]
    assert [x["status"] for x in r["hostile"]] == [200, 200, 200], r["hostile"]
    # the long-id request's lookup ran and the tier served its prefix (reset before it)
    want = loadable_tokens(r["prompt_lens"][:1], CHUNK)
    assert r["hostile"][0]["cached"] == want
    assert r["exit_code"] == 0
    # not even contained: a long id is no failure at all
    assert not re.search(r"hook \w+ failed", "\n".join(r["kvtier_lines"]))


def test_a_retention_hint_in_kv_transfer_params_is_granted_and_answered(
    vllm_served: dict,
) -> None:
    """vLLM hands a connector one per-request channel, `kv_transfer_params`: OpenAI's
    prompt_cache_key/prompt_cache_retention there retain the prompt's whole chunks, and the
    response's `kv_transfer_params` says what was granted; a bad hint is ignored, not fatal."""
    r = vllm_served
    granted, bad = r["retention"]
    whole = (r["prompt_lens"][0] // CHUNK) * CHUNK
    assert granted == {
        "kvtier_retention": {"status": "retained", "retained_tokens": whole, "ttl_s": 86400.0}
    }
    assert bad is None
    assert "retention hint ignored: prompt_cache_retention is 'forever'" in "\n".join(
        r["kvtier_lines"]
    )
