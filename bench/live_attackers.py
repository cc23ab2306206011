"""Hostile clients for bench/live_attacks.py, each run in a process of its own (standard library
only: it starts fast, imports no torch, and takes none of the measuring process's GIL; but
near-replay, which trains its one honest update with blocktrain):

    python live_attackers.py halfopen HOST PORT --seconds 30
    python live_attackers.py push-flood URL --token-file T --template F --seconds 30
    python live_attackers.py stuffing URL --token-file T1 --token-file T2 --template F
    python live_attackers.py near-replay URL --token-file T --preset tiny --local-steps 5
    python live_attackers.py near-copy URL --token-file T --template F --sniff STATE/pending/0
    python live_attackers.py noise-probe URL --token-file T1 --template F1,F2 --token-file T2 ...
    python live_attackers.py unread-streams URL --streams 8 --seconds 30
    python live_attackers.py stop-strings URL --mb 1 --seconds 30

Each connects from `--source` addresses (default 127.0.0.2, a loopback address of its own, so
that the servers' per-address limits see another client than the honest ones on 127.0.0.1),
runs for `--seconds`, then prints one JSON line of what it did (counts of each outcome).

- halfopen: keeps `--target` connections opening from each source address, each sending
  half a request head and nothing more; any the server answers or closes is re-opened at
  once.
- push-flood: `--connections` threads push valid-shaped deltas (the template's tensors, a
  counter in the first bytes so that no two bodies are alike) for one token's worker, naming
  the open round, as fast as the aggregator answers; a worker that already reported is
  replaced by a new registration of the token.
- stuffing: each token's worker pulls every round as it opens and pushes junk for it at once
  (a tensor of the wrong shape from even tokens, a NaN among the right shapes from odd ones:
  refused for their form, before the probe).
- near-replay (issue 58): a token holder that trains one honest update of block 0 and has it
  accepted, then free-rides on it: each later round it pushes that delta again, re-stamped for
  the round, with one fp16 value moved by one ulp, or with Gaussian noise of 1e-3 of its norm,
  in turn.
- near-copy (issue 58): each round, the first honest body of block 0 it can read (the
  aggregator's pending folder, standing in for a body sniffed off plain http) pushed at once
  under its own token, re-stamped for its worker, with one fp16 value moved by one ulp.
- noise-probe (issue 58): each token's worker pushes, every round of its template's block, the
  template's zero-mean noise (a share of the norm bound; its templates taken in turn).
- unread-streams: keeps `--streams` streamed completions open per source address, never
  reading a byte; one the server closes is opened again.
- stop-strings: `--connections` threads post completions carrying `--mb` MB of stop strings
  (alternately 1 KiB strings by the thousand and four strings of a quarter of it each).
"""

from __future__ import annotations

import argparse
import errno
import http.client
import json
import resource
import selectors
import socket
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# ------------------------------------------------------------------------------------- bodies


def safetensors_body(
    manifest: list[dict[str, Any]], data: bytes | bytearray, metadata: dict[str, str]
) -> bytes:
    """A safetensors file of the tensors laid out in `data` as `manifest` says (each entry:
    name, dtype code, shape, begin, end), with string `metadata`; the header padded with
    spaces to a multiple of 8 bytes, as safetensors writes it."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for t in manifest:
        header[t["name"]] = {
            "dtype": t["dtype"],
            "shape": t["shape"],
            "data_offsets": [t["begin"], t["end"]],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + bytes(data)


def update_metadata(block: int, round_: int, version: int, tokens: int, steps: int) -> dict:
    return {
        "block": str(block),
        "base_version": str(version),
        "round": str(round_),
        "tokens": str(tokens),
        "steps": str(steps),
    }


def misshapen(manifest: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same tensors, the first one's shape changed (flattened, or a 1-D one given a second
    axis): a body of the right size that every validator reads and refuses (`bad_shape`)."""
    first, *rest = manifest
    n = 1
    for d in first["shape"]:
        n *= d
    shape = [n] if len(first["shape"]) > 1 else [n, 1]
    return [{**first, "shape": shape}, *rest]


