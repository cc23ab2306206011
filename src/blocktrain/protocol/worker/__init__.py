"""The protocol's worker side: the HTTP client of the aggregator and the loop that trains.

    retrying  HTTP with timeouts, retried with backoff and jitter, and after Retry-After
    replies   what the aggregator answers, as the client reads it: registration, pull, push
    client    the worker's client of the aggregator: register, pulls (whole or deltas), pushes
    outcome   what a worker says: a line per round with its hint when late, the report
    loop      the worker loop: register, pull, train H steps, push, round after round
    resume    the worker's folder: its registration, optimizer state and residual, to rejoin
    doctor    why a worker cannot reach its aggregator: one check per layer

Imports core/ only of protocol/ (tests/test_layers.py).
"""
