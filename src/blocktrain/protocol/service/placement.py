"""One aggregator process per block (or per subset of blocks), and the directory that tells
workers where each block lives (docs/protocol.md, One aggregator per block).

    blocktrain aggregator --state runs/agg0 --preset tiny --blocks 0 --peer 1=http://hostB:8471

serves block 0 only; a request for another block is refused 421 `wrong_aggregator`, naming its
URL. Blocks never wait for each other, so nothing passes between aggregators: each has its own
state folder (from the same preset and seed) and ledger. `GET /v1/directory` maps every block
known to a URL; a worker reads it before it registers and after a `wrong_aggregator`. The state
folder saves the blocks served and the peers at the first start (`placed`); only the served
blocks are loaded."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from blocktrain.errors import ConfigError
from blocktrain.protocol.core.verdict import refused
from blocktrain.protocol.store.storage import StateDir

PEER_HELP = "BLOCK=URL, e.g. 1=http://10.0.0.6:8470"


@dataclass(frozen=True)
class Directory:
    """Which blocks this aggregator serves, and where the others live."""

    n_blocks: int
    served: tuple[int, ...]
    peers: dict[int, str] = field(default_factory=dict)

    @staticmethod
    def build(
        n_blocks: int, served: Collection[int] | None = None, peers: dict[int, str] | None = None
    ) -> Directory:
        """Served blocks (None: all) and peers, checked: within 0..n_blocks-1, a block served
        here has no peer, and the URLs are http(s) (ConfigError otherwise)."""
        blocks = tuple(sorted(set(range(n_blocks) if served is None else served)))
        peers = dict(peers or {})
        for b in (*blocks, *peers):
            if not 0 <= b < n_blocks:
                raise ConfigError(f"block {b} is not a block of this run (0..{n_blocks - 1})")
        if not blocks:
            raise ConfigError("--blocks names no block")
        for b, url in peers.items():
            if b in blocks:
                raise ConfigError(f"--peer {b}={url}: block {b} is served here (--blocks)")
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"--peer {b}={url}: expected {PEER_HELP}")
        return Directory(n_blocks, blocks, peers)

    def check(self, block: int) -> None:
        """Refuse a block served elsewhere (421 wrong_aggregator, naming its URL) or by no
        aggregator known here; a block outside the run is the caller's `unknown_block`."""
        if block in self.served or not 0 <= block < self.n_blocks:
            return
        where = self.peers.get(block)
        raise refused(
            "wrong_aggregator",
            f"block {block} is served by {where}"
            if where
            else f"block {block} is not served here (blocks {list(self.served)}), and this "
            "aggregator knows no peer for it",
        )

    def allowed(self, pinned: Iterable[int] | None) -> list[int]:
        """The blocks a registration may go to here: the served ones (among a token's pinned
        blocks, when it has them)."""
        out = list(self.served) if pinned is None else [b for b in pinned if b in self.served]
        if not out:
            names = ", ".join(f"{b}: {u}" for b, u in sorted(self.peers.items()))
            raise refused(
                "wrong_aggregator",
                f"this token's blocks are not served here (blocks {list(self.served)}); "
                f"{names or 'no peer is known'}",
            )
        return out

    def to_dict(self, here: str) -> dict[str, Any]:
        urls = {str(b): here for b in self.served}
        urls.update({str(b): u for b, u in self.peers.items()})
        return {
            "blocks": dict(sorted(urls.items(), key=lambda kv: int(kv[0]))),
            "served": list(self.served),
        }


def placed(
    storage: StateDir, served: Collection[int] | None = None, peers: dict[int, str] | None = None
) -> Directory:
    """The directory of an aggregator over `storage`, given its start's `--blocks` (`served`;
    None: not given) and `--peer`s. The first start saves the blocks it serves; a later start with
    others is a ConfigError (the folder holds those blocks' rounds only); a peer given replaces its
    block's saved URL."""
    saved_served, saved_peers = storage.placement()
    if served is not None and saved_served is not None and sorted(set(served)) != saved_served:
        raise ConfigError(
            f"--blocks {_blocks(served)} disagrees with {storage.root}, which serves block(s) "
            f"{_blocks(saved_served)} (saved at its first start); omit --blocks to serve "
            "those, or give another --state"
        )
    chosen = served if served is not None else saved_served
    directory = Directory.build(storage.n_blocks(), chosen, {**saved_peers, **(peers or {})})
    if (saved_served, saved_peers) != (list(directory.served), directory.peers):
        storage.save_placement(directory.served, directory.peers)
    return directory


def _blocks(blocks: Collection[int]) -> str:
    return ",".join(map(str, sorted(set(blocks))))


def parse_peer(text: str) -> tuple[int, str]:
    """`--peer BLOCK=URL` -> (block, url); ConfigError naming the syntax otherwise."""
    block, sep, url = text.partition("=")
    try:
        b = int(block)
    except ValueError:
        b = -1
    if not sep or b < 0 or not url.strip():
        raise ConfigError(f"--peer {text!r}: expected {PEER_HELP}")
    return b, url.strip().rstrip("/")
