"""Who may call the aggregator (token, rate, the worker it speaks for, the block it names),
checked before a byte of a push's body is read (`begin_push`), and the ledger row of a push
refused once its token is known (`_record_refusal`). A mixin of `AggregatorService`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from blocktrain.errors import Refused
from blocktrain.httpserve import FailedAuth, TokenBucket
from blocktrain.protocol.core.round_engine import RoundEngine
from blocktrain.protocol.core.verdict import refused
from blocktrain.protocol.service import identity
from blocktrain.protocol.service.access import RateLimited, rate_limit
from blocktrain.protocol.service.identity import Caller
from blocktrain.protocol.service.placement import Directory
from blocktrain.protocol.service.updates import PushContext
from blocktrain.protocol.store.ledger import Ledger
from blocktrain.protocol.store.ledger_schema import TokenRow

log = logging.getLogger(__name__)


class Admission:
    """Identity, rate and placement checks, and refusal rows, over the service's state."""

    ledger: Ledger
    limiter: TokenBucket
    failed_auth: FailedAuth
    n_blocks: int
    directory: Directory
    engine: RoundEngine
    clock: Callable[[], float]
    lock: threading.RLock

    # ------------------------------------------------------------------ identity

    def authenticate(self, authorization: str | None, *, address: str | None) -> TokenRow:
        """The caller's token (`identity.authenticate`). From `address` (None: a caller in this
        process), a burst of invalid tokens locks every check out for a while (`httpserve.FailedAuth`);
        a request without a token is no guess: it gets its 401 `missing_token`."""
        if address is not None and authorization and (wait := self.failed_auth.wait(address)):
            raise RateLimited(self.failed_auth.refusal(address, wait), wait)
        try:
            return identity.authenticate(self.ledger, authorization)
        except Refused as exc:
            if address is not None and exc.reason == "invalid_token":
                self.failed_auth.failed(address)
            raise

    def identify(
        self, token: TokenRow, worker_header: str | None, endpoint: str | None = None
    ) -> Caller:
        return identity.identify(self.ledger, token, worker_header, endpoint)

    def admit(self, token_id: int) -> None:
        """The token's rate limit (RateLimited, a 429, when it is spent)."""
        rate_limit(self.limiter, token_id)

    def check_block(self, block: int) -> None:
        if not 0 <= block < self.n_blocks:
            raise refused("unknown_block", f"block {block} is outside 0..{self.n_blocks - 1}")
        self.directory.check(block)

    def resumable(self, token: TokenRow, worker_id: int, block: int | None) -> int:
        """The block of a worker that `token` asks to take back (`resume_worker_id`): its own worker,
        left, timed out or still registered; refused `unknown_worker`, `not_your_worker` or
        `not_assigned` otherwise."""
        row = self.ledger.worker(worker_id)
        if row is None:
            raise refused(
                "unknown_worker",
                f"worker {worker_id} is not known to this aggregator: it cannot be resumed",
            )
        if row.token_id != token.id:
            raise refused(
                "not_your_worker",
                f"worker {worker_id} belongs to another token: only its own may resume it",
            )
        if block is not None and block != row.block:
            raise refused(
                "not_assigned",
                f"worker {worker_id} trains block {row.block}; it cannot resume on block {block}",
            )
        return row.block

    def _worker_on(self, caller: Caller, block: int) -> int:
        if caller.worker_id is None:
            raise refused(
                "unknown_worker", "this token has no registered worker; POST /v1/workers first"
            )
        self.check_block(block)
        assigned = self.engine.registry.block_of(caller.worker_id)
        if assigned != block:
            raise refused(
                "not_assigned",
                f"worker {caller.worker_id} is assigned to block {assigned}, not {block}",
            )
        return caller.worker_id

    def begin_push(self, *, token: TokenRow, worker_header: str | None, block: int) -> PushContext:
        """Who is pushing, to which block: refused before a byte of the body is read, and so is an
        identity whose probe budget in the open round is spent (`busy`) or that already fills the round
        (`duplicate`). Only an admitted token's refusals get a ledger row."""
        received = self.clock()
        self.admit(token.id)
        worker: int | None = None
        try:
            identity.check_may(token, "push")
            caller = self.identify(token, worker_header)
            worker = caller.worker_id
            worker = self._worker_on(caller, block)
            with self.lock:  # what judge or reserve_probe would say: not worth reading the body
                spent = self.engine.identity_full(worker, block) or self.engine.budget_spent(
                    worker, block
                )
            if spent is not None:
                raise refused(spent.reason, spent.detail)
        except Refused as exc:
            self._record_refusal(received, token.id, worker, block, exc, 0)
            raise
        return PushContext(received, token.id, worker, block)

    def refuse_push(self, ctx: PushContext, reason: str, detail: str, size: int) -> Refused:
        exc = refused(reason, detail)
        self._record_refusal(ctx.received, ctx.token_id, ctx.worker_id, ctx.block, exc, size)
        return exc

    def _record_refusal(
        self,
        received: float,
        token_id: int | None,
        worker: int | None,
        block: int | None,
        exc: Refused,
        size: int,
        sync: bool = True,
        **fields: Any,
    ) -> None:
        """The refused update's ledger row (fsynced unless `sync` is False: then the caller
        fsyncs the ledger before answering)."""
        known_block = block if block in self.directory.served else None
        self.ledger.record_update(
            received=received,
            bytes=size,
            fate="refused",
            token_id=token_id,
            worker_id=worker,
            block=known_block,
            reason=exc.reason,
            detail=exc.detail,
            sync=sync,
            **fields,
        )
        log.info(
            "refused an update for block %s from worker %s: %s (%s)",
            block,
            worker,
            exc.reason,
            exc.detail,
        )
