"""The aggregator's settings, each declared once: a field of `AggregatorSettings` with its doc,
its bounds, its command-line flag and whether the simulator models it. The CLI flags
(`cli.common.add_setting_args`), the simulator's list of flags it leaves out, the check on
construction and the table in docs/protocol.md are all derived from these declarations.
Each field is declared with `declaration.setting`; the settings derived from a run (the delta
norm and token bounds) are `bounds.derived_settings`.

The settings are saved in the state folder next to the weights (so that a restarted aggregator
runs the same protocol).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from blocktrain.errors import ConfigError
from blocktrain.protocol.core.aggregation import RULES, WEIGHTINGS
from blocktrain.protocol.core.bodies import WIRE_DTYPES
from blocktrain.protocol.core.declaration import Setting, setting
from blocktrain.protocol.core.delta_wire import (
    WIRE_HELP,
    DeltaWire,
    default_pulls,
    pull_codec,
    valid_pull_wire,
    valid_wire,
)
from blocktrain.protocol.core.pacing import PACINGS


def _positive(v: Any) -> bool:
    return bool(v > 0)


def _positive_or_none(v: Any) -> bool:
    return v is None or bool(v > 0)


@dataclass(frozen=True)
class AggregatorSettings:
    """How the aggregator runs rounds, validates and aggregates (docs/protocol.md, "Settings")."""

    deadline_s: float = setting(
        60.0,
        "Seconds from a round's first pull to its deadline.",
        _positive,
        "must be positive",
        flag="--deadline",
        metavar="S",
    )
    local_steps: int = setting(
        10,
        "H, the local AdamW steps a worker runs per round (told to workers at registration).",
        _positive,
        "must be positive",
        flag="--local-steps",
        metavar="H",
    )
    pacing: str = setting(
        "fixed",
        "fixed: every worker runs H local steps a round; adaptive: each pull tells its worker "
        "the steps that fill pacing_margin of the time left to the deadline at its measured "
        "seconds per step (between H / 8 and H), so a slow box still contributes; see "
        "docs/protocol.md, Pacing.",
        lambda v: v in PACINGS,
        f"must be one of {', '.join(PACINGS)}",
        flag="--pacing",
        choices=PACINGS,
    )
    pacing_margin: float = setting(
        0.8,
        "Share of the time left to the deadline that adaptive pacing fills (the rest absorbs "
        "the jitter of steps and transfers).",
        lambda v: 0 < v <= 1,
        "must lie in (0, 1]",
        flag="--pacing-margin",
        metavar="F",
    )
    staleness: int = setting(
        0,
        "S: an update up to S rounds late still counts, in the open round, with weight "
        "stale_weight ** lateness; 0 refuses every late update.",
        lambda v: v >= 0,
        "must be >= 0",
        flag="--staleness",
        metavar="S",
    )
    stale_weight: float = setting(
        0.5,
        "Weight factor per round of lateness within the staleness bound.",
        lambda v: 0 < v <= 1,
        "must lie in (0, 1]",
        flag="--stale-weight",
    )
    max_rounds: int | None = setting(
        None,
        "Rounds per block after which the block is done (none: run until stopped).",
        _positive_or_none,
        "must be positive (or none)",
        flag="--max-rounds",
        metavar="R",
        simulated=False,  # --rounds
    )
    rule: str = setting(
        "mean",
        "Aggregation of the votes: mean (weighted), median (coordinate-wise), trimmed_mean or "
        "centered_clip.",
        lambda v: v in RULES,
        f"must be one of {', '.join(RULES)}",
        flag="--rule",
        choices=tuple(RULES),
    )
    trim: float = setting(
        0.1,
        "Fraction trimmed at each end per coordinate by trimmed_mean.",
        lambda v: 0 <= v < 0.5,
        "must lie in [0, 0.5)",
        flag="--trim",
    )
    tolerate: int = setting(
        1,
        "f, the attackers median and trimmed_mean tolerate: they trim at least f per end and "
        "commit no change when a round has n <= 2f votes.",
        lambda v: v >= 0,
        "must be >= 0",
        flag="--tolerate",
        metavar="F",
    )
    clip: float = setting(
        2.0,
        "Clip each vote, tensor by tensor, to this many times the round's median norm of that "
        "tensor; 0 turns clipping off.",
        lambda v: v == 0 or v >= 1,
        "must be 0 (off) or >= 1",
        flag="--clip",
        metavar="C",
    )
    weighting: str = setting(
        "identity",
        "identity: one vote per token (its workers' updates averaged first); reported: one "
        "vote per update weighted by the tokens its worker claims (unsafe, for comparison).",
        lambda v: v in WEIGHTINGS,
        f"must be one of {', '.join(WEIGHTINGS)}",
        flag="--weighting",
        choices=tuple(WEIGHTINGS),
    )
    effect_probe: str = setting(
        "on",
        "on: refuse an update that raises the block's denoising loss on a fixed held-out "
        "slice by more than probe_tolerance (needs the data; see docs/protocol.md). It "
        "judges a block with the blocks it reads (route = features, the default), so an "
        "aggregator of blocks that read blocks served elsewhere (--blocks 1) needs off.",
        lambda v: v in ("on", "off"),
        "must be on or off",
        flag="--effect-probe",
        choices=("on", "off"),
    )
    probe_tolerance: float = setting(
        0.002,
        "Relative loss increase that the effect probe refuses without a reputation cost "
        "(0.002: 0.2 %; more when the block's honest band reaches higher). An update is "
        "accepted only if the loss falls.",
        lambda v: 0 <= v < 1,
        "must lie in [0, 1)",
        flag="--probe-tolerance",
    )
    probe_budget: int = setting(
        2,
        "Updates per identity per round that may reach the effect probe and be refused; "
        "beyond them its updates are refused busy (429) before probing until the round "
        "closes (an accepted update gives its place back).",
        _positive,
        "must be positive",
        flag="--probe-budget",
        metavar="N",
    )
    replay_rounds: int = setting(
        8,
        "Rounds per block whose update bodies' tensor digests are kept: the same tensors "
        "already accepted, or pushed by another identity, within them are refused replay "
        "(at most 4096 digests per block, in memory); 0 turns this check off (an update "
        "stays bound to its worker and the round and version of its pull).",
        lambda v: v >= 0,
        "must be >= 0",
        flag="--replay-rounds",
        metavar="R",
    )
    min_reputation: float = setting(
        0.1,
        "An identity whose reputation (halved by each harmful update, +0.1 per helpful one, "
        "at most 1; it weights the identity's vote) falls below this is refused, until a "
        "helpful update (still probed) lifts it back.",
        lambda v: 0 <= v <= 1,
        "must lie in [0, 1]",
        flag="--min-reputation",
    )
    outer_lr: float = setting(
        1.0,
        "Outer learning rate applied to the aggregated delta (1: plain averaging).",
        _positive,
        "must be positive",
        flag="--outer-lr",
    )
    outer_momentum: float = setting(
        0.0,
        "Outer Nesterov momentum (DiLoCo); 0 turns the outer optimizer off.",
        lambda v: 0 <= v < 1,
        "must lie in [0, 1)",
        flag="--outer-momentum",
    )
    wire_dtype: str = setting(
        "fp16",
        "dtype of weights on the wire (and of deltas unless delta_wire says otherwise).",
        lambda v: v in WIRE_DTYPES,
        f"must be one of {', '.join(WIRE_DTYPES)}",
        flag="--wire-dtype",
        choices=tuple(WIRE_DTYPES),
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
        flag="--exact-pulls",
        choices=("on", "off"),
    )
    max_delta_norm: float = setting(
        100.0,
        "Refuse updates with a larger global L2 norm.",
        _positive,
        "must be positive",
        flag="--max-delta-norm",
        default_text="2 x lr x sqrt(H x params), see delta_norm_bound",
    )
    max_tokens: int = setting(
        1 << 31,
        "Refuse updates that claim more tokens.",
        _positive,
        "must be positive",
        flag="--max-tokens",
        default_text="2 x H x batch x seq_len, see token_bound",
    )
    max_body_bytes: int | None = setting(
        None,
        "Request body limit in bytes.",
        _positive_or_none,
        "must be positive (or none)",
        flag="--max-body-bytes",
        simulated=False,
        default_text="twice the largest block's fp32 size + 1 MiB",
    )
    n_workers: int = setting(
        1024,
        "Stride of the worker data seeds: seed * n_workers + worker_id.",
        _positive,
        "must be positive",
        flag="--n-workers",
        simulated=False,  # --workers
    )
    live_window_s: float | None = setting(
        None,
        "A worker heard from within this many seconds is live.",
        _positive_or_none,
        "must be positive (or none)",
        flag="--live-window",
        metavar="S",
        simulated=False,
        default_text="3 x deadline_s",
    )
    keep_versions: int = setting(
        10,
        "Committed versions kept on disk per block, the versions `blocktrain rollback` can "
        "return to (0: keep all, e.g. to evaluate every round).",
        lambda v: v >= 0,
        "must be >= 0",
        flag="--keep-versions",
        simulated=False,
    )
    max_workers_per_token: int = setting(
        1,
        "Registered workers per token; registering one more retires the token's oldest "
        "worker (a restarted worker rejoins at once).",
        _positive,
        "must be positive",
        flag="--max-workers-per-token",
        metavar="N",
        simulated=False,  # simulated workers speak for themselves
    )
    quorum: float = setting(
        0.5,
        "Fraction of the expected replicas whose reports close a round after the grace period "
        "(1: wait for all of them, up to the deadline).",
        lambda v: 0 < v <= 1,
        "must lie in (0, 1]",
        flag="--quorum",
        metavar="F",
    )
    grace_s: float | None = setting(
        None,
        "Seconds a round stays open after its quorum reported, for the other replicas.",
        lambda v: v is None or v >= 0,
        "must be >= 0 (or none)",
        flag="--grace",
        metavar="S",
        default_text="as long as the quorum took, at least deadline_s / 10",
    )
    min_round_s: float | None = setting(
        None,
        "Seconds a round stays open, from its first pull, before it may close early (every "
        "expected replica passed, or the quorum and the grace period); the deadline is not "
        "affected. 0: no minimum (a trusted cluster).",
        lambda v: v is None or v >= 0,
        "must be >= 0 (or none)",
        flag="--min-round",
        metavar="S",
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
        flag="--live-eval-every",
        metavar="N",
        simulated=False,  # the simulator measures its own CE per round (simulate --eval-every)
    )
    live_eval_bytes: int = setting(
        4096,
        "Validation bytes the live_eval_every evaluation scores, from the split's start (at "
        "most 16384, where the effect probe's slice starts); its cost is linear in them.",
        lambda v: 0 < v <= 16384,
        "must lie in [1, 16384]",
        flag="--live-eval-bytes",
        metavar="B",
        simulated=False,
    )
    live_eval_sweeps: int = setting(
        1,
        "M, the sweeps from noise of the live_eval_every evaluation; its cost is linear in M "
        "(with M > 1 the sampler CE is plotted beside the from-noise CE).",
        lambda v: 0 < v <= 64,
        "must lie in [1, 64]",
        flag="--live-eval-sweeps",
        metavar="M",
        simulated=False,
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            meta: Setting = f.metadata["setting"]
            value = getattr(self, f.name)
            if not meta.check(value):
                raise ConfigError(f"aggregator setting {f.name} = {value!r} {meta.why}")

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
        rows.append(
            f"| `{f.name}` | `{s.flag}` | {default_text(f, s)} | "
            f"{'yes' if s.simulated else 'no'} | {s.doc} |"
        )
    return "\n".join(rows)
