"""The state folder: creation, versions, pruning, pending bodies, the manifest."""

from __future__ import annotations

import json

import pytest
import torch

from blocktrain.errors import ProtocolError
from blocktrain.fsutil import atomic_write_bytes as atomic_write
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.store.storage import StateDir
from tests.protocol.conftest import SETTINGS, block_tensors, make_state


def test_create_writes_version_zero_and_refuses_to_overwrite(tmp_path):
    state = make_state(tmp_path / "s")
    assert state.initialised and state.n_blocks() == 2
    assert state.settings() == SETTINGS
    assert state.run_config()["seed"] == 5
    for b in (0, 1):
        loaded = state.load_tensors(b, 0)
        for name, t in block_tensors(100 + b).items():
            assert torch.equal(loaded[name], t)
    with pytest.raises(ProtocolError, match="already holds"):
        make_state(tmp_path / "s")
    state.close()


def test_versions_and_pruning(tmp_path):
    state = make_state(tmp_path / "s")
    for v in range(1, 6):
        state.save_tensors(0, v, block_tensors(v))
        state.save_tensors(0, v, block_tensors(v), kind="m")
    state.prune(0, current=5, keep=2)
    assert state.versions(0) == [0, 4, 5], "version 0 (the init) is always kept"
    assert state.versions(0, "m") == [4, 5]
    state.prune(0, current=5, keep=0)
    assert state.versions(0) == [0, 4, 5]
    with pytest.raises(ProtocolError, match="missing"):
        state.load_tensors(0, 2)
    state.close()


def test_pending_bodies(tmp_path):
    state = make_state(tmp_path / "s")
    name = state.write_pending(1, b"abc")
    assert state.read_pending(name) == b"abc" and state.pending_names() == [name]
    state.remove_pending(name)
    assert state.pending_names() == []
    state.close()


def test_manifest_errors(tmp_path):
    with pytest.raises(ProtocolError, match="no aggregator state"):
        StateDir(tmp_path / "none").manifest()
    state = make_state(tmp_path / "s")
    path = tmp_path / "s" / "aggregator.json"
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "format_version": 99}))
    with pytest.raises(ProtocolError, match="format_version"):
        state.manifest()
    path.write_text("{oops")
    with pytest.raises(ProtocolError, match="corrupt"):
        state.manifest()
    state.close()


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    atomic_write(tmp_path / "a" / "f.bin", b"1")
    atomic_write(tmp_path / "a" / "f.bin", b"22")
    assert (tmp_path / "a" / "f.bin").read_bytes() == b"22"
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["f.bin"]


def test_settings_validate_and_round_trip():
    s = AggregatorSettings(deadline_s=5, rule="median", outer_momentum=0.9)
    assert AggregatorSettings.from_dict(s.to_dict()) == s
    assert s.live_window == 15
    from blocktrain.errors import ConfigError

    for bad in (
        {"deadline_s": 0},
        {"rule": "mode"},
        {"wire_dtype": "fp8"},
        {"outer_momentum": 1.0},
        {"trim": 0.5},
        {"max_tokens": 0},
    ):
        with pytest.raises(ConfigError):
            AggregatorSettings(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown"):
        AggregatorSettings.from_dict({"deadline": 3})
