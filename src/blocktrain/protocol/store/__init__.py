"""The protocol's store: the state folder and its SQLite ledger, what a restart reads back.

    ledger           the ledger: tokens, workers, rounds, every update's fate, bytes moved
    ledger_schema    the ledger's SQLite schema, its migrations and the typed rows it returns
    ledger_counts    the update counters per (block, worker, fate, reason), kept with each row
    ledger_recovery  bans, reputations, dropped updates, last reports and rollbacks
    tokens           bearer tokens: generated at random, stored only as SHA-256 hashes
    storage          the state folder: committed versions, pending updates, manifest
    state            a state folder for a run: create, read committed blocks, byte summary
    persist          the engine restored from and committed to the ledger and state folder
    traffic          byte counters and batched pull marks, flushed to the ledger
    history          a run's history for reports, from a state folder or a simulation
    recovery         roll a block back to a kept version; does a folder hold a state

Imports core/ only of protocol/ (tests/test_layers.py).
"""
