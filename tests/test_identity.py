"""Model identity: a namespace that names the weights, so two checkpoints with the same
config.json and directory name never share chunk keys (issue 10 item 2)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvtier.errors import ConfigError
from kvtier.identity import model_identity, snapshot_revision
from kvtier.keys import Namespace, chain_keys, key_seed

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2}
TOKENS = list(range(512))


def checkpoint(root: Path, seed: int, *, name: str = "model", rows: int = 8192) -> Path:
    """A model directory: the same config.json for every seed, weights drawn from `seed`."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(CONFIG))
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(rows, 64, generator=g)}, str(d / "model.safetensors"))
    return d


def keys_of(model_id: str) -> tuple[list[bytes], bytes]:
    ns = Namespace(model_id, bytes(16), "float32", 64, 1, 0)
    return chain_keys(TOKENS, 64, key_seed(model_id, 64)), ns.fingerprint


def test_same_config_and_dir_name_with_other_weights_share_no_keys(tmp_path):
    a = checkpoint(tmp_path / "a", seed=0)
    b = checkpoint(tmp_path / "b", seed=1)
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    ida, idb = model_identity(a), model_identity(b)
    assert ida.split(":")[0] == idb.split(":")[0] == "model"
    assert ida != idb
    keys_a, ns_a = keys_of(ida)
    keys_b, ns_b = keys_of(idb)
    assert not set(keys_a) & set(keys_b) and ns_a != ns_b
    # the same weights elsewhere (a copy, another parent) are the same model
    c = tmp_path / "c" / "model"
    shutil.copytree(a, c)
    assert model_identity(c) == ida


def test_identity_follows_weight_content_not_mtimes(tmp_path):
    d = checkpoint(tmp_path, seed=0)
    base = model_identity(d)
    st = (d / "model.safetensors").stat()
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**12))
    assert model_identity(d) == base  # a touch is no new model
    # one value changed in place (same size, same header): the 2 MiB file is sampled, and the
    # last window ends at its last byte
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (d / "model.safetensors").write_bytes(raw)
    changed = model_identity(d)
    assert changed != base
    # another shard, and an explicit revision, are new identities too
    save_file({"x": torch.zeros(2)}, str(d / "extra.safetensors"))
    assert model_identity(d) != changed
    assert model_identity(d, "v2") != model_identity(d) != model_identity(d, "v3")


def test_snapshot_revision_names_the_commit_and_dir_without_config_is_refused(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "models--org--tiny" / "snapshots" / commit
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(CONFIG))
    assert snapshot_revision(snap) == commit
    ident = model_identity(snap)  # weights not needed: a snapshot commit is immutable
    assert ident.startswith("org/tiny:")
    other = tmp_path / "models--org--tiny" / "snapshots" / ("f" * 40)
    shutil.copytree(snap, other)
    assert model_identity(other) != ident
    assert snapshot_revision(tmp_path) is None
    with pytest.raises(ConfigError, match="has no config.json"):
        model_identity(tmp_path)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds no weight files"):
        model_identity(bare)


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private XDG cache for the weights digests of one test."""
    home = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home))
    return home


def test_a_partial_fine_tune_between_sampled_windows_is_a_new_identity(tmp_path, cache_home):
    """The identity hashed 16 windows of 64 KiB per weight file: a fine-tune that changed
    only bytes between them (same config.json, same size, same header) kept the identity and
    was served the old weights' KV."""
    d = checkpoint(tmp_path, seed=0, rows=65536)  # 16 MiB of weights
    base = model_identity(d)
    raw = bytearray((d / "model.safetensors").read_bytes())
    raw[len(raw) // 2] ^= 0x01  # halfway: between the 8th and 9th sampled windows
    (d / "model.safetensors").write_bytes(raw)
    assert model_identity(d) != base


def test_the_weights_digest_is_hashed_once_and_again_only_when_a_file_changes(
    tmp_path, cache_home, monkeypatch, caplog
):
    import logging

    from kvtier import identity

    d = checkpoint(tmp_path, seed=0)
    hashed: list[str] = []
    real = identity._hash_file
    monkeypatch.setattr(identity, "_hash_file", lambda p: hashed.append(p.name) or real(p))
    caplog.set_level(logging.INFO, logger="kvtier")
    first = model_identity(d)
    assert hashed == ["model.safetensors"]
    assert "hashed 1 weight files" in caplog.text and "later starts read it from" in caplog.text
    assert model_identity(d) == first and hashed == ["model.safetensors"]  # a restart: cached
    # the cache is private: another user can neither read what was hashed nor plant a digest
    cache = next(cache_home.rglob("*.json"))
    assert (cache.stat().st_mode & 0o777, cache.parent.stat().st_mode & 0o777) == (0o600, 0o700)
    st = (d / "model.safetensors").stat()
    os.utime(d / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert model_identity(d) == first and len(hashed) == 2  # touched: hashed again, same bytes
    # a cache others could write is not believed: the weights are hashed instead
    cache.parent.chmod(0o777)
    assert model_identity(d) == first and len(hashed) == 3
