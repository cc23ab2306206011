"""Decentralised training over HTTP (docs/protocol.md): one aggregator, many workers, each
training one block replica.

    verdict      refusal reasons and the Verdict type (pure)
    rounds       the round/deadline state machine, registry and participation (pure)
    wire         safetensors bodies with metadata, fp16/bf16 casting, size limit, no pickle
    codecs       how deltas travel: dense, int8 with a scale per row, top-k with error feedback
    pulls        compressed pulls: a version as a delta from the view a worker holds
    validation   validators chained into one, each returning a Verdict with a reason
    aggregation  token-weighted mean, median, trimmed mean, outer Nesterov momentum
    core         the round engine: every decision, time passed in (service and simulator)
    settings     the aggregator's settings, each declared once with doc, bounds and flag
    tokens       bearer tokens, stored hashed
    ledger       SQLite: tokens, workers, rounds, every update's fate, bytes moved
    storage      the state folder: committed versions, pending updates, manifest
    state        a state folder for a run: create, read committed blocks, byte summary
    persist      the engine restored from and committed to the ledger and state folder
    traffic      byte counters and batched pull marks
    service      the engine on the wall clock, persisted (no HTTP)
    auth         bearer token and worker identity
    schemas      the HTTP request and response models
    status       what /v1/status shows; metrics: the Prometheus exposition
    aggregator   the FastAPI app: create_app(settings, *, storage, clock)
    client       the worker's httpx client; worker: the worker loop
    cluster      start an aggregator and N workers on this machine

This package moves tensors as payload and never imports `blocktrain.model`; nothing is imported
here so that `protocol.rounds` stays light for the simulator.
"""
