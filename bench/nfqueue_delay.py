"""Delay every packet of an NFQUEUE by a fixed time: a stand-in for `tc qdisc ... netem delay`
on kernels built without sch_netem (bench/netns.py falls back to it). Run it inside the network
namespace whose iptables rules send packets to the queue:

    ip netns exec NS python nfqueue_delay.py --queue 7 --delay-ms 20 [--jitter-ms 10]

It speaks the nfnetlink_queue protocol over a raw netlink socket (no library needed): it binds
the queue in metadata-only copy mode, and answers each packet's verdict (accept) `delay` after
it arrived, in arrival order. With a jitter each packet's delay is drawn uniformly from
delay +- jitter, but no packet overtakes an earlier one (it waits for it instead): jitter
without reordering, which TCP would otherwise read as loss. Within a burst the delays therefore
climb toward delay + jitter (never past it); sparse packets see the whole range. Standard library only, so it starts
fast and imports no torch.
"""

from __future__ import annotations

import argparse
import collections
import random
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_VERDICT, NFQNL_MSG_CONFIG = 0, 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN = 1, 2, 3
NFQA_CFG_MASK, NFQA_CFG_FLAGS = 4, 5
NFQA_CFG_F_FAIL_OPEN = 1
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
NF_ACCEPT = 1


def attr(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def message(kind: int, flags: int, seq: int, queue: int, attrs: bytes) -> bytes:
    body = struct.pack("!BBH", socket.AF_UNSPEC, 0, queue) + attrs  # nfgenmsg, res_id BE
    return (
        struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | kind, flags, seq, 0) + body
    )


def check_ack(sock: socket.socket) -> None:
    data = sock.recv(65536)
    _length, kind = struct.unpack_from("=IH", data)
    if kind == NLMSG_ERROR:
        (err,) = struct.unpack_from("=i", data, 16)
        if err != 0:
            raise OSError(-err, f"nfqueue config refused: {err}")


def packet_ids(data: bytes) -> list[int]:
    ids = []
    offset = 0
    while offset + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, offset)
        if length < 16:
            break
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            pos = offset + 20  # nlmsghdr (16) + nfgenmsg (4)
            end = offset + length
            while pos + 4 <= end:
                alen, atype = struct.unpack_from("=HH", data, pos)
                if alen < 4:
                    break
                if (atype & 0x7FFF) == NFQA_PACKET_HDR:
                    ids.append(struct.unpack_from("!I", data, pos + 4)[0])
                pos += (alen + 3) & ~3
        offset += (length + 3) & ~3
    return ids


def release_at(
    now: float, delay: float, jitter: float, previous: float, rng: random.Random
) -> float:
    """When a packet that arrived `now` is let through: delay +- jitter later, but not before
    the packet ahead of it (released at `previous`): no overtaking."""
    at = now + delay + (rng.uniform(-jitter, jitter) if jitter else 0.0)
    return max(at, previous)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--queue", type=int, required=True)
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uniform, +- around the delay")
    p.add_argument("--seed", type=int, default=0, help="seeds the jitter")
    args = p.parse_args()
    if not 0 <= args.jitter_ms <= args.delay_ms:
        p.error("--jitter-ms must be between 0 and --delay-ms")
    delay, jitter = args.delay_ms / 1000.0, args.jitter_ms / 1000.0
    rng = random.Random(args.seed)
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind((0, 0))
    seq = 1
    for attrs in (
        attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0)),
        attr(NFQA_CFG_PARAMS, struct.pack("!IB", 0, NFQNL_COPY_META)),
        attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536)),
        attr(NFQA_CFG_FLAGS, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN))
        + attr(NFQA_CFG_MASK, struct.pack("!I", NFQA_CFG_F_FAIL_OPEN)),
    ):
        sock.send(message(NFQNL_MSG_CONFIG, NLM_F_REQUEST | NLM_F_ACK, seq, args.queue, attrs))
        check_ack(sock)
        seq += 1
    print("ready", flush=True)
    running = True

    def finish(*_: object) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, finish)
    signal.signal(signal.SIGINT, finish)
    due: collections.deque[tuple[float, int]] = collections.deque()
    while running:
        timeout = max(0.0, due[0][0] - time.monotonic()) if due else 0.5
        try:
            ready, _, _ = select.select([sock], [], [], timeout)
        except InterruptedError:
            continue
        if ready:
            try:
                data = sock.recv(1 << 20)
            except OSError:  # ENOBUFS: the kernel dropped messages; keep going
                continue
            now = time.monotonic()
            for pid in packet_ids(data):
                due.append((release_at(now, delay, jitter, due[-1][0] if due else 0.0, rng), pid))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, pid = due.popleft()
            verdict = attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, pid))
            sock.send(message(NFQNL_MSG_VERDICT, NLM_F_REQUEST, seq, args.queue, verdict))
            seq += 1
    for _, pid in due:  # let the rest through before unbinding
        sock.send(
            message(
                NFQNL_MSG_VERDICT,
                NLM_F_REQUEST,
                seq,
                args.queue,
                attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, pid)),
            )
        )
    sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
