"""The aggregator's HTTP schemas: strict pydantic models, separate in and out types. Out types
forbid extra keys, so a field the service adds without a schema fails the tests, not a client.
The OpenAPI descriptions the routes add (their refusals, the register and push bodies) are here
too (`REFUSALS`, `REGISTER_BODY`, `SAFETENSORS_BODY`)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from blocktrain.protocol.core.bodies import CONTENT_TYPE


class Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RegisterIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    block: int | None = Field(
        None,
        ge=0,
        description="ask for this block (default: the one with the fewest live replicas)",
    )
    name: str | None = Field(None, max_length=100, description="a label for logs and status")
    resume_worker_id: int | None = Field(
        None,
        ge=0,
        lt=2**63,
        description="take back this worker of the token (a restarted worker resuming its "
        "folder): its id, block and data seed, whether it left or timed out; another token's "
        "worker is refused (not_your_worker), an id never given too (unknown_worker)",
    )


class RegisterOut(Out):
    worker_id: int
    block: int
    data_seed: int = Field(description="seed * n_workers + worker_id: seeds the batches")
    local_steps: int = Field(description="H, local steps per round")
    round: int
    version: int
    wire_dtype: str
    delta_wire: str = Field(
        description="how pushes carry deltas: fp16|bf16|fp32|int8|topk:RATIO|sparse:DENSITY:BITS"
    )
    pull_wire: str = Field(
        description="how pulls travel: full, or int8|topk:RATIO|sparse:DENSITY:BITS deltas "
        "from the view held"
    )
    exact_pulls: bool = Field(
        False,
        description="each version is committed as the pull codec carries it: the delta of "
        "version v is from a view of version v - 1 only, and views are fp32",
    )
    done: bool
    resumed: bool = Field(False, description="the worker was taken back (resume_worker_id)")
    run_id: str | None = Field(None, description="the run's id, as /v1/config gives it")


class RoundOut(Out):
    block: int
    round: int
    version: int
    deadline: float | None = Field(
        description="seconds since the epoch on the aggregator's "
        "clock; null before the round's first pull"
    )
    deadline_in: float | None = Field(description="seconds left until the deadline")
    done: bool


class UpdateOut(Out):
    accepted: bool
    update_id: int
    round: int = Field(description="the round the worker trained on")
    counts_in: int = Field(description="the round it is aggregated in")
    weight: float = Field(description="staleness factor (1 for an update on time)")
    norm: float = Field(description="the delta's global L2 norm")


class StreamOut(Out):
    accepted: bool
    block: int
    round: int = Field(description="the round whose local steps the stream holds")
    steps: int = Field(description="its local steps (S)")


class RefusalOut(Out):
    accepted: bool = False
    reason: str
    detail: str


class LeaveOut(Out):
    worker_id: int
    left: bool


class ConfigOut(Out):
    run_config: dict[str, Any] = Field(description="the model's RunConfig")
    run_id: str | None = Field(
        None,
        description="random, made with the aggregator's state folder: a worker's folder "
        "resumes only with the run that wrote it",
    )
    protocol: dict[str, Any] = Field(description="the aggregator's settings")
    blocks: int
    tensors: dict[str, dict[str, list[int]]] = Field(description="block -> name -> shape")
    directory: dict[str, Any] = Field(
        default_factory=dict,
        description="blocks: block -> the URL of its aggregator; served: the blocks served here",
    )


class BlockStatusOut(Out):
    block: int
    round: int
    version: int
    deadline: float | None
    deadline_in: float | None
    done: bool
    expected: list[int]
    reported: list[int]
    pending_accepted: int
    assigned: list[int]
    live_replicas: int
    params: int
    wire_bytes: int
    delta_bytes: int = Field(description="bytes of one push's tensor data in the delta wire")
    pull_bytes: int = Field(
        description="bytes of one pull's tensor data after the first: the block, or a delta"
    )
    probe_band: float | None = Field(
        None,
        description="the upper edge of the effect probe's honest band (relative loss change; "
        "null with the probe off or fewer than 4 accepted updates since the start)",
    )
    influence_reference: float | None = Field(
        None,
        description="the influence bound's reference, sqrt(sum over tensors of the median of "
        "the last 8 changes' norms); null before 8 rounds committed a change since the start",
    )


class WorkerStatusOut(Out):
    worker_id: int
    name: str | None = Field(None, description="the label it registered with (worker --name)")
    block: int
    live: bool = Field(description="heard from within the live window, and not gone")
    state: str = Field(
        "live",
        description="live; timed_out (registered, not heard from within the live window); left "
        "(it left, DELETE /v1/workers/{id}, or was retired or shut out with its token)",
    )
    last_seen_s: float
    left_s: float | None = Field(None, description="seconds since it left; null if it has not")
    accepted: int
    refused: int
    reputation: float = Field(1.0, description="its identity's reputation (1 for a newcomer)")
    drift: float | None = Field(
        None,
        description="its identity's drift score on its block (about 1 for independent noise; "
        "flagged past drift_threshold); null when not observed since its last flag",
    )


class WorkersOut(Out):
    registered: int = Field(description="workers registered now (live or timed out)")
    live: int
    left: int = Field(0, description="workers that left; `list` shows the last 100 of them")
    per_block: list[int] = Field(description="live identities of each block in `blocks`")
    list: list[WorkerStatusOut]


class RoundRecordOut(Out):
    round: int
    accepted: int = Field(description="accepted updates aggregated, late ones included")
    in_time: int = Field(description="accepted updates of the round itself")
    refused: int
    expected: int
    reported: int
    cause: str
    held: str | None = Field(
        description="why the aggregation rule committed no change (too few votes), or null"
    )
    version: int
    participation: float = Field(description="in_time / expected (docs/protocol.md)")
    duration_s: float | None


class UpdatesOut(Out):
    accepted: int
    refused: int
    refused_by_reason: dict[str, int]


class StatusOut(Out):
    time: float
    uptime_s: float
    blocks: list[BlockStatusOut]
    versions: list[int]
    rounds: list[int]
    done: bool = Field(
        description="every block served here has finished its max_rounds rounds (never "
        "without max_rounds)"
    )
    served: list[int] = Field(description="the blocks served here: those `blocks` lists")
    peers: dict[str, str] = Field(description="block -> the URL of the aggregator serving it")
    workers: WorkersOut
    participation: dict[str, list[RoundRecordOut]] = Field(description="block -> last rounds")
    updates: UpdatesOut
    bytes: dict[str, Any] = Field(description="totals, and by endpoint, block and worker")
    settings: dict[str, Any]
    codecs: str = Field(
        "", description="every codec a worker's bytes go through: pushes, pulls, streams"
    )
    refused_requests: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="endpoint -> reason -> requests refused since the aggregator started "
        "(in memory: refusals before authentication never reach the ledger)",
    )


REFUSALS: dict[int | str, dict[str, Any]] = {
    code: {"model": RefusalOut}
    for code in (400, 401, 403, 404, 408, 409, 410, 413, 415, 416, 421, 422, 429)
}
REGISTER_BODY: dict[str, Any] = {
    "requestBody": {
        "required": False,
        "content": {"application/json": {"schema": RegisterIn.model_json_schema()}},
    }
}

BINARY: dict[str, Any] = {CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}}
SAFETENSORS_BODY: dict[str, Any] = {"requestBody": {"required": True, "content": BINARY}}


def binary_reply(description: str) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI 200 of a route that answers with a safetensors body."""
    return {200: {"content": BINARY, "description": description}}
