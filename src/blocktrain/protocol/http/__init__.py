"""The protocol's HTTP face: FastAPI over the service.

    app           the FastAPI app: create_app(settings, *, storage, clock)
    dependencies  what the routes share: accounting tags, authentication and rate limits
    messages      the request and response models (pydantic)
    weights       committed versions at immutable URLs: ETag, Range, deltas
    peers         GET /v1/directory: where each block's aggregator lives
    longpoll      long polls of a block's round that sleep until it changes
    relay         route = relay: the streams one block pushes and the next takes
    status        what /v1/status shows
    metrics       the Prometheus exposition of a status snapshot
    dashboard     the live dashboard page and /v1/history

Imports core/, store/ and service/ of protocol/ (tests/test_layers.py).
"""