NAN = {"F16": b"\x00\x7e", "BF16": b"\xc0\x7f", "F32": b"\x00\x00\xc0\x7f"}
"""A quiet NaN in each wire dtype, little-endian."""


def nan(data: bytearray, dtype: str) -> None:
    """Make the value just past the 8 bytes a push's counter takes a NaN: a body
    every validator reads and refuses (`non_finite`)."""
    width = len(NAN[dtype])
    data[8 : 8 + width] = NAN[dtype]


class Template:
    """What bench/live_attacks.py wrote for the update attackers: the block's tensors (a small
    noise delta in the wire dtype, raw bytes) and what a push names."""

    def __init__(self, path: Path) -> None:
        doc = json.loads(path.read_text())
        self.manifest: list[dict[str, Any]] = doc["tensors"]
        self.block: int = doc["block"]
        self.tokens: int = doc["tokens"]
        self.steps: int = doc["steps"]
        self.share: float = doc.get("share", 0.5)
        """The delta's norm as a share of the norm bound."""
        self.data = bytearray(Path(doc["data"]).read_bytes())


# ------------------------------------------------------------------------------------- HTTP


class Http:
    """One-request connections to the server at `url`, from `source`."""

    def __init__(self, url: str, source: str, timeout_s: float = 30.0) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.source, self.timeout_s = source, timeout_s

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> tuple[int | str, bytes]:
        """(status, body), or (why it failed, b"") when the connection was cut or refused."""
        conn = http.client.HTTPConnection(
            self.host, self.port, timeout=self.timeout_s, source_address=(self.source, 0)
        )
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        except (ConnectionError, http.client.HTTPException, TimeoutError, OSError) as exc:
            return type(exc).__name__, b""
        finally:
            conn.close()


def reason_of(status: int | str, body: bytes) -> str:
    """An outcome's name: the status and, for an aggregator refusal, its reason."""
    if isinstance(status, str):
        return status
    try:
        reason = json.loads(body).get("reason")
    except (ValueError, AttributeError):
        reason = None
    return f"{status} {reason}" if reason else str(status)


