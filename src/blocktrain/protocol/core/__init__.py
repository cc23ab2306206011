"""The protocol's core: every decision of a round, in memory, with time passed in. Torch and the
standard library only (no SQLite, no HTTP, no clock), so that the service and the simulator
drive the same code.

    verdict         refusal reasons, the Verdict type, and `refused` (the exception of a reason)
    registry        which worker trains which block, for which token; when each was last heard
    rounds          the round and deadline state machine of one block, and its restore
    participation   a closed round's own accepted updates, and its participation
    bodies          safetensors bodies with metadata: fp16/bf16 casting, size limit, no pickle
    delta_wire      the codec names of delta_wire and pull_wire: parsed, checked, tagged
    codecs          how deltas travel: dense, int8 with a scale per row, top-k, sparse
    sparse_codec    the sparse codec: chunked top-k, low-bit values, packed indices
    pulls           compressed pulls: a version as a delta from the view a worker holds
    validation      validators chained into one, each returning a Verdict with a reason
    aggregation     token-weighted mean, median, trimmed mean, centered clip, outer Nesterov
    influence       the influence bound: no vote's term past a fraction of recent changes
    drift           patient attackers: each identity's residuals, sketched, and its flag
    effect          the effect probe's verdict on an update, and reputation per identity
    declaration     how one setting is declared: its doc, check, flag, and the field
    round_settings  the settings of how a round runs: deadline, H and pacing, staleness, rounds
    vote_settings   the settings of how votes are combined: rule, clip, defences, outer optimizer
    settings        AggregatorSettings: the two groups above, the wire, limits, closing, live eval
    bounds          settings derived from the run: the delta norm and token bounds
    events          what the engine holds and returns: blocks, checks, probe places, commits
    replays         the replay screen: an update bound to its worker, round and version, and
                    no near-copy of a recent body (sketches)
    probe_slots     places at the effect probe: each identity's budget, the bounded queue
    pacing          the local steps each pull tells its worker, from its measured pace
    round_engine    the round engine: register, pull, inspect, judge, record, commit
    local_trainer   what a worker trains (UNITS) and the interface of its trainer
    relays          relayed streams (route = relay): which a worker of the next block takes

Imports nothing of protocol/ outside core/ (tests/test_layers.py).
"""
