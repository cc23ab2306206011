"""Decentralised training over HTTP (DESIGN.md section 4): one aggregator, many workers, each
training one block replica.

    verdict      refusal reasons and the Verdict type (pure)
    rounds       the round/deadline state machine and worker registry (pure, time passed in)
    wire         safetensors bodies with metadata, fp16/bf16 casting, size limit, no pickle
    validation   validators chained into one, each returning a Verdict with a reason
    aggregation  token-weighted mean, median, trimmed mean, outer Nesterov momentum
    tokens       bearer tokens, stored hashed
    ledger       SQLite: tokens, workers, rounds, every update's fate, bytes moved
    storage      the state folder: committed versions, pending updates, manifest
    settings     the aggregator's settings
    service      the aggregator's service functions (no HTTP)
    aggregator   the FastAPI app: create_app(settings, *, storage, clock)
    worker       the httpx client and the worker loop
    cluster      start an aggregator and N workers on this machine

This package moves tensors as payload and never imports `blocktrain.model`; nothing is imported
here so that `protocol.rounds` stays light for the simulator.
"""
