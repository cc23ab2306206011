"""How the router runs (`RouterSettings`): the hosts of its chain (a position may hold replicas),
what travels on the wire, and every limit on what a request may ask; each checked when the
settings are made, so that a bad flag of `blocktrain serve` is one line before anything starts.
The work itself is `chain_router.py`. `FLAGS`: the fields that `serve` gives a flag of their own;
every other is `--set NAME=VALUE` (docs/serving.md, Settings)."""

from __future__ import annotations

from dataclasses import dataclass, field

from blocktrain.errors import ConfigError
from blocktrain.model.speculative import Drafter
from blocktrain.serving.router.replicas import parse_positions
from blocktrain.serving.shared.transport import check_url


def _positions(hosts: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return parse_positions(hosts, lambda url: check_url(url, "--hosts entry"))


@dataclass(frozen=True)
class RouterSettings:
    """How the router runs."""

    hosts: tuple[str, ...]
    """Block hosts, in chain order (the first receives each request); an entry may name
    replicas of one position as `URL|URL` (replicas.py)."""
    hop_ms: float = 0.0
    """Emulated one-way latency of the link to each host, each way (see shared/transport.py)."""
    timeout_s: float = 300.0
    """Read timeout of one traversal of the chain."""
    wire_dtype: str = "fp32"
    """dtype of the state on the wire: fp32 (exact) or fp16 (half the bytes)."""
    sample_on: str = "router"
    """Where the final bytes are drawn: 'router' (the last host returns logits) or
    'last-host' (it returns bytes; the generator state travels with the state)."""
    max_prompt_bytes: int = 65536
    """Longest prompt accepted."""
    max_output_bytes: int = 4096
    """Most bytes generated per request."""
    max_steps_per_block: int = 16
    """Largest steps_per_block a request may ask for."""
    drafter: Drafter | None = None
    """Drafts bytes for speculative generation with K = 1 models (requests' draft_bytes): a
    byte n-gram (data.ngram) or a small autoregressive model (model.speculative.ModelDrafter)."""
    draft_order: int = 3
    """Context bytes of the byte n-gram drafter that serve builds from --draft-corpus (unused
    without it)."""
    max_draft_bytes: int = 32
    """Largest draft_bytes a request may ask for."""
    draft_bytes: int = 0
    """draft_bytes of the requests that leave it out, where drafting applies: a K = 1 or
    autoregressive model, and no logprobs asked (0: requests opt in)."""
    max_body_bytes: int = 1 << 20
    """Largest request body accepted (a prompt of 65536 byte values as a JSON list fits)."""
    rate_per_minute: int = 600
    """Generation requests a minute per client address (0: no limit): a flood of cheap
    requests; the work limits below bound the compute."""
    max_work: int = 4096
    """Most work in one request, in bytes x steps_per_block (limits.work_units)."""
    max_work_in_flight: int = 16384
    """Most work of all requests in flight together."""
    max_work_per_client: int | None = None
    """Most work of one client's requests in flight together, a client being an address, and
    a token too when the router takes tokens; None: half of max_work_in_flight (and at least
    max_work), so one client cannot hold the whole budget."""
    send_timeout_s: float = 30.0
    """A stream whose client reads none of it for this long (one send blocked) is ended, and
    its work released (openai/openai_api.py, `_Stream`)."""
    park_after_s: float = 2.0
    """A stream whose client has read none of it for this long gives its work back to the work
    in flight (it computes nothing while its send waits), though not to its client's share,
    and takes it again when the client reads, waiting up to send_timeout_s for room: streams
    nobody reads hold none of the work in flight, from however many addresses, and an address
    that opens stream after stream holds at most its share, parked or not (bench/live_attacks.py,
    unread_streams_4_addresses)."""
    secret: str | None = field(default=None, repr=False)
    """The hosts' shared secret, sent with every request to them (shared/auth.py)."""
    tokens: frozenset[str] = field(default=frozenset(), repr=False)
    """SHA-256 digests of the clients' tokens (`--set tokens_file=PATH`, router/client_tokens.py): when
    any, every /v1/ request needs one, and the work limits count it against its token as well
    as its address. Empty: the router is open, and a client is its address."""
    ca_cert: str | None = None
    """PEM bundle to verify https hosts against (None: the system's CAs)."""
    coalesce_sweeps: int = 64
    """Most sweeps of concurrent generations sent to one host in one request (shared/coalesce.py);
    1: each its own request. At most the hosts' `HostSettings.max_batch` (64 too)
    (bench/serving_load.py compares, bench/serving_procs.py)."""
    coalesce_window_ms: float = 0.0
    """How long a sweep waits for others bound for the same host (0: none; those that arrive
    while a request to the host is in flight go together after it)."""

    @property
    def work_per_client(self) -> int:
        """Work one client (an address, a token) may have in flight at once."""
        if self.max_work_per_client is not None:
            return self.max_work_per_client
        return max(self.max_work, self.max_work_in_flight // 2)

    @property
    def positions(self) -> tuple[tuple[str, ...], ...]:
        """The replicas of each position of the chain."""
        return _positions(self.hosts)

    def __post_init__(self) -> None:
        if not self.hosts:
            raise ConfigError("--hosts must name at least one block host")
        _positions(self.hosts)  # checks every URL, and that none appears twice
        if self.hop_ms < 0:
            raise ConfigError(f"hop_ms = {self.hop_ms} must be >= 0")
        if self.timeout_s <= 0:
            raise ConfigError(f"timeout_s = {self.timeout_s} must be positive")
        if self.wire_dtype not in ("fp32", "fp16"):
            raise ConfigError(f"wire_dtype = {self.wire_dtype!r} must be fp32 or fp16")
        if self.sample_on not in ("router", "last-host"):
            raise ConfigError(f"sample_on {self.sample_on!r} must be router or last-host")
        for name in (
            "max_prompt_bytes",
            "max_output_bytes",
            "max_steps_per_block",
            "max_draft_bytes",
            "max_body_bytes",
            "max_work",
            "max_work_in_flight",
            "coalesce_sweeps",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} = {getattr(self, name)} must be positive")
        if not 0 <= self.draft_bytes <= self.max_draft_bytes:
            raise ConfigError(
                f"--draft-bytes {self.draft_bytes} must lie in 0..{self.max_draft_bytes}"
            )
        if self.draft_bytes and self.drafter is None:
            raise ConfigError("--draft-bytes needs a drafter: --draft-corpus or --draft-model")
        if self.coalesce_window_ms < 0:
            raise ConfigError(f"coalesce_window_ms = {self.coalesce_window_ms} must be >= 0")
        if self.rate_per_minute < 0:
            raise ConfigError(f"--rate-limit {self.rate_per_minute} must be >= 0 (0: none)")
        if self.send_timeout_s <= 0:
            raise ConfigError(f"send_timeout_s = {self.send_timeout_s} must be positive")
        if self.park_after_s <= 0:
            raise ConfigError(f"park_after_s = {self.park_after_s} must be positive")
        if self.max_work_per_client is not None and not (
            self.max_work <= self.max_work_per_client <= self.max_work_in_flight
        ):
            raise ConfigError(
                f"max_work_per_client = {self.max_work_per_client} must lie in max_work "
                f"{self.max_work} .. max_work_in_flight {self.max_work_in_flight}"
            )
        if self.max_work > self.max_work_in_flight:
            raise ConfigError(
                f"max_work = {self.max_work} exceeds max_work_in_flight "
                f"{self.max_work_in_flight}: no request could ever run"
            )


FLAGS = {
    "hosts": "--hosts",
    "drafter": "--draft-corpus / --draft-model",
    "draft_bytes": "--draft-bytes",
    "rate_per_minute": "--rate-limit",
    "secret": "--secret-file",
    "tokens": "--set tokens_file=PATH",
}
"""The fields `serve` sets from a flag of its own."""