class Counts:
    """Outcome counts shared by an attacker's threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counter: Counter[str] = Counter()

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counter[key] += n

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return dict(sorted(self.counter.items()))


# ------------------------------------------------------------------------------------- halfopen


def halfopen(
    host: str, port: int, sources: list[str], seconds: float, target: int, path: str
) -> dict[str, Any]:
    """Keep `target` connections opening from each source address, each with half a request
    head sent; re-open each one the server answers (a 503 over a share) or closes (the head
    timeout, or a newcomer displacing it)."""
    sel = selectors.DefaultSelector()
    head = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: halfopen\r\n".encode()
    counts: Counter[str] = Counter()
    end = time.monotonic() + seconds
    source_of: dict[socket.socket, str] = {}
    mine: Counter[str] = Counter()
    """source -> its connections open."""
    peak_held = 0

    def close(s: socket.socket) -> None:
        sel.unregister(s)
        mine[source_of.pop(s)] -= 1
        s.close()

    def open_one(source: str) -> bool:
        """One more connection from `source` -> whether it opened."""
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.bind((source, 0))
            err = s.connect_ex((host, port))
        except OSError as exc:
            s.close()
            counts[f"open_failed {errno.errorcode.get(exc.errno or 0, exc)}"] += 1
            return False
        if err not in (0, errno.EINPROGRESS):
            s.close()
            counts[f"open_failed {errno.errorcode.get(err, err)}"] += 1
            return False
        sel.register(s, selectors.EVENT_WRITE, "connecting")
        source_of[s] = source
        mine[source] += 1
        counts["opened"] += 1
        return True

    while time.monotonic() < end:
        burst = 64  # open in bursts, between looks at what the server said
        for source in sources:
            while burst and mine[source] < target and open_one(source):
                burst -= 1
        held = sum(1 for k in sel.get_map().values() if k.data == "held")
        peak_held = max(peak_held, held)
        for key, _ in sel.select(timeout=0.02):
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if key.data == "connecting":
                err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    counts[f"open_failed {errno.errorcode.get(err, err)}"] += 1
                    close(s)
                    continue
                try:
                    s.send(head)
                except OSError:
                    counts["cut"] += 1
                    close(s)
                    continue
                sel.modify(s, selectors.EVENT_READ, "held")
                continue
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if data.startswith(b"HTTP/1.1 "):
                counts[f"answered {data[9:12].decode(errors='replace')}"] += 1
            else:
                counts["closed by the server"] += 1
            close(s)
    still = sum(1 for k in sel.get_map().values() if k.data == "held")
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    return {"outcomes": dict(sorted(counts.items())), "held_at_end": still, "peak_held": peak_held}


# ------------------------------------------------------------------------------------- aggregator


class Worker:
    """The attacker's one worker of a token, re-registered when the aggregator stops taking its
    pushes for the round; the open round and version it names."""

    def __init__(self, http_: Http, token: str, block: int, counts: Counts) -> None:
        self.http, self.token, self.block, self.counts = http_, token, block, counts
        self.lock = threading.Lock()
        self.id: int | None = None
        self.round = 0
        self.version = 0
        self.register(None)

    def headers(self, worker: int | None = None) -> dict[str, str]:
        h = {"Authorization": f"Bearer {self.token}"}
        if worker is not None:
            h["X-Worker-Id"] = str(worker)
        return h

    def register(self, old: int | None) -> None:
        """A new worker in place of `old` (unless another thread replaced it already)."""
        with self.lock:
            if old is not None and self.id != old:
                return
            body = json.dumps({"block": self.block}).encode()
            headers = {**self.headers(), "Content-Type": "application/json"}
            status, answer = self.http.request("POST", "/v1/workers", body, headers)
            self.counts.add(f"register {reason_of(status, answer)}")
            if status == 200:
                doc = json.loads(answer)
                self.id, self.round, self.version = doc["worker_id"], doc["round"], doc["version"]

    def refresh(self) -> None:
        status, answer = self.http.request(
            "GET", f"/v1/blocks/{self.block}/round", None, self.headers()
        )
        self.counts.add(f"round {reason_of(status, answer)}")
        if status == 200:
            doc = json.loads(answer)
            with self.lock:
                self.round, self.version = doc["round"], doc["version"]

    def pull(self) -> None:
        """Pull the open round (it makes the worker a replica the round expects)."""
        with self.lock:
            worker = self.id
        status, answer = self.http.request(
            "GET", f"/v1/blocks/{self.block}?redirect=1", None, self.headers(worker)
        )
        self.counts.add(f"pull {reason_of(status, answer)}")


def push(
    worker: Worker, template: Template, manifest: list[dict[str, Any]], data: bytearray
) -> str:
    with worker.lock:
        wid, round_, version = worker.id, worker.round, worker.version
    meta = update_metadata(template.block, round_, version, template.tokens, template.steps)
    body = safetensors_body(manifest, data, meta)
    headers = {**worker.headers(wid), "Content-Type": "application/vnd.safetensors"}
    status, answer = worker.http.request(
        "POST", f"/v1/blocks/{template.block}/updates", body, headers
    )
    outcome = reason_of(status, answer)
    worker.counts.add(f"push {outcome}")
    if outcome.endswith(("duplicate", "not_assigned", "unknown_worker")):
        worker.register(wid)
    elif outcome.endswith(("late", "stale_version", "future_round")):
        worker.refresh()
    return outcome


def push_flood(
    url: str, source: str, token: str, template: Template, seconds: float, connections: int
) -> dict[str, Any]:
    counts = Counts()
    worker = Worker(Http(url, source), token, template.block, counts)
    end = time.monotonic() + seconds
    sent = [0]

    def run(i: int) -> None:
        data = bytearray(template.data)
        n = 0
        while time.monotonic() < end:
            n += 1
            data[0:8] = struct.pack("<II", i, n)  # no two bodies alike: no replay refusal
            push(worker, template, template.manifest, data)
            with counts.lock:
                sent[0] += 1

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return {"pushes": sent[0], "outcomes": counts.as_dict()}


def stuffing(
    url: str, source: str, tokens: list[str], template: Template, seconds: float
) -> dict[str, Any]:
    counts = Counts()
    end = time.monotonic() + seconds

    def run(i: int, token: str) -> None:
        http_ = Http(url, source)
        worker = Worker(http_, token, template.block, counts)
        manifest = misshapen(template.manifest) if i % 2 == 0 else template.manifest
        data = bytearray(template.data)
        if i % 2:
            nan(data, manifest[0]["dtype"])
        last = -1
        while time.monotonic() < end:
            with worker.lock:
                after = worker.round if worker.round > last else last
            wait = max(0.0, min(10.0, end - time.monotonic()))
            status, answer = http_.request(
                "GET",
                f"/v1/blocks/{template.block}/round?after={after}&wait={wait:.1f}",
                None,
                worker.headers(),
            )
            if status != 200:
                counts.add(f"round {reason_of(status, answer)}")
                time.sleep(0.1)
                continue
            doc = json.loads(answer)
            with worker.lock:
                worker.round, worker.version = doc["round"], doc["version"]
            if doc["round"] == last:
                continue
            worker.pull()
            data[0:8] = struct.pack("<II", i, doc["round"])
            push(worker, template, manifest, data)
            last = doc["round"]
            counts.add("rounds stuffed")

    threads = [
        threading.Thread(target=run, args=(i, tok), daemon=True) for i, tok in enumerate(tokens)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return {"tokens": len(tokens), "outcomes": counts.as_dict()}


def read_body(body: bytes) -> tuple[list[dict[str, Any]], bytes, dict[str, str]]:
    """The manifest (in data order), the raw tensor bytes and the metadata of a safetensors
    body: what `safetensors_body` builds from them."""
    (size,) = struct.unpack("<Q", body[:8])
    header = json.loads(body[8 : 8 + size])
    metadata = header.pop("__metadata__", {})
    manifest = [
        {"name": k, "dtype": v["dtype"], "shape": v["shape"], "begin": v["data_offsets"][0],
         "end": v["data_offsets"][1]}
        for k, v in header.items()
    ]  # fmt: skip
    manifest.sort(key=lambda t: t["begin"])
    return manifest, body[8 + size :], metadata


def one_ulp(data: bytes) -> bytearray:
    """The first value (fp16 or bf16, little-endian) moved by one ulp: its bits as an integer
    plus one (minus one for the largest finite magnitudes, whose next step is Inf)."""
    out = bytearray(data)
    (bits,) = struct.unpack("<H", out[:2])
    step = -1 if bits & 0x7FFF in (0x7BFF, 0x7F7F) else 1
    out[:2] = struct.pack("<H", (bits + step) & 0xFFFF)
    return out


def next_round(worker: Worker, http_: Http, after: int, end: float) -> dict[str, Any] | None:
    """The block's round once one after `after` opens (long polls until `end`); None then."""
    while time.monotonic() < end:
        wait = max(0.0, min(10.0, end - time.monotonic()))
        status, answer = http_.request(
            "GET", f"/v1/blocks/{worker.block}/round?after={after}&wait={wait:.1f}", None,
            worker.headers(),
        )  # fmt: skip
        if status != 200:
            worker.counts.add(f"round {reason_of(status, answer)}")
            time.sleep(0.1)
            continue
        doc = json.loads(answer)
        if doc["round"] > after and not doc.get("done"):
            with worker.lock:
                worker.round, worker.version = doc["round"], doc["version"]
            return dict(doc)
    return None


