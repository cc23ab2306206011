"""The aggregator's settings, each declared once (`declaration.setting`): a field of
`AggregatorSettings` with its doc, bounds, command-line flag (a few; every setting is also
`--set NAME=VALUE`) and whether the simulator models it, from which the CLI flags and `--set`
keys (`cli.common.add_setting_args`), the simulator's list of those it leaves out, the check on
construction and the table in docs/protocol.md are derived. Three groups, in this order: how a
round runs (`round_settings`), how its votes are combined (`vote_settings`), then the rest, here.
Saved in the state folder, so that a restarted aggregator runs the same protocol."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from blocktrain.config import ModelConfig, TrainConfig
from blocktrain.errors import ConfigError
from blocktrain.protocol.core.bodies import WIRE_DTYPES
from blocktrain.protocol.core.declaration import (
    Setting,
    positive,
    positive_or_none,
    setting,
)
from blocktrain.protocol.core.delta_wire import (
    FULL,
    WIRE_HELP,
    DeltaWire,
    default_pulls,
    pull_codec,
    valid_pull_wire,
    valid_wire,
)
from blocktrain.protocol.core.round_settings import RoundSettings
from blocktrain.protocol.core.vote_settings import VoteSettings


@dataclass(frozen=True)
class AggregatorSettings(VoteSettings, RoundSettings):
    """How the aggregator runs rounds, validates and aggregates (docs/protocol.md, "Settings").
    Its fields are RoundSettings', then VoteSettings', then its own: dataclasses take the bases'
    fields last base first (reversed MRO), so the bases are listed in reverse."""

    wire_dtype: str = setting(
        "fp16",
        "dtype of weights on the wire (and of deltas unless delta_wire says otherwise).",
        lambda v: v in WIRE_DTYPES,
        f"must be one of {', '.join(WIRE_DTYPES)}",
    )
    delta_wire: str | None = setting(
        None,
        "How pushed deltas travel: fp16, bf16 or fp32 (dense), int8 (a scale per row), "
        "topk:RATIO (the RATIO largest-magnitude values of each tensor, error feedback on the "
        "worker) or sparse:DENSITY[:BITS][:chunk=C][:beta=B] (the DENSITY largest of each "
        "C x C chunk, default 64, as BITS-bit values, default 4, with packed indices; error "
        "feedback decayed by beta, default 1; averaged per coordinate over the votes that carry "
        "it); see docs/protocol.md, Compressed deltas.",
        lambda v: v is None or valid_wire(v),
        f"must be {WIRE_HELP}",
        flag="--wire",
        metavar="WIRE",
        default_text="wire_dtype",
    )
    pull_wire: str | None = setting(
        None,
        "How workers pull a new version: full (the whole version in wire_dtype), or int8, "
        "topk:RATIO or sparse:DENSITY[:BITS] (a delta from the view the worker holds, error "
        "feedback in the view); see docs/protocol.md, Compressed pulls.",
        lambda v: v is None or valid_pull_wire(v),
        "must be full, int8, topk:RATIO with 0 < RATIO < 1 or sparse:DENSITY[:BITS]",
        flag="--pull-wire",
        metavar="WIRE",
        default_text="the push codec when it is int8 or topk; for sparse:D:B, "
        "sparse:2D:4 (at most 0.5); else full",
    )
    exact_pulls: str = setting(
        "on",
        "on: with a pull codec, every new version is committed as the pull codec carries it "
        "(old weights + the decoded step; what the codec left out waits at the aggregator for "
        "the next commit), so a worker that pulls each version in turn holds the weights "
        "exactly; off: a pull is the codec of (weights - the worker's view), which lags "
        "(docs/protocol.md, Compressed pulls).",
        lambda v: v in ("on", "off"),
        "must be on or off",
    )
    max_delta_norm: float = setting(
        100.0,
        "Refuse updates with a larger global L2 norm.",
        positive,
        "must be positive",
        default_text="2 x lr x sqrt(H x params), see delta_norm_bound",
    )
    max_tokens: int = setting(
        1 << 31,
        "Refuse updates that claim more tokens.",
        positive,
        "must be positive",
        default_text="2 x H x batch x seq_len, see token_bound",
    )
    max_body_bytes: int | None = setting(
        None,
        "Request body limit in bytes.",
        positive_or_none,
        "must be positive (or none)",
        simulated=False,
        default_text="twice the largest block's fp32 size + 1 MiB",
    )
    max_connections: int = setting(
        512,
        "Connections served at once (503 beyond).",
        positive,
        "must be positive",
        simulated=False,
    )
    max_connections_per_address: int | None = setting(
        None,
        "Connections at once from one client address (503 and closed beyond); behind a "
        "reverse proxy every client has the proxy's address.",
        positive_or_none,
        "must be positive (or none)",
        simulated=False,
        default_text="a quarter of max_connections",
    )
    n_workers: int = setting(
        1024,
        "Stride of the worker data seeds: seed * n_workers + worker_id.",
        positive,
        "must be positive",
        simulated=False,  # --workers
    )
    live_window_s: float | None = setting(
        None,
        "A worker heard from within this many seconds is live.",
        positive_or_none,
        "must be positive (or none)",
        simulated=False,
        default_text="3 x deadline_s",
    )
    keep_versions: int = setting(
        10,
        "Committed versions kept on disk per block, the versions `blocktrain rollback` can "
        "return to (0: keep all, e.g. to evaluate every round).",
        lambda v: v >= 0,
        "must be >= 0",
        simulated=False,
    )
    max_workers_per_token: int = setting(
        1,
        "Registered workers per token; registering one more retires the token's oldest "
        "worker (a restarted worker rejoins at once).",
        positive,
        "must be positive",
        flag="--max-workers-per-token",
        metavar="N",
        simulated=False,  # simulated workers speak for themselves
    )
    quorum: float = setting(
        0.5,
        "Fraction of the expected replicas whose accepted updates close a round after the grace "
        "period (1: wait for all of them, up to the deadline); a replica refused in the round "
        "is not waited for.",
        lambda v: 0 < v <= 1,
        "must lie in (0, 1]",
    )
    grace_s: float | None = setting(
        None,
        "Seconds a round stays open after its quorum reported, for the other replicas.",
        lambda v: v is None or v >= 0,
        "must be >= 0 (or none)",
        default_text="as long as the quorum took, at least deadline_s / 10",
    )
    min_round_s: float | None = setting(
        None,
        "Seconds a round stays open, from its first pull, before it may close early (every "
        "expected replica not refused passed, or the quorum and the grace period); the deadline is not "
        "affected. 0: no minimum (a trusted cluster).",
        lambda v: v is None or v >= 0,
        "must be >= 0 (or none)",
        default_text="deadline_s / 4",
    )

    live_eval_every: int = setting(
        0,
        "N: evaluate the assembled model (every block's version after R rounds) on the first "
        "live_eval_bytes of the validation split each time every block has closed a multiple "
        "of N rounds (and the last of max_rounds; R = 0 too, the initial model), one model at "
        "a time in a background thread, off the request path; its validation CE goes to "
        "STATE/evals.jsonl, /v1/history, the dashboard and `blocktrain report`. Needs the data "
        "and every block served here. Cost: one evaluation on one CPU thread, 0.6 s at tiny "
        "with 4096 bytes and M = 1 (linear in bytes and M). 0: off.",
        lambda v: v >= 0,
        "must be >= 0 (0: off)",
        simulated=False,  # the simulator measures its own CE per round (simulate --eval-every)
    )
    live_eval_bytes: int = setting(
        4096,
        "Validation bytes the live_eval_every evaluation scores, from the split's start (at "
        "most 16384, where the effect probe's slice starts); its cost is linear in them.",
        lambda v: 0 < v <= 16384,
        "must lie in [1, 16384]",
        simulated=False,
    )
    live_eval_sweeps: int = setting(
        1,
        "M, the sweeps from noise of the live_eval_every evaluation; its cost is linear in M "
        "(with M > 1 the sampler CE is plotted beside the from-noise CE).",
        lambda v: 0 < v <= 64,
        "must lie in [1, 64]",
        simulated=False,
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            meta: Setting = f.metadata["setting"]
            value = getattr(self, f.name)
            if not meta.check(value):
                raise ConfigError(f"aggregator setting {f.name} = {value!r} {meta.why}")
        if self.outer_momentum > 0 and DeltaWire.parse(self.push_wire).selects:
            # A selecting codec's residual re-sends late what momentum has already pushed on:
            # BENCHMARKS.md, Compressed deltas (sparse:0.03:2 with momentum 0.9 diverged)
            raise ConfigError(
                f"aggregator setting outer_momentum = {self.outer_momentum!r} cannot run with "
                f"delta_wire {self.push_wire}: with a top-k codec the workers' error feedback "
                "takes momentum's place, and the two together diverge; use outer_momentum 0"
            )

    @property
    def push_wire(self) -> str:
        """The codec of pushed deltas: delta_wire, else the weights' dtype."""
        return self.delta_wire or self.wire_dtype

    @property
    def pulls(self) -> str:
        """How pulls travel: pull_wire, else `delta_wire.default_pulls` of the push codec (full
        for a dense one, a denser sparse codec for sparse, else the push codec)."""
        if self.pull_wire is not None:
            return self.pull_wire
        return default_pulls(DeltaWire.parse(self.push_wire))

    @property
    def commit_codec(self) -> DeltaWire | None:
        """The codec every commit is made in (exact_pulls on and a pull codec), else None."""
        return pull_codec(self.pulls) if self.exact_pulls == "on" else None

    def codecs(self, run_config: dict[str, Any]) -> str:
        """Every codec a worker's bytes go through, in one line (`blocktrain doctor`, the
        dashboard and /v1/status `codecs`): pushes, pulls, and what the run's route adds."""
        push = DeltaWire.parse(self.push_wire)
        pulls = self.pulls
        text = f"pushes {push}" + (" (dense)" if push.dense else "") + ", pulls "
        if pulls == FULL:
            text += f"whole versions in {self.wire_dtype}"
        else:
            text += pulls + (" (exact commits)" if self.commit_codec else " (from the view held)")
        if run_config.get("unit", "block") != "block":
            return text  # whole reference replicas: no route between blocks
        model, train = run_config.get("model", {}), run_config.get("train", {})
        route = model.get("route", ModelConfig.route)
        if route == "relay":
            bits = train.get("relay_bits", TrainConfig.relay_bits)
            every = train.get("relay_every", TrainConfig.relay_every)
            text += f", relayed streams {bits}-bit" + (
                f", one step in {every}" if every > 1 else ""
            )
        elif route == "features":
            text += ", and the blocks before it in the same pulls (route features)"
        return text

    @property
    def min_round(self) -> float:
        """The minimum round length: min_round_s, else a quarter of the deadline (never past
        the deadline)."""
        chosen = self.min_round_s if self.min_round_s is not None else self.deadline_s / 4
        return min(chosen, self.deadline_s)

    @property
    def live_window(self) -> float:
        return self.live_window_s if self.live_window_s is not None else 3 * self.deadline_s

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AggregatorSettings:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(f"unknown aggregator setting(s): {', '.join(unknown)}")
        return cls(**data)

    def replace(self, **changes: Any) -> AggregatorSettings:
        """A copy with the given fields changed (None values are ignored)."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})


def declared() -> list[tuple[dataclasses.Field[Any], Setting]]:
    """Every setting's field and declaration, in declaration order."""
    return [(f, f.metadata["setting"]) for f in dataclasses.fields(AggregatorSettings)]


def default_text(f: dataclasses.Field[Any], s: Setting) -> str:
    if s.default_text is not None:
        return s.default_text
    return "none" if f.default is None else str(f.default)


def settings_table() -> str:
    """The markdown table of docs/protocol.md (a test holds the two equal)."""
    rows = ["| setting | flag | default | simulated | meaning |", "|---|---|---|---|---|"]
    for f, s in declared():
        flag = f"`{s.flag}`" if s.flag else "--set only"
        rows.append(
            f"| `{f.name}` | {flag} | {default_text(f, s)} | "
            f"{'yes' if s.simulated else 'no'} | {s.doc} |"
        )
    return "\n".join(rows)
