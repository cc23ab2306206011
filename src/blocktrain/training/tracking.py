"""Experiment logging (`--log-to`; README.md, "Experiment logging"): every metrics record also goes
to TensorBoard, Weights & Biases or MLflow, offline unless told otherwise, so that nothing needs
a server. `check_backends` imports the libraries before any file is written."""

from __future__ import annotations

import importlib
import itertools
import json
import math
import os
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from blocktrain.errors import ConfigError
from blocktrain.fsutil import atomic_write_bytes

BACKENDS = ("tensorboard", "wandb", "mlflow")
INSTALL = {
    "tensorboard": "pip install tensorboardX",
    "wandb": "pip install wandb",
    "mlflow": "pip install mlflow-skinny",
}
IDS_FILE = "tracking.json"
TENSORBOARD_DIR = "tensorboard"
WANDB_DIR = "wandb"
MLFLOW_DIR = "mlruns"
OUTPUTS = (TENSORBOARD_DIR, WANDB_DIR, MLFLOW_DIR, IDS_FILE)  # what the backends write


class Tracker(Protocol):
    """One experiment-logging backend: the trainer hands it each metrics record."""

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def parse_backends(values: Sequence[str] | None) -> tuple[str, ...]:
    """--log-to values (repeatable, or comma-separated), deduplicated in order."""
    names: list[str] = []
    for value in values or ():
        for name in (n.strip() for n in value.split(",")):
            if not name:
                continue
            if name not in BACKENDS:
                raise ConfigError(f"--log-to {name!r}: choose from {', '.join(BACKENDS)}")
            if name not in names:
                names.append(name)
    return tuple(names)


def _import(name: str) -> Any:
    """The library a backend writes with; a ConfigError naming the pip command when it is not
    installed (or does not import)."""
    try:
        if name == "tensorboard":
            try:
                return importlib.import_module("tensorboardX").SummaryWriter
            except ImportError:
                return importlib.import_module("torch.utils.tensorboard").SummaryWriter
        if name == "wandb":
            return importlib.import_module("wandb")
        return importlib.import_module("mlflow.tracking")
    except ImportError as exc:
        raise ConfigError(
            f"--log-to {name} needs a library that is not installed ({exc}): {INSTALL[name]}"
        ) from None


