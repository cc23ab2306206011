"""The loop a worker runs: register -> [wait for a new round -> pull -> train the steps the
pull tells -> push delta] ...

`WorkerLoop` drives any `LocalTrainer` and knows nothing of the model. It re-syncs by itself:
after a refusal it pulls again, after an aggregator restart its retries reconnect, and if its
worker id is gone it registers anew. A stop event ends it between local steps, and it tells the
aggregator it leaves. With a folder (`resume.WorkerFolder`) it saves its state after each push.
Each round gives one `RoundOutcome` (`on_round`), said as a line."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from blocktrain.errors import ProtocolError, Refused, Unreachable
from blocktrain.protocol.core.bodies import update_body
from blocktrain.protocol.core.codecs import DeltaEncoder
from blocktrain.protocol.core.local_trainer import LocalTrainer, RelayTrainer
from blocktrain.protocol.worker.client import AggregatorClient
from blocktrain.protocol.worker.outcome import LATE_HINT as LATE_HINT
from blocktrain.protocol.worker.outcome import RoundOutcome as RoundOutcome
from blocktrain.protocol.worker.outcome import WorkerReport as WorkerReport
from blocktrain.protocol.worker.replies import Registration
from blocktrain.protocol.worker.resume import WorkerFolder
from blocktrain.protocol.worker.retrying import RetryPolicy
from blocktrain.relaystream import RelayStream

log = logging.getLogger(__name__)

Tensors = dict[str, torch.Tensor]

LONG_POLL_S = 5.0
"""How long a worker waits in one long poll for the next round (also bounds how long a
SIGTERM can take to be noticed while waiting)."""
RESYNC_REASONS = frozenset({"late", "stale_version", "future_round", "duplicate", "version_gone"})
"""Refusals after which a worker simply pulls the open round again (version_gone: a round
closed, and its version was pruned, between the pull and the download)."""
REREGISTER_REASONS = frozenset({"unknown_worker", "not_assigned", "not_your_worker", "wrong_wire"})
"""Refusals after which a worker registers again (wrong_wire: the aggregator was restarted with
another `--wire`; registering tells the new one)."""
FATAL_REASONS = frozenset({"missing_token", "invalid_token"})
"""Refusals no retry can fix."""


TrainerFactory = Callable[[Registration, dict[str, Any]], LocalTrainer]
"""Builds the trainer for a registration, given the aggregator's /v1/config."""


