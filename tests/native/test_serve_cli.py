"""The `kvtier` command: `kvtier serve` at TP=2 serves sampling edge values and exits 1 with a
clear log line when a rank dies; config errors exit 2 without a traceback; `kvtier model init`
writes a loadable model with a chat template; `kvtier --help` imports no heavy module."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import psutil
from typer.testing import CliRunner

from kvtier.cli import LAZY, load_command
from kvtier.cli import app as cli_app
from kvtier.native import Engine, EngineConfig, SamplingParams
from kvtier.native.tokenizer import Tokenizer
from tests.native.cli_server import kvtier_serve

CONFIG = "chunk_size: 64\nmemory_bytes: 64MiB\nload_gate: false\n"
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True, "return_token_ids": True}
EDGE = [{"temperature": 1e-39}, {"temperature": 1e-45}, {"temperature": 1e-300},
        {"top_p": 1e-300}]  # fmt: skip


def test_cli_serve_tp2_serves_edge_values_then_a_dead_rank_exits_1(
    tiny_model, tmp_path, prompts, baseline
):
    with kvtier_serve(tiny_model, tmp_path, tp=2, config=CONFIG) as srv:
        assert "TP=2" in srv.out.text and "offload on" in srv.out.text
        assert "kvtier: lookup client on ranks [0, 1] (world=2)" in srv.out.text
        with httpx.Client(base_url=srv.base, timeout=60.0) as c:
            assert c.get("/health").status_code == 200
            r = c.post("/v1/completions", json={"prompt": prompts[0], **GREEDY})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == baseline[0]
            # the values that used to kill the engine (500, then 503 with tracebacks at TP=2)
            base = {"prompt": "hi", "max_tokens": 4, "return_token_ids": True}
            want = c.post("/v1/completions", json={**base, "temperature": 0}).json()
            for edge in EDGE:
                r = c.post("/v1/completions", json={**base, **edge})
                assert r.status_code == 200, (edge, r.text)
                assert r.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
            workers = psutil.Process(srv.proc.pid).children()
            assert len(workers) == 2, workers
            workers[1].kill()
            # vLLM's behaviour: a dead rank ends the server, with a nonzero exit and one line
            assert srv.proc.wait(timeout=30) == 1, srv.out.text[-3000:]
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, alive
        line = srv.out.wait_for("kvtier serve: exiting with code 1: engine failed:", 10.0)
        assert f"TP rank 1 (pid {workers[1].pid})" in line
        assert srv.out.text.count("the server exits") == 1


def test_cli_serve_config_error_exits_nonzero_without_traceback(tiny_model):
    result = CliRunner().invoke(
        cli_app, ["serve", str(tiny_model)], env={"KVTIER_CHUNK_SIZE": "33"}
    )
    assert result.exit_code == 2
    assert "chunk_size=33 is not a positive multiple of 16" in result.output
    assert "KVTIER_CHUNK_SIZE" in result.output and "Traceback" not in result.output
    bad = CliRunner().invoke(cli_app, ["serve", str(tiny_model), "--stall-timeout", "0"])
    assert bad.exit_code == 2 and "--stall-timeout 0.0 must be > 0 seconds" in bad.output


def test_cli_model_init_writes_a_loadable_model_with_a_chat_template(tmp_path):
    target = tmp_path / "m"
    args = ["model", "init", str(target), "--dtype", "float32", "--layers", "2", "--hidden", "128",
            "--heads", "2", "--kv-heads", "1", "--intermediate", "256", "--seed", "3"]  # fmt: skip
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 0, result.output
    assert f"to {target}" in result.output and "model.safetensors" in result.output
    config = json.loads((target / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and config["hidden_size"] == 128
    template = json.loads((target / "tokenizer_config.json").read_text())["chat_template"]
    assert "add_generation_prompt" in template
    prompt = Tokenizer(target).apply_chat_template([{"role": "user", "content": "ka ro"}])
    assert prompt == "<s>User: ka ro\nAssistant:"
    with Engine(target, EngineConfig(num_threads=1, num_blocks=32)) as eng:
        (out,) = eng.generate(["ka ro mi"], SamplingParams(temperature=0, max_tokens=4))
    assert len(out.output_token_ids) == 4
    bad = CliRunner().invoke(cli_app, ["model", "init", str(tmp_path / "x"), "--dtype", "int8"])
    assert bad.exit_code == 2 and "dtype='int8'" in bad.output


def test_cli_help_imports_no_heavy_module():
    # `kvtier --help` in a fresh interpreter: the command table must not pull in the engine
    code = (
        "import sys\n"
        "from kvtier.cli import app\n"
        "try:\n"
        "    app(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('torch', 'matplotlib', 'numpy', 'kvtier.native', 'kvtier.doctor',"
        " 'kvtier.bench') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout[-2000:]
    for name in ("doctor", "plan", "serve", "bench"):
        assert name in out.stdout


def test_lazy_commands_list_their_own_first_docstring_line():
    for group in LAZY.values():
        for name, (path, short) in group.items():
            cmd = load_command(name, path)
            assert (cmd.help or "").strip().splitlines()[0] == short, name
    doctor = CliRunner().invoke(cli_app, ["doctor", "--help"])
    assert doctor.exit_code == 0 and "Check a running kvtier server" in doctor.output

