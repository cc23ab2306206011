"""How one block host runs (`HostSettings`): the runs it serves and the blocks it holds, where it
passes the state on, and the bounds on its requests, batches and caches; each checked when the
settings are made, so that a bad flag of `blocktrain serve-block` is one line before anything
starts. The work itself is `block_host.py`. `FLAGS`: the fields that `serve-block` gives a flag
of their own; every other is `--set NAME=VALUE` (docs/serving.md, Settings)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from blocktrain.errors import ConfigError
from blocktrain.serving.host.loading import ModelSource


@dataclass(frozen=True)
class HostSettings:
    """How one block host runs."""

    models: tuple[ModelSource, ...]
    """The run folders served here, each under a model name."""
    parts: tuple[int, ...]
    """The blocks (of a BlockTrain run) or stages (of a reference run) this host holds."""
    next_url: str | None = None
    """Where to forward the state (a chain without a router); None: answer it to the caller
    (the router sends it on to the next host of its route)."""
    public_url: str = "http://127.0.0.1"
    """How this host names itself in /healthz, /v1/info, traces and errors, e.g. behind NAT or
    listening on 0.0.0.0 (default: http://HOST:PORT, as bound)."""
    hop_ms: float = 0.0
    """Emulated one-way latency of the link to --next, each way (see shared/transport.py)."""
    timeout_s: float = 300.0
    """Read timeout when forwarding to the next host."""
    max_body_bytes: int = 256 * 2**20
    """Largest request body accepted."""
    max_batch: int = 64
    """Most sequences in one request."""
    max_sessions: int = 256
    """Generations whose caches are kept at once (least recently used dropped first)."""
    session_ttl_s: float = 600.0
    """A generation's caches unused this long are dropped (it was abandoned)."""
    secret: str | None = field(default=None, repr=False)
    """The shared secret callers must present (shared/auth.py), and this host presents to its
    --next; None: anyone may call (loopback only, see cli/serve_block.py)."""
    ca_cert: str | None = None
    """PEM bundle to verify an https --next against (None: the system's CAs)."""
    batch_window_ms: float = 0.0
    """How long a sweep waits for others to share its forward pass (shared/batching.py). 0: none; a
    sweep that finds the host idle runs at once, and those that arrive while a batch computes
    go together after it (bench/serving_load.py: 4.35x at 32 clients)."""
    batch_rows: int = 64
    """Most sequences in one batched forward pass; 1 turns batching off
    (bench/serving_load.py compares, bench/serving_procs.py)."""
    kv_cache: bool = True
    """Keep each generation's clean stream per block (model/cached.py); off: every sweep
    computes its whole context."""
    max_cache_bytes: int = 1 << 30
    """The bytes all kept caches (clean streams and autoregressive KV) may take; the least
    recently used generations are dropped past it."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the blocks (and their caches) live and run: the CPU, or a GPU that
    `device.resolve_device` found (`serve-block --device`). The wire stays on the CPU."""

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("a block host needs at least one RUN_DIR to serve")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError(f"model names must differ on one host: {names}; use NAME=RUN_DIR")
        if not self.parts or len(set(self.parts)) != len(self.parts):
            raise ConfigError(f"--blocks {list(self.parts)} must name distinct blocks")
        if self.hop_ms < 0:
            raise ConfigError(f"hop_ms = {self.hop_ms} must be >= 0")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s = {self.timeout_s} must be positive")
        if self.batch_window_ms < 0:
            raise ConfigError(f"--batch-window-ms {self.batch_window_ms} must be >= 0")
        for name in (
            "max_body_bytes",
            "max_batch",
            "max_sessions",
            "batch_rows",
            "max_cache_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} = {getattr(self, name)} must be positive")


FLAGS = {
    "models": "RUN_DIR",
    "parts": "--blocks",
    "next_url": "--next",
    "secret": "--secret-file",
    "batch_window_ms": "--batch-window-ms",
    "kv_cache": "--no-kv-cache",
    "max_cache_bytes": "--max-cache-mb",
    "device": "--device",
}
"""The fields `serve-block` sets from a flag (or its positional RUN_DIR) of their own."""