class WorkerLoop:
    """pull -> train -> push, round after round, until the block is done or `stop` is set."""

    def __init__(
        self,
        client: AggregatorClient,
        make_trainer: TrainerFactory,
        *,
        block: int | None = None,
        name: str | None = None,
        stop: threading.Event | None = None,
        max_rounds: int | None = None,
        say: Callable[[str], None] | None = None,
        clock: Callable[[], float] | None = None,
        folder: WorkerFolder | None = None,
        on_round: Callable[[RoundOutcome], None] | None = None,
        spool: Path | None = None,
    ) -> None:
        """`say`: where the worker's lines go (default: this module's log); `folder`: what a restart
        resumes; `on_round`: each round's outcome, before the folder saves the round (a worker killed
        in between logs that round again once resumed); `spool`: where a relayed stream is downloaded."""
        self.client = client
        self.make_trainer = make_trainer
        self.want_block = block
        self.name = name
        self.stop = stop or client.stop
        self.client.stop = self.stop
        self.max_rounds = max_rounds
        self.say = say or log.info
        self.on_round = on_round
        self.clock = clock or time.monotonic
        self.report = WorkerReport()
        self._registration: Registration | None = None
        self._trainer: LocalTrainer | None = None
        self._encoder: DeltaEncoder | None = None
        """Compresses pushes in the announced delta wire, keeping the error-feedback residual."""
        self._config: dict[str, Any] | None = None
        self.folder = folder
        self._resume = folder.saved if folder is not None else None
        """The saved worker the first registration takes back."""
        self._last_round = -1
        """The round the loop waits past after a registration (a resumed worker's last)."""
        self.spool = spool
        self._waiting_for_stream = False

    def _locate(self, block: int | None) -> None:
        """Move to the aggregator that serves `block`, as the directory of the one we talk to
        says (an aggregator without a directory serves every block)."""
        if block is None:
            return
        try:
            url = self.client.directory().get("blocks", {}).get(str(block))
        except Refused as exc:
            if exc.status != 404:
                raise
            return
        if url and url.rstrip("/") != self.client.base_url:
            log.info("block %d is served by %s: moving there", block, url)
            self.client.move_to(url)

    def _register(self) -> Registration:
        resume, self._resume = self._resume, None
        block, again = (
            (self.want_block, None) if resume is None else (resume.block, resume.worker_id)
        )
        self._locate(block)
        if self.folder is not None:  # the run of the aggregator registered at
            self._config = self.client.config()
            if resume is not None:
                self.folder.check_run(self.client.base_url, self._config)
        try:
            reg = self.client.register(block, self.name, again)
        except Refused as exc:
            if resume is None or self.folder is None:
                raise
            raise self.folder.refused(exc) from exc
        new_trainer = self._registration is None or reg.block != self._registration.block
        if new_trainer:
            if self._config is None:
                self._config = self.client.config()
            self._trainer = self.make_trainer(reg, self._config)
            self._encoder = None
        if self._encoder is None or self._encoder.name != reg.delta_wire:
            self._encoder = DeltaEncoder(reg.delta_wire)
        self._registration = reg
        self._last_round = -1
        self.report.worker_id, self.report.block = reg.worker_id, reg.block
        self.say(
            f"worker {reg.worker_id} on block {reg.block} (data seed {reg.data_seed}, "
            f"H = {reg.local_steps} local steps a round)"
        )
        if self.folder is not None:
            assert self._config is not None and self._trainer is not None
            if resume is not None:
                line, view = self.folder.restore(self._trainer, self._encoder, reg)
                self.say(line)
                self.client.view = view or self.client.view
                self._last_round = self.folder.round
            fresh = new_trainer and resume is None
            self.folder.registered(reg, self.client.base_url, self._config, new_trainer=fresh)
        return reg

    def run(self) -> WorkerReport:
        try:
            self._run()
        except Unreachable:
            if not self.stop.is_set():
                raise
            self.report.stopped_by = "signal"
        finally:
            if self.stop.is_set() and self.report.stopped_by in ("", "signal"):
                self.report.stopped_by = "signal"
            if self.report.stopped_by in ("signal", "max_rounds", "done"):
                # so that the block stops waiting for this replica, and its status shows it
                # left (a done block waits for no one, but the worker would show as live for
                # the live window)
                self._say_goodbye()
            self.report.bytes_down = self.client.bytes_down
            self.report.bytes_up = self.client.bytes_up
        return self.report

    def _say_goodbye(self) -> None:
        stop, self.client.stop = self.client.stop, threading.Event()
        self.client.retry = RetryPolicy(base_s=0.1, cap_s=0.5, give_up_after_s=2.0)
        try:
            self.client.leave()
        except ProtocolError as exc:
            log.info("could not say goodbye: %s", exc)
        finally:
            self.client.stop = stop

    def _run(self) -> None:
        reg = self._register()
        last_round = self._last_round
        while not self.stop.is_set():
            if self.max_rounds is not None and self.report.rounds >= self.max_rounds:
                self.report.stopped_by = "max_rounds"
                return
            try:
                info = self.client.round(reg.block, after=last_round, wait=LONG_POLL_S)
                if info["done"]:
                    self.report.stopped_by = "done"
                    return
                if info["round"] <= last_round:
                    continue  # the long poll timed out; ask again
                ready, stream = self._stream()
                if not ready:
                    continue  # no stream came within the long poll: look at the round again
                pulled = self.client.pull(reg.block)
                pulled_at = self.clock()
                assert self._trainer is not None
                upstream = {b: self.client.latest(b) for b in self._trainer.upstream_blocks}
            except Refused as exc:
                new = self._handle_refusal(exc, reg)
                if self.report.stopped_by:
                    return
                if new.worker_id != reg.worker_id:
                    reg, last_round = new, -1
                continue
            assert self._trainer is not None and self._encoder is not None
            self._trainer.load(pulled.tensors)
            self._trainer.load_upstream(upstream)
            if stream is not None:
                assert isinstance(self._trainer, RelayTrainer)
                self._trainer.load_stream(stream)
            # the schedule follows the block's committed version, not the round: a round that
            # committed nothing (burned by refusals, or empty) does not advance it; the steps
            # are those the pull told (adaptive pacing), else H
            told = reg.local_steps if pulled.local_steps is None else pulled.local_steps
            started = self.clock()
            logs = self._trainer.train(told, pulled.version * reg.local_steps, self.stop.is_set)
            seconds = self.clock() - started
            self.report.local_steps += int(logs.get("steps", 0))
            if self.stop.is_set():
                return
            self.report.last_loss = float(logs["loss"])
            ran = int(logs.get("steps", told))
            body = update_body(
                reg.block,
                self._encoder.compress(self._trainer.delta()),
                base_version=pulled.version,
                round=pulled.round,
                tokens=int(logs["tokens"]),
                loss=float(logs["loss"]),
                worker_id=self.client.worker_id,
                steps=ran if ran > 0 else None,  # declared: the aggregator checks and weighs it
            )
            result = self.client.push_bytes(reg.block, body)
            self._relay(reg.block, pulled.round, result.accepted or result.reason == "duplicate")
            elapsed = self.clock() - pulled_at
            self.report.rounds += 1
            last_round = pulled.round
            got_in = result.accepted or result.reason == "duplicate"  # a retried push got in
            counts_in = result.body.get("counts_in") if result.accepted else None
            outcome = RoundOutcome(
                round=pulled.round,
                block=reg.block,
                steps=int(logs.get("steps", 0)),
                seconds=seconds,
                tokens=int(logs["tokens"]),
                loss=float(logs["loss"]),
                accepted=got_in,
                reason="" if got_in else result.reason,
                detail="" if got_in else result.detail,
                deadline_in=pulled.deadline_in,
                weight=float(result.body.get("weight", 1.0)) if result.accepted else 1.0,
                counts_in=None if counts_in is None else int(counts_in),
                elapsed=elapsed,
                pacing=str((self._config or {}).get("protocol", {}).get("pacing", "fixed")),
            )
            self.report.late += outcome.late
            for line in outcome.lines():
                self.say(line)
            if self.on_round is not None:
                self.on_round(outcome)
            if not got_in:
                self._encoder.reset()
            if self.folder is not None:  # what a restart resumes from: this state
                self.folder.pushed(reg, pulled, self._trainer, self._encoder, self.client.view)
            if got_in:
                self.report.accepted += 1
                continue
            self.report.refused[result.reason] = self.report.refused.get(result.reason, 0) + 1
            new = self._handle_refusal(Refused(result.reason, result.detail, result.status), reg)
            if self.report.stopped_by:
                return
            if new.worker_id != reg.worker_id:
                reg, last_round = new, -1

    def _stream(self) -> tuple[bool, RelayStream | None]:
        """route = relay: (whether to train this round, the stream of the block before to
        train on), after a long poll of LONG_POLL_S; (True, None) when the trainer reads none."""
        trainer = self._trainer
        if not isinstance(trainer, RelayTrainer) or trainer.relays_from is None:
            return True, None
        dest = None if self.spool is None else self.spool / "in.stream"
        if dest is not None:
            dest.parent.mkdir(parents=True, exist_ok=True)
        before = self.client.bytes_down
        stream = self.client.take_stream(trainer.relays_from, wait=LONG_POLL_S, dest=dest)
        self.report.bytes_stream_down += self.client.bytes_down - before
        if stream is None and not self._waiting_for_stream:
            self.say(
                f"waiting for a stream of block {trainer.relays_from} to train on (route = "
                f"relay: a worker of block {trainer.relays_from} relays one each round)"
            )
        self._waiting_for_stream = stream is None
        return stream is not None, stream

    def _relay(self, block: int, round: int, delivered: bool) -> None:
        """route = relay: send the round's stream after its delta; the aggregator keeps it
        only if that delta was accepted or refused for its timing (else `no_update`, said in
        the log)."""
        trainer = self._trainer
        if not isinstance(trainer, RelayTrainer) or trainer.relays_to is None:
            return
        body = trainer.stream_out({"round": str(round), "worker": str(self.client.worker_id)})
        if body is None:
            return
        try:
            result = self.client.push_stream(block, round, body)
        finally:
            body.close()
        self.report.bytes_stream_up += body.size
        if not result.accepted:
            log.info(
                "stream of round %d not kept: %s (%s)%s",
                round,
                result.reason,
                result.detail,
                "" if delivered else ", its delta was refused",
            )

    def _handle_refusal(self, exc: Refused, reg: Registration) -> Registration:
        if exc.reason == "done":
            self.report.stopped_by = "done"
            return reg
        if exc.reason in FATAL_REASONS:
            raise exc
        if exc.reason == "wrong_aggregator":  # the block moved (or the directory changed)
            self._locate(reg.block if self.want_block is None else self.want_block)
            return self._register()
        if exc.reason in REREGISTER_REASONS:
            log.info("re-registering after %s", exc.reason)
            return self._register()
        if exc.reason in RESYNC_REASONS:
            return reg  # the next iteration pulls the open round
        # a content refusal (norm, non-finite, ...): this replica's state is suspect; start
        # the next round from the aggregator's weights, as after any refusal
        log.warning("update refused for its content: %s (%s)", exc.reason, exc.detail)
        return reg
