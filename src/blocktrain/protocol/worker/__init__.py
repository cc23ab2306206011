"""The protocol's worker side: the HTTP client of the aggregator and the loop that trains.

    client  the worker's httpx client: retries, pulls (whole, cached or deltas), pushes
    loop    the worker loop: register, pull, train H steps, push, round after round
    doctor  why a worker cannot reach its aggregator: one check per layer

Imports core/ only of protocol/ (tests/test_layers.py).
"""
