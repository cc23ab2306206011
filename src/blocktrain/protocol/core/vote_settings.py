"""The aggregator's settings of how a round's votes are screened and combined: the rule (with
its trimming, tolerance, clipping and weighting), the defences that judge each update, and the
outer optimizer. A base of `settings.AggregatorSettings` (its fields follow RoundSettings')."""

from __future__ import annotations

from dataclasses import dataclass

from blocktrain.protocol.core.aggregation import RULES, WEIGHTINGS
from blocktrain.protocol.core.declaration import positive, setting


@dataclass(frozen=True)
class VoteSettings:
    """How votes are screened and combined (docs/protocol.md, "Settings"); built only as
    `AggregatorSettings`."""

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
    )
    weighting: str = setting(
        "identity",
        "identity: one vote per token (its workers' updates averaged first); reported: one "
        "vote per update weighted by the tokens its worker claims (unsafe, for comparison).",
        lambda v: v in WEIGHTINGS,
        f"must be one of {', '.join(WEIGHTINGS)}",
    )
    effect_probe: str = setting(
        "on",
        "on: refuse an update that raises the block's denoising loss on a fixed held-out "
        "slice by more than probe_tolerance (needs the data; see docs/protocol.md). It "
        "judges a block with the blocks it reads (route = relay, the default, and features), so an "
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
    )
    probe_step: float = setting(
        0.25,
        "Fraction of an update the effect probe applies before it reads the slice's loss: a "
        "descent direction whose whole step overshoots (an honest replica's H steps at the "
        "peak learning rate) still lowers the loss at a smaller one.",
        lambda v: 0 < v <= 1,
        "must lie in (0, 1]",
    )
    probe_z: float = setting(
        1.0,
        "Standard errors by which an update may raise the slice's loss and still be "
        "accepted: the effect probe's paired test over its windows, a threshold taken from "
        "the update itself (0: only a fall is accepted).",
        lambda v: 0 <= v <= 10,
        "must lie in [0, 10]",
    )
    probe_gain_z: float = setting(
        6.0,
        "Chance standard deviations by which an update's first-order gain on the slice must "
        "exceed what a delta of its magnitudes with random signs gains (the gain test: noise "
        "at any norm reads as a standard normal, at most 2.6 measured; honest updates 29.3 and "
        "more at tiny, 92 at small; bench/honest_spread.py); 0: only a positive gain.",
        lambda v: 0 <= v <= 50,
        "must lie in [0, 50]",
    )
    probe_budget: int = setting(
        2,
        "Updates per identity per round that may reach the effect probe and be refused; "
        "beyond them its updates are refused busy (429) before probing until the round "
        "closes (an accepted update gives its place back).",
        positive,
        "must be positive",
    )
    replay_rounds: int = setting(
        8,
        "Rounds per block whose update bodies' sketches are kept: a body within copy_distance "
        "of its identity's own accepted one is refused replay, of another identity's, pushed "
        "or accepted, copy (at most 4096 sketches per block, in memory); 0 turns this check "
        "off (an update stays bound to its worker and the round and version of its pull).",
        lambda v: v >= 0,
        "must be >= 0",
    )
    copy_distance: float = setting(
        0.05,
        "Distance between two deltas' directions (their unit sketches) within which one is a "
        "copy of the other (replay_rounds): a value moved by one ulp, noise of 1e-3 of the norm "
        "or a rescaling read 0.0012 at most, honest replicas of a block 0.226 and more at tiny, "
        "0.276 at small (bench/honest_spread.py); 0: exact copies only.",
        lambda v: 0 <= v < 1,
        "must lie in [0, 1)",
    )
    min_reputation: float = setting(
        0.1,
        "An identity whose reputation (halved by each harmful update, +0.1 per helpful one, "
        "at most 1; it weights the identity's vote) falls below this is refused, until a "
        "helpful update (still probed) lifts it back.",
        lambda v: 0 <= v <= 1,
        "must lie in [0, 1]",
    )
    max_influence: float = setting(
        1.0,
        "f: under the mean rule, no identity's term in a round's aggregate exceeds f times the "
        "median of the block's last 8 changes, tensor by tensor, whatever its weight or norm "
        "(votes are cut to it); until 8 rounds committed, clip and the norm bound alone; 0 "
        "turns it off; see docs/protocol.md, Aggregation.",
        lambda v: v >= 0,
        "must be >= 0 (0: off)",
    )
    drift_threshold: float = setting(
        5.0,
        "Flag an identity whose accepted votes on a block keep leaning one way against the "
        "others' (a count sketch of its residuals; 1 for independent noise, measured up to 4.35 "
        "for honest workers): its reputation is halved and its updates to the block are refused "
        "drift for drift_min_rounds rounds; 0 turns it off (it is off with a topk or sparse "
        "delta_wire); see docs/protocol.md, Drift.",
        lambda v: v == 0 or v > 1,
        "must be 0 (off) or > 1",
    )
    drift_min_rounds: int = setting(
        10,
        "Votes of an identity on a block observed (in rounds of 4 votes or more) from which "
        "its drift score is held to drift_threshold (after v < N votes, to drift_threshold x "
        "sqrt(N / v): a bold lean is flagged sooner), and the rounds a flagged identity is "
        "refused there.",
        positive,
        "must be positive",
    )
    outer_lr: float = setting(
        1.0,
        "Outer learning rate applied to the aggregated delta (1: plain averaging).",
        positive,
        "must be positive",
        flag="--outer-lr",
    )
    outer_momentum: float = setting(
        0.0,
        "Outer Nesterov momentum (DiLoCo); 0 turns the outer optimizer off. Refused with a "
        "topk or sparse delta_wire, whose error feedback takes its place (the two diverge).",
        lambda v: 0 <= v < 1,
        "must lie in [0, 1)",
        flag="--outer-momentum",
    )
