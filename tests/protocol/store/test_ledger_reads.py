"""Token and worker reads go through the ledger's second connection: they do not queue behind
a write in progress, and they see every commit, the CLI's (another process) included."""

from __future__ import annotations

import threading

from blocktrain.protocol.store.ledger import Ledger
from blocktrain.protocol.store.tokens import hash_token
from tests.protocol.conftest import T0, add_token, make_state


def test_token_reads_do_not_wait_for_the_writer(tmp_path):
    state = make_state(tmp_path / "s")
    token = add_token(state, "alice")
    ledger = state.ledger
    held, release = threading.Event(), threading.Event()

    def writer() -> None:
        with ledger._lock:  # a commit in progress (its fsync) holds the writer's lock
            held.set()
            release.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert held.wait(5)
        got: list[object] = []
        reader = threading.Thread(
            target=lambda: got.append(ledger.token_by_hash(hash_token(token)))
        )
        reader.start()
        reader.join(2)
        assert not reader.is_alive(), "the token read waited for the writer's lock"
        assert got and got[0] is not None
    finally:
        release.set()
        thread.join()
        state.close()


def test_reads_see_a_revocation_written_by_another_connection(tmp_path):
    state = make_state(tmp_path / "s")
    token = add_token(state, "alice")
    ledger = state.ledger
    assert ledger.token_by_hash(hash_token(token)).revoked is None
    other = Ledger(state.root / "ledger.sqlite")  # as `blocktrain token revoke` opens it
    assert other.revoke_token("alice", T0 + 1)
    other.close()
    assert ledger.token_by_hash(hash_token(token)).revoked is not None
    state.close()


def test_an_accepted_row_is_fsynced_outside_the_service_lock_before_the_answer(
    harness, monkeypatch
):
    import blocktrain.protocol.service.pushes as pushes_module
    import blocktrain.protocol.store.ledger as ledger_module
    from blocktrain.protocol.store.ledger_schema import fsync_wal
    from tests.protocol.conftest import delta_body

    service = harness.service
    syncs: list[tuple[str, bool, int]] = []

    def recorder(where: str):
        def sync(path):
            rows = len(service.ledger.updates(fate="accepted"))
            syncs.append((where, service.lock._is_owned(), rows))
            fsync_wal(path)

        return sync

    monkeypatch.setattr(pushes_module, "fsync_wal", recorder("service"))
    monkeypatch.setattr(ledger_module, "fsync_wal", recorder("ledger"))
    w = harness.register(harness.alice, block=0)["worker_id"]
    wb = harness.register(harness.bob, block=0)["worker_id"]
    harness.pull(harness.alice, w, 0)
    harness.pull(harness.bob, wb, 0)  # a second expected replica: the push closes no round
    syncs.clear()
    r = harness.push(harness.alice, w, 0, delta_body(0, worker=w))
    assert r.status_code == 200, r.text
    # the row's own transaction did not fsync; the service did, without its lock, row written
    assert [s for s in syncs if s[0] == "service"] == [("service", False, 1)], syncs
    assert not any(s[0] == "ledger" and s[2] == 1 and s[1] for s in syncs), syncs


def test_each_thread_reads_through_its_own_connection(tmp_path):
    state = make_state(tmp_path / "s")
    token = add_token(state, "alice")
    ledger = state.ledger
    seen = []

    def read() -> None:
        assert ledger.token_by_hash(hash_token(token)) is not None
        seen.append(ledger._readers._local.db)

    threads = [threading.Thread(target=read) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    read()
    assert len({id(db) for db in seen}) == 4  # none shared, so no read queues for another
    state.close()
    assert ledger._readers._all == []
