"""A worker's folder (`blocktrain worker --state DIR`; docs/protocol.md, A worker that
resumes): what a restarted worker needs to come back as the same worker, sending what an
uninterrupted one would have sent.

    DIR/worker.json          the registration (URL, run id and config digest, worker id, block,
                             data seed, delta wire), and the last round pushed, for people
    DIR/state.safetensors    the AdamW state (`optimizer/NAME.*`), the error-feedback residual
                             (`residual/NAME`) and the view of the last pull (`view/NAME`)
    DIR/tensorboard/, ...    what else the caller names (`extra`)

Both are written after each pushed round, the tensors first, each atomically; the batches need
nothing saved (they are drawn from data seed, block and step). A restart asks for its worker
back (`resume_worker_id`); a folder of another block, run id or run config is refused before
anything is written (`--fresh` starts a new worker). A folder is locked while a worker uses it."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save

from blocktrain.errors import ConfigError, ProtocolError, Refused
from blocktrain.fsutil import atomic_write_bytes
from blocktrain.protocol.core.codecs import DeltaEncoder
from blocktrain.protocol.core.delta_wire import FULL
from blocktrain.protocol.core.local_trainer import LocalTrainer, ResumableTrainer
from blocktrain.protocol.core.pulls import View
from blocktrain.protocol.worker.replies import Pulled, Registration

FORMAT = "blocktrain-worker"
FORMAT_VERSION = 1
REGISTRATION = "worker.json"
STATE = "state.safetensors"
OPTIMIZER, RESIDUAL, VIEW = "optimizer/", "residual/", "view/"
FRESH_HINT = "give another --state, or add --fresh to start a new worker there"

Tensors = dict[str, torch.Tensor]


def run_digest(run_config: dict[str, Any]) -> str:
    """A short digest of an aggregator's run config (/v1/config `run_config`)."""
    text = json.dumps(run_config, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Saved:
    """What worker.json holds."""

    aggregator: str
    """The URL given on the command line."""
    served_by: str
    """The URL of the aggregator registered at (another one when the directory sent it)."""
    run_id: str
    run: str
    """`run_digest` of the run config."""
    worker_id: int
    block: int
    data_seed: int
    delta_wire: str
    round: int = -1
    """The last round pushed (-1: none)."""
    steps_done: int = 0
    saved_at: float = 0.0


class WorkerFolder:
    """One worker's folder, checked and locked when opened, written by the loop
    (`WorkerLoop(folder=...)`): `registered` at each registration, `pushed` after each push."""

    def __init__(
        self,
        root: Path | str,
        aggregator: str,
        *,
        block: int | None = None,
        fresh: bool = False,
        extra: tuple[str, ...] = (),
    ) -> None:
        """Checks before the aggregator hears of the worker: a folder of something else, a
        corrupt one, another block than `block`. `fresh`: ignore the worker it holds. `extra`:
        the names of other files or folders it may hold (the worker's logs)."""
        self.root = Path(root)
        self.extra = extra
        self.aggregator = aggregator.rstrip("/")
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"--state {self.root} is a file, not a folder")
        self.saved: Saved | None = None
        self._tensors: Tensors = {}
        self._meta: dict[str, str] = {}
        self._foreign_check()
        if not fresh and (self.root / REGISTRATION).is_file():
            self._load()
        if self.saved is not None and block is not None and block != self.saved.block:
            raise ConfigError(
                f"{self.root} holds worker {self.saved.worker_id} of block {self.saved.block}, "
                f"not block {block}: drop --block to resume it, or {FRESH_HINT}"
            )
        self._created = not self.root.exists()
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = os.open(self.root, os.O_RDONLY)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise ConfigError(
                f"{self.root} is in use by another worker: give each worker its own --state"
            ) from None
        for path in self.root.iterdir():
            if _temporary(path.name):
                path.unlink(missing_ok=True)  # what a killed write left

    def close(self) -> None:
        """Unlock; a folder this worker made and never wrote is removed."""
        os.close(self._lock)
        if self._created and not any(self.root.iterdir()):
            self.root.rmdir()

    @property
    def round(self) -> int:
        """The last round the saved worker pushed (-1: none, or no worker saved)."""
        return int(self._meta.get("round", -1)) if self.saved is not None else -1

    # ------------------------------------------------------------------ reading

    def _foreign_check(self) -> None:
        if not self.root.is_dir():
            return
        names = sorted(p.name for p in self.root.iterdir())
        if "aggregator.json" in names or "ledger.sqlite" in names:
            raise ConfigError(
                f"{self.root} is an aggregator's state folder: give the worker its own --state"
            )
        known = (REGISTRATION, STATE, *self.extra)
        others = [n for n in names if n not in known and not _temporary(n)]
        if others:
            raise ConfigError(
                f"{self.root} holds files that are not a worker's ({', '.join(others[:3])}): "
                "give --state an empty or new folder"
            )

    def _load(self) -> None:
        path = self.root / REGISTRATION
        try:
            doc = json.loads(path.read_text())
            if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
                raise ValueError(f"not a {FORMAT} file of format_version {FORMAT_VERSION}")
            fields = {k: v for k, v in doc.items() if k in Saved.__dataclass_fields__}
            saved = Saved(**fields)
            numbers = (saved.worker_id, saved.block, saved.data_seed, saved.round)
            if not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
                raise ValueError("worker_id, block, data_seed and round must be integers")
        except (OSError, ValueError, TypeError) as exc:
            raise ConfigError(f"{path} is unreadable ({exc}): {FRESH_HINT}") from None
        if (self.root / STATE).is_file():
            try:
                with safe_open(str(self.root / STATE), framework="pt") as f:
                    meta = dict(f.metadata() or {})
                tensors = load_file(str(self.root / STATE))
            except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
                raise ConfigError(
                    f"{self.root / STATE} is unreadable ({exc}): {FRESH_HINT}"
                ) from None
            if meta.get("format") == FORMAT and meta.get("block") == str(saved.block):
                self._tensors, self._meta = tensors, meta
        self.saved = saved

    def check_run(self, url: str, config: dict[str, Any]) -> None:
        """Refuse to resume into another run than the one that wrote the folder (a ConfigError,
        before the registration; nothing written)."""
        assert self.saved is not None
        theirs = config.get("run_id")
        if not theirs:
            raise ConfigError(
                f"the aggregator at {url} gives no run id (a blocktrain older than this worker's):"
                f" it cannot take worker {self.saved.worker_id} of {self.root} back; {FRESH_HINT}"
            )
        if theirs != self.saved.run_id or run_digest(config["run_config"]) != self.saved.run:
            raise ConfigError(
                f"{self.root} belongs to another run (run {self.saved.run_id} at "
                f"{self.saved.served_by}; {url} serves run {theirs}): {FRESH_HINT}"
            )

    def refused(self, exc: Refused) -> ProtocolError:
        """What a refusal of the resumed registration means, in one line."""
        assert self.saved is not None
        why = {
            "not_your_worker": "it was written with another token: use that token, or",
            "unknown_worker": "that aggregator does not know it:",
        }.get(exc.reason, "")
        return ProtocolError(
            f"cannot resume worker {self.saved.worker_id} of {self.root}: {exc}"
            + (f" ({why} {FRESH_HINT})" if why else "")
        )

    def restore(
        self, trainer: LocalTrainer, encoder: DeltaEncoder, reg: Registration
    ) -> tuple[str, View | None]:
        """Load the saved optimizer state and residual into a resumed worker's trainer and
        encoder; what was restored, as a line, and the view to pull the next version from (the
        client's `view`; None: a whole pull)."""
        assert self.saved is not None
        kept = [f"after round {self.round}" if self.round >= 0 else "no round pushed yet"]
        moments = self._part(OPTIMIZER)
        if moments and isinstance(trainer, ResumableTrainer):
            steps = int(self._meta.get("steps_done", 0))
            trainer.load_optimizer_state(moments, steps)
            kept.append(f"AdamW state of {steps} local steps")
        residual = self._part(RESIDUAL)
        if residual and self._meta.get("delta_wire") == reg.delta_wire:
            encoder.residual = {k: v.float() for k, v in residual.items()}
            kept.append("the error-feedback residual")
        view = self._part(VIEW)
        held = None
        if view and reg.pull_wire != FULL and "view_version" in self._meta:
            held = View(reg.block, int(self._meta["view_version"]), view)
        return f"resumed worker {reg.worker_id} from {self.root}: {', '.join(kept)}", held

    def _part(self, prefix: str) -> Tensors:
        return {k[len(prefix) :]: v for k, v in self._tensors.items() if k.startswith(prefix)}

    # ------------------------------------------------------------------ writing

    def registered(
        self, reg: Registration, url: str, config: dict[str, Any], *, new_trainer: bool
    ) -> None:
        """Record a registration; `new_trainer`: its trainer starts afresh (a new worker, or
        another block), so a saved optimizer state no longer applies."""
        if new_trainer:
            (self.root / STATE).unlink(missing_ok=True)
            self._meta = {}
        self.saved = Saved(
            aggregator=self.aggregator,
            served_by=url.rstrip("/"),
            run_id=str(config.get("run_id") or ""),
            run=run_digest(config["run_config"]),
            worker_id=reg.worker_id,
            block=reg.block,
            data_seed=reg.data_seed,
            delta_wire=reg.delta_wire,
            round=self.round if not new_trainer else -1,
            steps_done=int(self._meta.get("steps_done", 0)),
        )
        self._write_registration()

    def pushed(
        self,
        reg: Registration,
        pulled: Pulled,
        trainer: LocalTrainer,
        encoder: DeltaEncoder,
        view: View | None,
    ) -> None:
        """After a push's answer: the optimizer state, residual and view, then worker.json."""
        assert self.saved is not None
        tensors: Tensors = {}
        steps = 0
        if isinstance(trainer, ResumableTrainer):
            steps = trainer.steps_done
            tensors.update({OPTIMIZER + k: v for k, v in trainer.optimizer_state().items()})
        if encoder.residual is not None:
            tensors.update({RESIDUAL + k: v for k, v in encoder.residual.items()})
        if view is not None and view.block == reg.block:
            tensors.update({VIEW + k: v for k, v in view.tensors.items()})
        self._meta = {
            "format": FORMAT,
            "block": str(reg.block),
            "worker_id": str(reg.worker_id),
            "round": str(pulled.round),
            "version": str(pulled.version),
            "steps_done": str(steps),
            "delta_wire": reg.delta_wire,
        }
        if view is not None and view.block == reg.block:
            self._meta["view_version"] = str(view.version)
        data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, self._meta)
        atomic_write_bytes(self.root / STATE, data)
        self.saved = Saved(**{**asdict(self.saved), "round": pulled.round, "steps_done": steps})
        self._write_registration()

    def _write_registration(self) -> None:
        assert self.saved is not None
        doc = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            **asdict(self.saved),
            "saved_at": time.time(),
        }
        atomic_write_bytes(self.root / REGISTRATION, (json.dumps(doc, indent=2) + "\n").encode())


def _temporary(name: str) -> bool:
    """A temporary file of `atomic_write_bytes` for one of the folder's files."""
    return name.endswith(".tmp") and name.startswith((f".{REGISTRATION}.", f".{STATE}."))