def near_copy(
    url: str, source: str, token: str, template: Template, sniff: Path, seconds: float
) -> dict[str, Any]:
    counts = Counts()
    http_ = Http(url, source)
    worker = Worker(http_, token, template.block, counts)
    end = time.monotonic() + seconds
    seen: set[str] = set()
    last = -1
    while time.monotonic() < end:
        doc = next_round(worker, http_, last, end)
        if doc is None:
            break
        last = doc["round"]
        worker.pull()  # a replica of the round: it waits for this worker's report
        while time.monotonic() < end:
            fresh = sorted(set(p.name for p in sniff.glob("*.safetensors")) - seen)
            body = None
            for name in fresh:
                seen.add(name)
                try:
                    manifest, data, meta = read_body((sniff / name).read_bytes())
                except (OSError, ValueError, struct.error):
                    continue
                if int(meta.get("round", -1)) == last:
                    body = (manifest, data)
                    break
            if body is not None:
                push(worker, template, body[0], one_ulp(body[1]))
                counts.add("rounds copied")
                break
            time.sleep(0.02)
    return {"outcomes": counts.as_dict()}


def noise_probe(
    url: str, source: str, pairs: list[tuple[str, list[Template]]], seconds: float
) -> dict[str, Any]:
    counts = Counts()
    end = time.monotonic() + seconds

    def run(token: str, templates: list[Template]) -> None:
        http_ = Http(url, source)
        worker = Worker(http_, token, templates[0].block, counts)
        last, n = -1, 0
        while time.monotonic() < end:
            doc = next_round(worker, http_, last, end)
            if doc is None:
                return
            last = doc["round"]
            worker.pull()
            template = templates[n % len(templates)]
            outcome = push(worker, template, template.manifest, template.data)
            counts.add(f"block {template.block} share {template.share:g}: {outcome}")
            n += 1

    threads = [threading.Thread(target=run, args=pair, daemon=True) for pair in pairs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return {"tokens": len(pairs), "outcomes": counts.as_dict()}


def near_replay(
    url: str, source: str, token: str, preset_name: str, data: str | None, local_steps: int,
    seconds: float,
) -> dict[str, Any]:  # fmt: skip
    """Train one update of block 0 for real and have it accepted; then push near-copies of it
    in the later rounds (the only attacker here that imports torch and blocktrain)."""
    import httpx
    import torch

    from blocktrain.data import load_split
    from blocktrain.presets import preset
    from blocktrain.protocol.core.bodies import update_body
    from blocktrain.protocol.worker.client import AggregatorClient
    from blocktrain.training.local import LocalBlockTrainer

    end = time.monotonic() + seconds
    counts: Counter[str] = Counter()
    cfg = preset(preset_name)
    client = AggregatorClient(
        url, token, transport=httpx.HTTPTransport(local_address=source), retry=None
    )
    trainer = LocalBlockTrainer(cfg, 0, load_split(data, "train"), data_seed=0)
    reg = client.register(block=0)  # only now: the round waits for a registered worker
    tokens = local_steps * cfg.train.batch_size * cfg.model.seq_len

    def push_delta(delta: dict[str, torch.Tensor], round_: int, version: int) -> Any:
        body = update_body(
            0, delta, base_version=version, round=round_, tokens=tokens,
            worker_id=client.worker_id, dtype=reg.delta_wire, steps=local_steps,
        )  # fmt: skip
        return client.push_bytes(0, body)

    for _ in range(3):  # a round that closed while it trained: train again on the next one's
        pulled = client.pull(0)
        trainer.load(pulled.tensors)
        trainer.train(local_steps, first_step=pulled.version * local_steps)
        original = trainer.delta()
        first = push_delta(original, pulled.round, pulled.version)
        counts[f"original {'accepted' if first.accepted else first.reason}"] += 1
        if first.reason != "late":
            break
        client.round(0, after=pulled.round, wait=30)
    since = pulled.round
    pushes = []  # (rounds after the original's, variant, outcome), in order
    gen = torch.Generator().manual_seed(0)
    size = float(torch.cat([t.float().flatten() for t in original.values()]).norm())
    last, n = pulled.round, 0
    while time.monotonic() < end:
        wait = max(0.0, min(10.0, end - time.monotonic()))
        doc = client.round(0, after=last, wait=wait)
        if doc["round"] <= last or doc.get("done"):
            continue
        pulled = client.pull(0)
        last = pulled.round
        if n % 2 == 0:
            variant, copy = "one_ulp", {k: v.half().clone() for k, v in original.items()}
            copy[sorted(copy)[0]].view(-1).view(torch.int16)[0] += 1
        else:
            noise = {k: torch.randn(v.shape, generator=gen) for k, v in original.items()}
            scale = 1e-3 * size / float(torch.cat([t.flatten() for t in noise.values()]).norm())
            variant, copy = "noise_1e-3", {k: v + scale * noise[k] for k, v in original.items()}
        result = push_delta(copy, pulled.round, pulled.version)
        outcome = "accepted" if result.accepted else result.reason
        counts[f"{variant} {outcome}"] += 1
        pushes.append((pulled.round - since, variant, outcome))
        n += 1
    client.close()
    return {
        "original_update_id": first.body.get("update_id") if first.accepted else None,
        "outcomes": dict(sorted(counts.items())),
        "pushes": pushes,
    }


# ------------------------------------------------------------------------------------- router


def peer_closed(s: socket.socket) -> bool:
    """Whether the server closed `s`, read from the kernel's TCP_INFO: no byte is read."""
    try:
        # tcpi_state, the first byte of TCP_INFO: 1 is ESTABLISHED (linux/tcp_states.h)
        return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] != 1
    except OSError:
        return True


