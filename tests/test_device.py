"""`blocktrain.device.resolve_device`: the one check of a device name, on any machine."""

from __future__ import annotations

import pytest
import torch

from blocktrain.device import resolve_device
from blocktrain.errors import ConfigError


def test_auto_and_cpu_resolve_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_auto_takes_the_gpu_and_cpu_stays_the_cpu_when_there_is_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match=r"sees 2 CUDA GPU\(s\), cuda:0..cuda:1"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_a_missing_gpu_is_refused_with_what_to_do(monkeypatch, name):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"is not available: .*use --device cpu"):
        resolve_device(name)


@pytest.mark.parametrize("name", ["gpu", "cuda:x", "cuda:", "mps0", ""])
def test_an_unknown_device_name_is_refused(name):
    with pytest.raises(ConfigError, match="expected auto, cpu, cuda or cuda:N"):
        resolve_device(name)