def check_backends(names: Iterable[str]) -> None:
    """Import every backend's library now, before the run folder is touched."""
    for name in names:
        _import(name)


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """A metrics.jsonl record as (step, {name: value}) of finite numbers."""
    prefix = str(record.get("split") or record.get("event") or "eval")
    out: dict[str, float] = {}

    def add(name: str, value: Any) -> None:
        if isinstance(value, bool) or value is None:
            return
        if isinstance(value, int | float):
            if math.isfinite(value):
                out[name] = float(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                add(f"{name}/{k}", v)
        elif isinstance(value, list | tuple):
            for i, v in enumerate(value):
                add(f"{name}/{i}", v)

    for key, value in record.items():
        if key not in ("event", "split", "step"):
            add(f"{prefix}/{key}", value)
    return int(record.get("step", 0)), out


def log_record(trackers: Iterable[Tracker], record: dict[str, Any]) -> None:
    """One record, as metrics.jsonl would hold it, to each tracker as named scalars."""
    trackers = list(trackers)
    if trackers:
        step, values = scalars(record)
        for tracker in trackers:
            tracker.log(step, values)


def _flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_flat_config(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _ids(run_dir: Path) -> dict[str, str]:
    try:
        doc = json.loads((run_dir / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in doc.items() if isinstance(v, str)} if isinstance(doc, dict) else {}


def _save_id(run_dir: Path, key: str, value: str) -> None:
    ids = {**_ids(run_dir), key: value}
    atomic_write_bytes(run_dir / IDS_FILE, (json.dumps(ids, indent=2) + "\n").encode())


_WRITERS = itertools.count()  # numbers this process's TensorBoard writers (their suffix)


class TensorBoardTracker:
    """Event files under RUN_DIR/tensorboard/."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resumed_at: int | None) -> None:
        writer = _import("tensorboard")
        # purge_step: TensorBoard discards what an earlier process logged from that step on
        # a file of its own even when a resume starts within the second the last one did
        # (the files are named by the second and the host; the suffix tells apart the writers
        # of one process too)
        start = "new" if resumed_at is None else f"step{resumed_at}"
        self.writer = writer(
            str(run_dir / TENSORBOARD_DIR),
            purge_step=None if resumed_at is None else resumed_at + 1,
            filename_suffix=f".{start}.{os.getpid()}.{next(_WRITERS)}",
        )
        if resumed_at is None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```", 0)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run, offline under RUN_DIR/wandb/ unless WANDB_MODE says otherwise."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resumed_at: int | None) -> None:
        wandb = _import("wandb")
        run_id = _ids(run_dir).get("wandb") or secrets.token_hex(4)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "blocktrain",
            name=run_dir.resolve().name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),  # its files go in run_dir/wandb/ (WANDB_DIR)
            config=config,
            mode=os.environ.get("WANDB_MODE") or "offline",
        )
        _save_id(run_dir, "wandb", run_id)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    """An MLflow run, in a file store under RUN_DIR/mlruns/ unless MLFLOW_TRACKING_URI says
    otherwise."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resumed_at: int | None) -> None:
        tracking = _import("mlflow")
        from mlflow.entities import Metric, Param

        self._metric = Metric
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / MLFLOW_DIR).resolve().as_uri()
            # MLflow 3 keeps the file store, in maintenance mode, behind this switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = tracking.MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "blocktrain"
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(name)
        )
        run_id = _ids(run_dir).get("mlflow")
        if run_id is not None:
            try:
                self.client.get_run(run_id)
            except Exception:  # gone from this store (another tracking URI): a new run
                run_id = None
        if run_id is None:
            run = self.client.create_run(experiment_id, run_name=run_dir.resolve().name)
            run_id = run.info.run_id
            params = [Param(k, str(v)[:500]) for k, v in _flat_config(config).items()]
            self.client.log_batch(run_id, params=params)
            _save_id(run_dir, "mlflow", run_id)
        self.run_id = run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(k, v, now, step) for k, v in scalars.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


TRACKERS: dict[str, Callable[[Path, dict[str, Any], int | None], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}


def open_trackers(
    names: Sequence[str], run_dir: Path, config: dict[str, Any], resumed_at: int | None = None
) -> list[Tracker]:
    """One tracker per backend for the run in `run_dir`, resumed after step `resumed_at`
    (TensorBoard drops what was logged after it; None: a new run, its config logged)."""
    opened: list[Tracker] = []
    try:
        for name in names:
            opened.append(TRACKERS[name](Path(run_dir), config, resumed_at))
    except BaseException:
        close_trackers(opened)
        raise
    return opened


class Tracking:
    """The trackers of one folder, opened at the first record logged, so that a command that
    logs nothing (a worker that never trained a round) writes nothing there."""

    def __init__(
        self,
        names: Sequence[str],
        run_dir: Path,
        config: dict[str, Any],
        resumed_at: int | None = None,
    ) -> None:
        self.names, self.run_dir, self.config = tuple(names), Path(run_dir), config
        self.resumed_at = resumed_at
        self.trackers: list[Tracker] | None = None

    def log(self, record: dict[str, Any]) -> None:
        if not self.names:
            return
        if self.trackers is None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.trackers = open_trackers(self.names, self.run_dir, self.config, self.resumed_at)
        log_record(self.trackers, record)

    def close(self) -> None:
        close_trackers(self.trackers or ())
        self.trackers = None


def remove_outputs(run_dir: Path) -> None:
    """Remove what the backends wrote in `run_dir` (OUTPUTS), for a run replaced by a new one
    (`cluster --overwrite`): TensorBoard would show both runs' events as one."""
    for name in OUTPUTS:
        path = Path(run_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def close_trackers(trackers: Iterable[Tracker]) -> None:
    for tracker in trackers:
        tracker.close()