def unread_streams(
    url: str,
    sources: list[str],
    model: str,
    streams: int,
    max_tokens: int,
    seconds: float,
    rcvbuf: int,
) -> dict[str, Any]:
    """`streams` streamed completions per source address, open at all times and never read;
    `rcvbuf`: each connection's receive buffer in bytes (0: the kernel's, which on loopback
    grows to megabytes and takes a whole stream unread)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    body = json.dumps(
        {"model": model, "prompt": "The ", "max_tokens": max_tokens, "stream": True}
    ).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    counts: Counter[str] = Counter()
    held: list[socket.socket] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for s in [s for s in held if peer_closed(s)]:
            held.remove(s)
            s.close()
            counts["closed by the server"] += 1
        for source in sources:
            mine = sum(1 for s in held if s.getsockname()[0] == source)
            for _ in range(streams - mine):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    if rcvbuf:  # before connecting: the window is offered small from the start
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
                    s.settimeout(5)
                    s.bind((source, 0))
                    s.connect((host, port))
                    s.sendall(request)
                except OSError as exc:
                    s.close()
                    counts[f"open_failed {type(exc).__name__}"] += 1
                    continue
                held.append(s)
                counts["opened"] += 1
        time.sleep(0.2)
    still = len(held)
    for s in held:
        s.close()
    return {"outcomes": dict(sorted(counts.items())), "open_at_end": still}


def stop_body(model: str, size: int, many: bool) -> bytes:
    """A completion request of about `size` bytes, most of them stop strings: 1 KiB strings by
    the thousand (`many`), or four long ones."""
    stops = ["s" * 1024] * max(1, size // 1028) if many else ["s" * (size // 4 - 8)] * 4
    return json.dumps({"model": model, "prompt": "The ", "max_tokens": 8, "stop": stops}).encode()


def stop_strings(
    url: str, source: str, model: str, mb: float, seconds: float, connections: int
) -> dict[str, Any]:
    counts = Counts()
    size = int(mb * 1_000_000)
    bodies = [stop_body(model, size, True), stop_body(model, size, False)]
    end = time.monotonic() + seconds
    http_ = Http(url, source)

    def run(i: int) -> None:
        n = i
        while time.monotonic() < end:
            body = bodies[n % 2]
            n += 1
            status, _ = http_.request(
                "POST", "/v1/completions", body, {"Content-Type": "application/json"}
            )
            counts.add(str(status))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return {"body_bytes": [len(b) for b in bodies], "outcomes": counts.as_dict()}


# ------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="attack", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--seconds", type=float, default=30.0)
    common.add_argument(
        "--source",
        action="append",
        default=[],
        help="address to connect from (repeatable; default 127.0.0.2)",
    )
    a = sub.add_parser("halfopen", parents=[common])
    a.add_argument("host")
    a.add_argument("port", type=int)
    a.add_argument(
        "--target", type=int, default=1000, help="connections opening at once, per source address"
    )
    a.add_argument("--path", default="/v1/status")
    a = sub.add_parser("push-flood", parents=[common])
    a.add_argument("url")
    a.add_argument("--token-file", required=True)
    a.add_argument("--template", required=True)
    a.add_argument("--connections", type=int, default=8)
    a = sub.add_parser("stuffing", parents=[common])
    a.add_argument("url")
    a.add_argument("--token-file", action="append", required=True)
    a.add_argument("--template", required=True)
    a = sub.add_parser("near-replay", parents=[common])
    a.add_argument("url")
    a.add_argument("--token-file", required=True)
    a.add_argument("--preset", default="tiny")
    a.add_argument("--data", default=None, help="corpus (default: $BLOCKTRAIN_DATA)")
    a.add_argument("--local-steps", type=int, default=5)
    a = sub.add_parser("near-copy", parents=[common])
    a.add_argument("url")
    a.add_argument("--token-file", required=True)
    a.add_argument("--template", required=True, help="what a push names (block, tokens, steps)")
    a.add_argument("--sniff", required=True, help="a folder the honest bodies appear in")
    a = sub.add_parser("noise-probe", parents=[common])
    a.add_argument("url")
    a.add_argument("--token-file", action="append", required=True)
    a.add_argument(
        "--template", action="append", required=True, help="comma-separated, one per token"
    )
    a = sub.add_parser("unread-streams", parents=[common])
    a.add_argument("url")
    a.add_argument("--model", default="tiny")
    a.add_argument("--streams", type=int, default=8, help="per source address")
    a.add_argument("--max-tokens", type=int, default=4096)
    a.add_argument("--rcvbuf", type=int, default=0, help="receive buffer bytes (0: the kernel's)")
    a = sub.add_parser("stop-strings", parents=[common])
    a.add_argument("url")
    a.add_argument("--model", default="tiny")
    a.add_argument("--mb", type=float, default=1.0)
    a.add_argument("--connections", type=int, default=4)
    args = p.parse_args()
    sources = args.source or ["127.0.0.2"]
    t0 = time.monotonic()
    if args.attack == "halfopen":
        out = halfopen(args.host, args.port, sources, args.seconds, args.target, args.path)
    elif args.attack == "push-flood":
        token = Path(args.token_file).read_text().strip()
        out = push_flood(
            args.url, sources[0], token, Template(Path(args.template)), args.seconds,
            args.connections,
        )  # fmt: skip
    elif args.attack == "stuffing":
        tokens = [Path(f).read_text().strip() for f in args.token_file]
        out = stuffing(args.url, sources[0], tokens, Template(Path(args.template)), args.seconds)
    elif args.attack == "near-replay":
        token = Path(args.token_file).read_text().strip()
        out = near_replay(
            args.url, sources[0], token, args.preset, args.data, args.local_steps, args.seconds
        )
    elif args.attack == "near-copy":
        token = Path(args.token_file).read_text().strip()
        template = Template(Path(args.template))
        out = near_copy(args.url, sources[0], token, template, Path(args.sniff), args.seconds)
    elif args.attack == "noise-probe":
        pairs = [
            (Path(t).read_text().strip(), [Template(Path(f)) for f in group.split(",")])
            for t, group in zip(args.token_file, args.template, strict=True)
        ]
        out = noise_probe(args.url, sources[0], pairs, args.seconds)
    elif args.attack == "unread-streams":
        out = unread_streams(
            args.url, sources, args.model, args.streams, args.max_tokens, args.seconds, args.rcvbuf
        )
    else:
        out = stop_strings(
            args.url, sources[0], args.model, args.mb, args.seconds, args.connections
        )
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {
        "attack": args.attack,
        "sources": sources,
        "seconds": time.monotonic() - t0,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        **out,
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
