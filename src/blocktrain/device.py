"""The one place a device name becomes a torch device: every command that trains or runs a model
resolves it before anything is written or any aggregator contacted, so a device this machine
lacks is one ConfigError, never a traceback from the first `.to(device)`."""

from __future__ import annotations

import os

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


def spread_devices(workers: int, device: str, gpus: str | None) -> list[str]:
    """The device of each of a cluster's `workers` processes: `device` resolved for every one,
    or with `gpus` (N or all) round-robin over cuda:0..N-1; a ConfigError when this machine's
    torch sees fewer GPUs than asked, or none."""
    if gpus is None:
        return [str(resolve_device(device))] * workers
    if device not in ("auto", "cuda"):
        raise ConfigError(
            f"--gpus spreads the workers over cuda:0..N-1; it does not go with --device {device}"
        )
    text = str(gpus).strip()
    if text != "all" and not (text.isdigit() and int(text) > 0):
        raise ConfigError(f"--gpus {gpus!r}: expected a positive number of GPUs or all")
    if not torch.cuda.is_available():
        why = "this torch was built without CUDA" if torch.version.cuda is None else "it sees none"
        raise ConfigError(
            f"--gpus {text}: torch sees no CUDA GPU ({why}); drop --gpus to run on the CPU"
        )
    count = torch.cuda.device_count()
    n = count if text == "all" else int(text)
    if n > count:
        raise ConfigError(f"--gpus {n}: torch sees {count} CUDA GPU(s), cuda:0..cuda:{count - 1}")
    return [f"cuda:{i % n}" for i in range(workers)]


GIB = 2**30


def device_memory(device: torch.device) -> tuple[str, int | None, int | None]:
    """What `device` is and its memory: (its name, total bytes, free bytes), None where torch or the
    OS does not say."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        free: int | None
        try:
            free = int(torch.cuda.mem_get_info(index)[0])
        except (AttributeError, RuntimeError, AssertionError):
            free = None
        return f"cuda:{index} {props.name}", int(props.total_memory), free
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        total: int | None = page * os.sysconf("SC_PHYS_PAGES")
        try:
            free = page * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError):
            free = None
    except (ValueError, OSError, AttributeError):
        total = free = None
    return "cpu", total, free


def fit_verdict(
    device: torch.device, need: int | None, what: str = "the block's worker"
) -> tuple[bool, str]:
    """Whether `need` bytes (a worker's state) fit on `device`, as (ok, one line); it fails only
    when the need passes the device's total memory; None `need`: the fit is not checked."""
    name, total, free = device_memory(device)
    kind = "RAM" if device.type == "cpu" else "memory"
    if total is None:
        line = f"{name}, {kind} unknown"
    else:
        line = f"{name}, {total / GIB:.1f} GiB {kind}"
        if free is not None:
            line += f" ({free / GIB:.1f} GiB free)"
    if need is None:
        return True, f"{line}; fit not checked: no run config (it needs an accepted token)"
    line += f"; {what} needs {need / GIB:.4f} GiB (weights, gradients, AdamW, the target table and what its route holds; not activations)"
    if total is None:
        return True, f"{line}: fit not checked"
    if need > total:
        return False, f"{line}: does not fit; use a device with more memory, or a smaller config"
    tight = free is not None and need > free
    return True, f"{line}: fits" + (", but more than is free now" if tight else "")
