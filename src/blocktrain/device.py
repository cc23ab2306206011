"""The one place a device name (`--device`, the config's `device`) becomes a torch device.

Every command that trains or runs a model goes through `resolve_device`, before anything is
written or any aggregator is contacted: a device this machine does not have is one ConfigError
(one `blocktrain: error:` line, exit 2), never a traceback from the first `.to(device)`.
"""

from __future__ import annotations

import torch

from blocktrain.errors import ConfigError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"
DEVICE_HELP = (
    "where the model runs: auto (the first GPU when torch sees one, else the CPU), cpu, cuda "
    "or cuda:N; a device this machine lacks exits 2 before anything is written"
)


def resolve_device(name: str) -> torch.device:
    """`name` (auto, cpu, cuda, cuda:N) as a device this machine has; a ConfigError naming
    what is missing otherwise."""
    name = str(name).strip()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    kind, sep, index = name.partition(":")
    if kind != "cuda" or (sep and not index.isdigit()):
        raise ConfigError(f"device {name!r}: expected {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) was built without CUDA"
            if torch.version.cuda is None
            else "torch sees no CUDA GPU"
        )
        raise ConfigError(
            f"device {name!r} is not available: {why}; use --device cpu (or auto), or install "
            "a CUDA build of torch on a machine with a GPU"
        )
    count = torch.cuda.device_count()
    if sep and int(index) >= count:
        raise ConfigError(
            f"device {name!r} is not available: torch sees {count} CUDA GPU(s), "
            f"cuda:0..cuda:{count - 1}"
        )
    return torch.device(name)
