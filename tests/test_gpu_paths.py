"""Issue 30, GPUs as a first-class path, without a GPU: torch.cuda is faked as in
tests/test_device.py. `cluster --gpus` spreads its workers over the GPUs (the argv each worker
gets), too many GPUs or none are refused before anything is written, and doctor's device line
says the device, its memory and whether the block fits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from blocktrain.cli.doctor import device_check
from blocktrain.cli.main import main
from blocktrain.device import GIB, fit_verdict, spread_devices
from blocktrain.errors import ConfigError
from blocktrain.protocol.ops.cluster import worker_argv
from tests.conftest import micro_config


def fake_gpus(monkeypatch, count: int, memory: int = 80 * GIB) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    props = SimpleNamespace(name="Fake GPU", total_memory=memory)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (memory // 2, memory))


def test_gpus_spread_the_workers_round_robin_into_their_argv(monkeypatch):
    fake_gpus(monkeypatch, 4)
    assert spread_devices(5, "auto", "2") == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"]
    devices = spread_devices(3, "auto", "all")
    assert devices == ["cuda:0", "cuda:1", "cuda:2"]
    argv = worker_argv("http://127.0.0.1:1", name="worker-2", data=None, device=devices[2])
    assert argv[argv.index("--device") + 1] == "cuda:2"
    assert "--device" not in worker_argv("http://127.0.0.1:1", name="w", data=None)
    assert spread_devices(2, "cpu", None) == ["cpu", "cpu"]


@pytest.mark.parametrize(
    ("count", "gpus", "device", "match"),
    [
        (2, "3", "auto", "--gpus 3: torch sees 2 CUDA GPU(s)"),
        (0, "all", "auto", "--gpus all: torch sees no CUDA GPU"),
        (0, "1", "auto", "--gpus 1: torch sees no CUDA GPU"),
        (2, "0", "auto", "expected a positive number of GPUs or all"),
        (2, "2", "cpu", "does not go with --device cpu"),
    ],
)
def test_gpus_refusals(monkeypatch, count, gpus, device, match):
    fake_gpus(monkeypatch, count)
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        spread_devices(2, device, gpus)


@pytest.mark.parametrize(("count", "gpus"), [(1, "2"), (0, "all")])
def test_cluster_gpus_refused_with_one_line_and_nothing_written(
    monkeypatch, capsys, tmp_path, count, gpus
):
    fake_gpus(monkeypatch, count)
    out = tmp_path / "c"
    argv = ["cluster", "--workers", "2", "--preset", "tiny", "--rounds", "1", "--out", str(out)]
    assert main([*argv, "--gpus", gpus, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("blocktrain: error: --gpus"), err
    assert not out.exists()


def test_serve_block_refuses_a_missing_device_before_binding(monkeypatch, capsys, tmp_path):
    import blocktrain.cli.serve_block as serve_block

    fake_gpus(monkeypatch, 0)
    monkeypatch.setattr(serve_block, "bind", lambda *a: pytest.fail("bound a port"))
    argv = ["serve-block", str(tmp_path / "run"), "--blocks", "0", "--port", "0"]
    assert main([*argv, "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "device 'cuda' is not available" in err[0], err


def test_the_device_line_on_the_cpu_says_ram_and_the_fit(monkeypatch):
    fake_gpus(monkeypatch, 0)
    cfg = micro_config().to_dict()
    check = device_check("auto", cfg, None)
    assert check.ok is True and check.name == "device"
    assert check.detail.startswith("cpu, ") and "GiB RAM" in check.detail
    assert check.detail.endswith(": fits") or "fits, but" in check.detail
    assert "worker" in check.detail and "needs" in check.detail
    assert check.line().startswith("ok   device   cpu")
    unchecked = device_check("cpu", None, None)
    assert unchecked.ok is True and "fit not checked" in unchecked.detail


def test_the_device_line_on_a_faked_gpu_and_the_verdict(monkeypatch):
    fake_gpus(monkeypatch, 2, memory=16 * GIB)
    cfg = micro_config().to_dict()
    check = device_check("cuda:1", cfg, 0)
    assert check.ok is True, check.detail
    assert check.detail.startswith("cuda:1 Fake GPU, 16.0 GiB memory (8.0 GiB free)")
    assert "block 0's worker needs" in check.detail
    missing = device_check("cuda:2", cfg, None)
    assert missing.ok is False and "torch sees 2 CUDA GPU(s)" in missing.detail
    ok, line = fit_verdict(torch.device("cuda:0"), 17 * GIB)
    assert not ok and "does not fit" in line
    ok, line = fit_verdict(torch.device("cuda:0"), 9 * GIB)
    assert ok and line.endswith("fits, but more than is free now")


def test_serve_block_hosts_its_blocks_on_the_gpu_it_is_given(monkeypatch, tmp_path):
    """`serve-block --device cuda:1` resolves the GPU before the port is bound and hands it to
    the host's settings (the host loads its blocks there, host_app.create_app); auto is the
    first GPU when torch sees one."""
    import blocktrain.cli.serve_block as serve_block

    fake_gpus(monkeypatch, 2)
    seen: list[torch.device] = []

    class Stop(Exception):
        pass

    def fake_create_app(settings):
        seen.append(settings.device)
        raise Stop

    sock = SimpleNamespace(close=lambda: None, getsockname=lambda: ("127.0.0.1", 1))
    monkeypatch.setattr(serve_block, "bind", lambda *a: sock)
    monkeypatch.setattr(serve_block, "url_of", lambda *a, **k: "http://127.0.0.1:1")
    monkeypatch.setattr(serve_block, "create_app", fake_create_app)
    argv = ["serve-block", str(tmp_path / "run"), "--blocks", "0", "--port", "0"]
    for device, expected in (("cuda:1", "cuda:1"), ("auto", "cuda"), ("cpu", "cpu")):
        with pytest.raises(Stop):
            main([*argv, "--device", device])
        assert seen[-1] == torch.device(expected), (device, seen)


def test_serve_block_refuses_a_gpu_this_machine_lacks_before_binding(monkeypatch, capsys, tmp_path):
    import blocktrain.cli.serve_block as serve_block

    fake_gpus(monkeypatch, 1)
    monkeypatch.setattr(serve_block, "bind", lambda *a: pytest.fail("bound a port"))
    argv = ["serve-block", str(tmp_path / "run"), "--blocks", "0", "--port", "0"]
    assert main([*argv, "--device", "cuda:3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch sees 1 CUDA GPU(s)" in err[0], err
