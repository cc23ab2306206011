"""Recovery from a bad participant: roll a block back to a kept version, and tell whether an
aggregator holds a state folder.

A rollback publishes the kept version V as a NEW version number (current + 1): versions only
ever go up, so a worker, a router or a check that saw version N never sees N again with other
weights. The open round is closed as a round with cause "rollback" (its accepted updates were
trained on the weights being undone: they are dropped, with reason `rolled_back`), and the
ledger's `rollbacks` table records what happened.

It runs while the aggregator is stopped: the aggregator holds each block's weights in memory,
so it refuses while the state's endpoint names a live process.
"""

from __future__ import annotations

import os
from typing import Any

from blocktrain.errors import ConfigError, ProtocolError
from blocktrain.protocol.store.storage import TENSOR_KINDS, StateDir


def holder(storage: StateDir) -> dict[str, Any] | None:
    """The endpoint (url, pid) of the aggregator running on this state, if its process lives.
    An endpoint left by a killed aggregator names a dead process and does not count."""
    endpoint = storage.read_endpoint()
    pid = None if endpoint is None else endpoint.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, under another user
        pass
    return endpoint


def rollback(storage: StateDir, *, block: int, to_version: int, now: float) -> dict[str, Any]:
    """Make kept version `to_version` of `block` its weights as the next version number."""
    n_blocks = storage.n_blocks()  # a ProtocolError for a folder that holds no state
    if not 0 <= block < n_blocks:
        raise ConfigError(f"--block {block} is outside 0..{n_blocks - 1}")
    running = holder(storage)
    if running is not None:
        raise ProtocolError(
            f"the aggregator (pid {running['pid']}, {running.get('url', '?')}) holds "
            f"{storage.root}: stop it, roll back, then start it again"
        )
    version, _, _ = storage.ledger.block_state(block)
    if not 0 <= to_version < version:
        raise ConfigError(
            f"--to-version {to_version} is not an earlier version of block {block} "
            f"(its current version is {version})"
        )
    if not storage.has_tensors(block, to_version):
        kept = ", ".join(map(str, storage.versions(block)))
        raise ConfigError(
            f"version {to_version} of block {block} is not kept on disk (kept: {kept}); "
            "raise --set keep_versions to keep more"
        )
    new_version = version + 1
    storage.save_tensors(block, new_version, storage.load_tensors(block, to_version))
    for kind in TENSOR_KINDS[1:]:  # the outer momentum and exact pulls' remainder with it
        if storage.has_tensors(block, to_version, kind):
            state = storage.load_tensors(block, to_version, kind)
            storage.save_tensors(block, new_version, state, kind=kind)
    # a crash before this line leaves an unreferenced file that the next commit overwrites
    round_, recorded, dropped = storage.ledger.rollback(block=block, to_version=to_version, now=now)
    assert recorded == new_version
    for name in dropped:
        storage.remove_pending(name)
    return {
        "block": block,
        "round": round_,
        "from_version": version,
        "to_version": to_version,
        "new_version": new_version,
        "dropped_updates": len(dropped),
    }
