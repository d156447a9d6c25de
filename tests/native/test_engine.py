"""The engine without a connector: determinism, chunked prefill, preemption, limits, aborts,
stop conditions, request validation and counters."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.native import Engine, EngineConfig, SamplingParams

from .conftest import GREEDY, make_prompts


def tokens(outs) -> list[list[int]]:
    return [o.output_token_ids for o in outs]


def test_greedy_is_reproducible_and_prefix_hits_change_nothing(make_engine, prompts, baseline):
    eng = make_engine()
    first = eng.generate(prompts, GREEDY)
    assert tokens(first) == baseline  # a second engine, same tokens
    again = eng.generate(prompts, GREEDY)
    assert tokens(again) == baseline
    s = eng.stats()
    assert s["prefix_cache_queries"] == 2 * 8 * 304
    assert s["prefix_cache_hits"] == 8 * 288  # 18 of 19 blocks: the last token is recomputed
    assert all(o.num_cached_tokens == 288 for o in again)
    assert s["prompt_tokens"] == 2 * 8 * 304 and s["generation_tokens"] == 2 * 8 * 8
    assert s["requests_finished"] == 16 and s["kv_cache_usage"] == 0.0
    assert s["external_prefix_cache_queries"] == 0


def test_chunked_prefill_and_seq_limit_give_the_same_tokens(make_engine, prompts, baseline):
    eng = make_engine(max_num_batched_tokens=48, max_num_seqs=3)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    final = {}
    steps = 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        steps += 1
        assert len(eng.scheduler.running) <= 3
        final.update({o.request_id: o for o in outs if o.finished})
    assert [final[i].output_token_ids for i in ids] == baseline
    assert steps >= 8 * 304 // 48  # every prompt went through in chunks of <= 48 tokens


def test_preemption_by_recompute_keeps_outputs(make_engine):
    prompts = make_prompts(3, 160, seed=11)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = tokens(make_engine().generate(prompts, params))
    eng = make_engine(num_blocks=30)
    assert tokens(eng.generate(prompts, params)) == expected
    s = eng.stats()
    assert s["num_preemptions"] > 0
    assert s["generation_tokens"] == 3 * 40  # recomputed tokens are not generated twice
    assert eng.block_manager.num_free_blocks() == 30


def test_abort_running_and_waiting(make_engine, prompts):
    eng = make_engine(max_num_seqs=1)
    running = eng.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=50))
    waiting = eng.add_request(prompts[1], GREEDY)
    kept = eng.add_request(prompts[2], GREEDY)
    eng.step()
    assert eng.scheduler.running[0].request_id == running
    assert eng.abort(running) and eng.abort(waiting)
    assert not eng.abort(waiting) and not eng.abort("nope")
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert {o.request_id for o in outs} == {kept}
    s = eng.stats()
    assert s["requests_aborted"] == 2 and s["requests_finished"] == 1
    assert eng.block_manager.num_free_blocks() == eng.config.num_blocks


def test_stop_conditions(make_engine, prompts, baseline):
    eng = make_engine()
    stop_at = baseline[0][3]
    out = eng.generate(
        [prompts[0]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop_at,))
    )[0]
    assert out.output_token_ids == baseline[0][: baseline[0].index(stop_at) + 1]
    assert out.finish_reason == "stop"
    short = make_engine(max_model_len=306).generate([prompts[0]], GREEDY)[0]
    assert short.output_token_ids == baseline[0][:2] and short.finish_reason == "length"
    # eos stops unless ignored: the tiny model's eos is token 1
    eos_eng = make_engine()
    eos_eng.scheduler.limits.eos_token_ids = frozenset({baseline[1][2]})
    eos_out = eos_eng.generate([prompts[1]], SamplingParams(temperature=0, max_tokens=8))[0]
    assert eos_out.output_token_ids == baseline[1][:3] and eos_out.finish_reason == "stop"


def test_text_prompts_and_seeded_sampling(make_engine, tiny_model):
    eng = make_engine()
    params = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    a = eng.generate(["Kamiro neta sulo vi."], params)[0]
    b = make_engine().generate(["Kamiro neta sulo vi."], params)[0]
    assert a.output_token_ids == b.output_token_ids
    assert a.prompt_tokens == len(eng.tokenizer.encode("Kamiro neta sulo vi."))
    assert a.text == eng.tokenizer.decode(a.output_token_ids) and a.text


def test_bfloat16_runs_and_is_deterministic(make_engine, prompts):
    short = [p[:64] for p in prompts[:2]]
    a = make_engine(dtype="bfloat16").generate(short, GREEDY)
    b = make_engine(dtype="bfloat16").generate(short, GREEDY)
    assert tokens(a) == tokens(b)


def test_bad_requests_and_configs_are_clear_errors(make_engine, tiny_model):
    eng = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([])
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 2048\)"):
        eng.add_request([5, 4096])
    with pytest.raises(ValueError, match="exceeds max_model_len=64"):
        eng.add_request(list(range(65)))
    eng.add_request([5, 6], request_id="x")
    with pytest.raises(ValueError, match="'x' is still in use"):
        eng.add_request([5, 6], request_id="x")
    with pytest.raises(TypeError, match="list of prompts"):
        eng.generate("just a string")
    # these fail before any process starts
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        Engine(tiny_model, EngineConfig(tensor_parallel_size=4))
    with pytest.raises(ConfigError, match="num_key_value_heads=2"):
        Engine(tiny_model, EngineConfig(tensor_parallel_size=3))
    with pytest.raises(ConfigError, match="raise num_blocks"):
        Engine(tiny_model, EngineConfig(num_blocks=4, max_model_len=128))
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=-1)
    eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        eng.step()
