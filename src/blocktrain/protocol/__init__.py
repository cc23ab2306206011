"""Decentralised training over HTTP (docs/protocol.md): one aggregator, many workers, each
training one block replica. The package is in rooms, each a subpackage whose `__init__.py`
lists its modules; a room imports only the rooms below it (tests/test_layers.py,
docs/architecture.md):

    core/     the round logic, in memory, time passed in: torch and the standard library only
    store/    the state folder and its SQLite ledger
    service/  the engine on the wall clock, persisted (no FastAPI)
    http/     the FastAPI app over the service
    worker/   the worker's HTTP client and loop
    ops/      a whole run on one machine, and its report

This package moves tensors as payload and never imports `blocktrain.model`; nothing is imported
here so that `protocol.core` stays light for the simulator.
"""
