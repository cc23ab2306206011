"""Verdicts and the refusal reasons they carry: one table, read by the aggregator (HTTP status),
the validators, the round state machine and docs/protocol.md; `refused` turns a reason into the
exception a refusal raises.

Pure: no HTTP, SQLite or torch here, so the simulator can import it with `rounds`.
"""

from __future__ import annotations

from dataclasses import dataclass

from blocktrain.errors import Refused

REASONS: dict[str, tuple[int, str]] = {
    # authentication and identity
    "missing_token": (401, "no `Authorization: Bearer` header"),
    "invalid_token": (
        401,
        "the token is not valid here: unknown to this aggregator, or revoked (the two read the "
        "same); ask its operator for a token (`blocktrain token add`)",
    ),
    "revoked_token": (
        401,
        "(the ledger's only) an accepted update dropped from its open round because its token "
        "was revoked; a revoked token itself is answered `invalid_token`",
    ),
    "banned_token": (403, "the token was banned (`blocktrain ban`); it is refused for good"),
    "block_not_allowed": (403, "the token is pinned to other blocks (`token add --block`)"),
    "viewer_token": (
        403,
        "a viewer token (`token add --viewer`) may only watch: status, history, metrics, the "
        "config, the directory and the open round",
    ),
    "unknown_worker": (404, "no such worker id, or it left; register again"),
    "not_your_worker": (403, "the worker id belongs to another token"),
    "not_assigned": (403, "the worker is not assigned to this block"),
    "unknown_block": (404, "no such block"),
    "wrong_aggregator": (
        421,
        "another aggregator of the run serves the block (the detail names it)",
    ),
    "bad_request": (422, "the request's JSON or parameters do not match the schema"),
    "not_relayed": (
        404,
        "no relayed streams here: the run's route is not relay, or the block is the last",
    ),
    "no_update": (
        409,
        "a stream comes after its round's delta: that worker has no update of the round that "
        "was accepted or refused for its timing",
    ),
    # the body
    "too_large": (413, "the body exceeds the size limit"),
    "pickle": (415, "the body is a pickle or a torch.save archive; only safetensors is read"),
    "malformed": (400, "the body is not a complete safetensors file (truncated, corrupt)"),
    "bad_metadata": (
        400,
        "a required __metadata__ key is missing or not an integer, or names another block, or "
        "`steps` exceeds the local steps the pull told",
    ),
    "bad_tokens": (400, "the token count is not a positive integer within the bound"),
    "missing_tensors": (400, "tensors of the block are missing from the delta"),
    "extra_tensors": (400, "the delta holds tensors the block does not have"),
    "bad_shape": (400, "a tensor's shape differs from the block's"),
    "bad_dtype": (400, "a tensor's dtype is not the wire dtype the aggregator announced"),
    "non_finite": (400, "the delta holds NaN or Inf"),
    "norm_too_large": (400, "the delta's global L2 norm exceeds the bound"),
    # timing
    "late": (
        409,
        "the update's round closed before it arrived (deadline, all reported, or quorum and grace)",
    ),
    "stale_version": (409, "base_version is not the version the round published"),
    "future_round": (409, "the update names a round that has not opened"),
    "duplicate": (
        409,
        "this worker already reported for this round, or its identity as many times as its "
        "token may run workers",
    ),
    "done": (410, "the block has finished its rounds"),
    "replay": (
        409,
        "the body names another worker, or another round or version than the worker's last "
        "pull, or its tensors nearly repeat its identity's accepted ones (copy_distance)",
    ),
    "copy": (
        409,
        "the body's tensors nearly repeat those another identity pushed or had accepted in "
        "the last replay_rounds rounds (copy_distance)",
    ),
    # committed versions at immutable URLs (docs/protocol.md, Pulls through a cache)
    "unknown_version": (404, "the block has not reached this version"),
    "version_gone": (410, "the version was pruned (keep_versions); pull the open round"),
    "bad_range": (416, "the byte range starts past the end of the body"),
    "unknown_base": (404, "the aggregator holds no such view to send a delta from; pull it whole"),
    # limits (never a ledger row: counted in memory, see docs/protocol.md, Limits)
    "slow_client": (408, "the request's body came slower than the minimum rate"),
    "rate_limited": (
        429,
        "the token sent more requests than its rate allows, or its address (or network) failed "
        "too many token checks; see Retry-After",
    ),
    "rolled_back": (409, "the round was dropped by `blocktrain rollback`; pull and train again"),
    # effect
    "harmful": (
        422,
        "the update raises the block's loss on the aggregator's held-out slice beyond the "
        "tolerance and the block's honest band",
    ),
    "low_reputation": (
        403,
        "the identity's reputation fell below the minimum (harmful updates; a helpful update "
        "still earns it back)",
    ),
    "drift": (
        403,
        "the identity's accepted votes kept leaning one way against the others of its block "
        "(drift_threshold); its updates there are refused for drift_min_rounds rounds",
    ),
    "busy": (
        429,
        "the effect probe is not taking this update now: the identity spent its probe budget for "
        "the round, or the probe's queue is full; see Retry-After",
    ),
    "no_gain": (
        422,
        "the update does not lower the block's loss on the held-out slice (within the "
        "tolerance and the honest band: no reputation cost)",
    ),
    # compressed deltas (docs/protocol.md, Compressed deltas)
    "wrong_wire": (400, "the body's delta_wire is not the one the aggregator announced"),
    "bad_scales": (400, "an int8 or sparse delta's scale is NaN, Inf or negative"),
    "bad_indices": (
        400,
        "a top-k or sparse delta's indices are out of range, repeated or not ascending",
    ),
    "bad_k": (400, "a top-k delta's values and indices differ in length, or k exceeds the tensor"),
}
"""Reason code -> (HTTP status, meaning)."""


@dataclass(frozen=True)
class Verdict:
    """The fate of one update (or request): accepted, or refused with a reason code of REASONS
    and a human-readable detail."""

    accepted: bool
    reason: str = ""
    detail: str = ""
    weight: float = 1.0
    """For an accepted update: its weight factor (below 1 when counted late, within the
    staleness bound)."""
    counts_in: int | None = None
    """For an accepted update: the round it is aggregated in."""

    @staticmethod
    def ok(*, weight: float = 1.0, counts_in: int | None = None) -> Verdict:
        return Verdict(True, weight=weight, counts_in=counts_in)

    @staticmethod
    def refuse(reason: str, detail: str = "") -> Verdict:
        if reason not in REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        return Verdict(False, reason=reason, detail=detail)

    @property
    def status(self) -> int:
        """The HTTP status this verdict is answered with."""
        return 200 if self.accepted else REASONS[self.reason][0]


def refused(reason: str, detail: str = "") -> Refused:
    """The exception for a refusal, with the HTTP status of its reason."""
    return Refused(reason, detail or REASONS[reason][1], REASONS[reason][0])
