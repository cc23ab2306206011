"""The aggregator's state folder.

    STATE/aggregator.json                  run config, settings, block count, blocks served
                                           and their peers, and the run id
    STATE/ledger.sqlite                    tokens, workers, rounds, updates, traffic
    STATE/blocks/{b}/v{version}.safetensors   committed fp32 weights of each version
    STATE/blocks/{b}/m{version}.safetensors   outer momentum, when enabled
    STATE/blocks/{b}/r{version}.safetensors   exact pulls: what the pull codec left out so far
    STATE/pending/{b}/{uuid}.safetensors   bodies of accepted updates of the open round
    STATE/endpoint.json                    where the running aggregator listens (url, pid)
    STATE/evals.jsonl                      the live evaluations, one JSON record a line

Every file is written atomically (temporary, fsync, rename), tensors as safetensors only; the
temporaries a killed process left are removed at start (`remove_temporaries`)."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save

from blocktrain.errors import ProtocolError
from blocktrain.fsutil import atomic_write_bytes, json_lines
from blocktrain.protocol.core.settings import AggregatorSettings
from blocktrain.protocol.store.ledger import Ledger

log = logging.getLogger(__name__)

FORMAT = "blocktrain-aggregator"
FORMAT_VERSION = 1
MANIFEST = "aggregator.json"
LEDGER = "ledger.sqlite"
ENDPOINT = "endpoint.json"
EVALS = "evals.jsonl"

Tensors = dict[str, torch.Tensor]
TENSOR_KINDS = ("v", "m", "r")
"""A version's files: its weights, outer momentum, exact pulls' remainder."""
_VERSION_FILE = re.compile(r"^([vmr])(\d+)\.safetensors$")


class StateDir:
    """Typed access to one state folder. `create` makes a new one; the constructor opens an
    existing one (or one that only holds a ledger, as `blocktrain token add` leaves it)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._ledger: Ledger | None = None

    # ------------------------------------------------------------------ manifest

    @property
    def initialised(self) -> bool:
        return (self.root / MANIFEST).is_file()

    @classmethod
    def create(
        cls,
        root: Path,
        *,
        run_config: dict[str, Any],
        settings: AggregatorSettings,
        blocks: dict[int, Tensors],
    ) -> StateDir:
        """A new state: version 0 of every block, round 0 open. Refuses an initialised folder."""
        state = cls(root)
        if state.initialised:
            raise ProtocolError(
                f"{root} already holds an aggregator state; omit --preset to "
                "resume it, or choose another --state"
            )
        if sorted(blocks) != list(range(len(blocks))) or not blocks:
            raise ProtocolError("initial weights must be given for blocks 0..B-1")
        for b, tensors in blocks.items():
            state.save_tensors(b, 0, tensors)
        state.ledger.init_blocks(len(blocks))
        state.write_manifest(run_config=run_config, settings=settings, n_blocks=len(blocks))
        return state

    def write_manifest(
        self, *, run_config: dict[str, Any], settings: AggregatorSettings, n_blocks: int
    ) -> None:
        """Write the run, settings and block count (the saved placement stays as it was)."""
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "blocks": n_blocks,
            "run_config": run_config,
            "settings": settings.to_dict(),
        }
        kept = ("served", "peers", "run_id")
        if self.initialised:
            doc.update({k: v for k, v in self.manifest().items() if k in kept})
        doc.setdefault("run_id", uuid.uuid4().hex)
        self._write_manifest(doc)

    def _write_manifest(self, doc: dict[str, Any]) -> None:
        atomic_write_bytes(self.root / MANIFEST, (json.dumps(doc, indent=2) + "\n").encode())

    def manifest(self) -> dict[str, Any]:
        path = self.root / MANIFEST
        if not path.is_file():
            raise ProtocolError(
                f"{self.root} holds no aggregator state (no {MANIFEST}); start "
                "`blocktrain aggregator --state DIR --preset NAME` to create it"
            )
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ProtocolError(f"{path} is corrupt ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ProtocolError(f"{path} is not a BlockTrain aggregator state")
        if doc.get("format_version") != FORMAT_VERSION:
            raise ProtocolError(
                f"{path} has format_version {doc.get('format_version')}; this "
                f"blocktrain reads {FORMAT_VERSION}"
            )
        return doc

    def settings(self) -> AggregatorSettings:
        return AggregatorSettings.from_dict(self.manifest()["settings"])

    def run_config(self) -> dict[str, Any]:
        return dict(self.manifest()["run_config"])

    def n_blocks(self) -> int:
        return int(self.manifest()["blocks"])

    def run_id(self) -> str:
        """The folder's run id: random, made with it, so that a worker's folder can tell this
        run from another with the same config (`protocol.worker.resume`). A folder older than
        the id gets one the first time it is asked (the aggregator asks as it starts)."""
        doc = self.manifest()
        if not doc.get("run_id"):
            doc["run_id"] = uuid.uuid4().hex
            self._write_manifest(doc)
        return str(doc["run_id"])

    def placement(self) -> tuple[list[int] | None, dict[int, str]]:
        """The blocks served over this folder (None: never saved, a folder older than the
        record) and where the others live, as `service.placement.placed` saved them."""
        doc = self.manifest()
        served = doc.get("served")
        peers = doc.get("peers") or {}
        return (
            None if served is None else [int(b) for b in served],
            {int(b): str(url) for b, url in peers.items()},
        )

    def save_placement(self, served: Iterable[int], peers: dict[int, str]) -> None:
        doc = self.manifest()
        doc["served"] = sorted(served)
        doc["peers"] = {str(b): url for b, url in sorted(peers.items())}
        self._write_manifest(doc)

    # ------------------------------------------------------------------ ledger

    @property
    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = Ledger(self.root / LEDGER)
        return self._ledger

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    # ------------------------------------------------------------------ weights

    def tensors_path(self, block: int, version: int, kind: str = "v") -> Path:
        return self.root / "blocks" / str(block) / f"{kind}{version:06d}.safetensors"

    def save_tensors(self, block: int, version: int, tensors: Tensors, kind: str = "v") -> None:
        body = save(
            {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in tensors.items()},
            metadata={"block": str(block), "version": str(version), "kind": kind},
        )
        atomic_write_bytes(self.tensors_path(block, version, kind), body)

    def load_tensors(self, block: int, version: int, kind: str = "v") -> Tensors:
        path = self.tensors_path(block, version, kind)
        if not path.is_file():
            raise ProtocolError(f"{path} is missing: the state folder is incomplete")
        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors raises several types on a corrupt file
            raise ProtocolError(f"{path} is not a readable safetensors file ({exc})") from exc

    def has_tensors(self, block: int, version: int, kind: str = "v") -> bool:
        return self.tensors_path(block, version, kind).is_file()

    def versions(self, block: int, kind: str = "v") -> list[int]:
        folder = self.root / "blocks" / str(block)
        if not folder.is_dir():
            return []
        out = []
        for p in folder.iterdir():
            m = _VERSION_FILE.match(p.name)
            if m and m.group(1) == kind:
                out.append(int(m.group(2)))
        return sorted(out)

    def prune(self, block: int, current: int, keep: int) -> None:
        """Delete versions older than the `keep` latest (keep = 0: keep everything). Version 0
        stays: it is the run's initialisation."""
        if keep <= 0:
            return
        for kind in TENSOR_KINDS:
            for version in self.versions(block, kind):
                if 0 < version <= current - keep:
                    self.tensors_path(block, version, kind).unlink(missing_ok=True)

    # ------------------------------------------------------------------ pending updates

    def write_pending(self, block: int, body: bytes | bytearray) -> str:
        """Store an update's body durably; returns its name (relative to the state folder)."""
        name = f"pending/{block}/{uuid.uuid4().hex}.safetensors"
        atomic_write_bytes(self.root / name, body)
        return name

    def read_pending(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def remove_pending(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)

    def pending_names(self) -> list[str]:
        folder = self.root / "pending"
        if not folder.is_dir():
            return []
        return sorted(str(p.relative_to(self.root)) for p in folder.glob("*/*.safetensors"))

    def remove_temporaries(self) -> list[Path]:
        """Delete the temporary files of writes a kill interrupted (`fsutil.atomic_write_bytes`
        names them `.NAME.XXXX.tmp`); call it only while no write can be under way."""
        removed = [p for p in self.root.rglob(".*.tmp") if p.is_file()]
        for path in removed:
            path.unlink(missing_ok=True)
        if removed:
            log.info("removed %d temporary file(s) left by an interrupted write", len(removed))
        return removed

    # ------------------------------------------------------------------ live evaluations

    def evals(self) -> list[dict[str, Any]]:
        """The live evaluations recorded so far (STATE/evals.jsonl), oldest first; none when
        the file is absent. A line that is not a JSON object is a ProtocolError."""
        path = self.root / EVALS
        if not path.exists():
            return []
        out = []
        for n, record in json_lines(path, ProtocolError):
            if not isinstance(record, dict) or not isinstance(record.get("rounds"), int):
                raise ProtocolError(f"{path} line {n} is not an evaluation record")
            out.append(record)
        return out

    def write_evals(self, records: Iterable[dict[str, Any]]) -> None:
        """Replace STATE/evals.jsonl with `records`, atomically like every file here (the
        records are a few hundred bytes each, one per live_eval_every rounds)."""
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
        atomic_write_bytes(self.root / EVALS, text.encode())

    # ------------------------------------------------------------------ endpoint

    def write_endpoint(self, url: str, pid: int) -> None:
        atomic_write_bytes(self.root / ENDPOINT, json.dumps({"url": url, "pid": pid}).encode())

    def read_endpoint(self) -> dict[str, Any] | None:
        path = self.root / ENDPOINT
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            return None

    def clear_endpoint(self) -> None:
        (self.root / ENDPOINT).unlink(missing_ok=True)
