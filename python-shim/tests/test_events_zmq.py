"""The event stream over loopback ZeroMQ, read by a subscriber that follows
vLLM's example subscriber (SUB on [topic, seq, payload], gaps detected by
sequence number and repaired through the replay ROUTER), rebuilds the
cache's set; and an engine that publishes drained batches itself."""

from __future__ import annotations

import time

import pytest

import marconi
from test_events import STRICT, Consumer, _need, check_against_cache, small_cache, workload

zmq = _need("zmq")

END_SEQ = (2**64 - 1).to_bytes(8, "big")


def publisher_available():
    if not marconi.has_publisher():
        if STRICT:
            pytest.fail("MARCONI_EVENTS_STRICT=1 but libmarconi has no publisher")
        pytest.skip("libmarconi built without the `publisher` feature")


class Subscriber:
    def __init__(self, ctx, endpoint: str, replay: str, topic: bytes):
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay = ctx.socket(zmq.DEALER)
        self.replay.connect(replay)
        self.topic = topic
        self.next = 0
        self.gaps = 0
        self.consumer = Consumer(array_like=False)

    def apply(self, seq: int, payload: bytes) -> None:
        if seq < self.next:
            return
        assert seq == self.next
        self.consumer.apply(payload)
        self.next = seq + 1

    def repair(self) -> None:
        self.gaps += 1
        self.replay.send_multipart([b"", self.next.to_bytes(8, "big")])
        while True:
            assert self.replay.poll(5000), "replay answers"
            _, topic, seq, payload = self.replay.recv_multipart()
            if not payload:
                # vLLM 0.33's end marker: an empty topic frame.
                assert seq == END_SEQ and topic == b""
                return
            assert topic == self.topic
            seq = int.from_bytes(seq, "big")
            assert seq <= self.next, "still in the replay buffer"
            self.apply(seq, payload)

    def run_until(self, last: int, lose_every: int) -> None:
        deadline = time.monotonic() + 30
        while self.next <= last:
            assert time.monotonic() < deadline, f"stalled at {self.next}"
            if not self.sub.poll(200):
                self.repair()
                continue
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic
            seq = int.from_bytes(seq, "big")
            if lose_every and seq % lose_every == 3:
                continue  # simulated loss
            if seq > self.next:
                self.repair()
            self.apply(seq, payload)


def test_library_publisher_with_gaps_repaired_by_replay():
    publisher_available()
    cache = small_cache(4)
    ev = marconi.CacheEvents(
        cache, endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv@engine-0"
    )
    ctx = zmq.Context()
    sub = Subscriber(ctx, ev.endpoint, ev.replay_endpoint, b"kv@engine-0")
    last = None
    # Published before the SUB connection is up: the first batches come back
    # by replay; every 10th is dropped on purpose.
    for i, (ns, c, out) in enumerate(workload(11, 250)):
        cache.serve(c, out, namespace=ns)
        seq = ev.publish(ts=float(i))
        last = seq if seq is not None else last
    assert ev.publish() is None  # nothing changed
    sub.run_until(last, lose_every=10)
    check_against_cache(cache, ev, sub.consumer)
    assert sub.gaps > 0 and cache.stats()["evictions"] > 50
    ev.close()
    cache.close()
    ctx.destroy(linger=0)


def test_engine_publishes_drained_batches_itself():
    cache = small_cache(4)
    ev = marconi.CacheEvents(cache)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{port}")
    # Wait for the subscription to reach the PUB (slow joiner).
    deadline = time.monotonic() + 10
    while True:
        pub.send_multipart([b"kv-probe", (2**64 - 2).to_bytes(8, "big"), b""])
        if sub.poll(50):
            sub.recv_multipart()
            break
        assert time.monotonic() < deadline
    while sub.poll(50):
        sub.recv_multipart()
    consumer = Consumer(array_like=False)
    seq = 0
    for i, (ns, c, out) in enumerate(workload(5, 150)):
        cache.serve(c, out, namespace=ns)
        payload = ev.drain(ts=float(i))
        if payload:
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
            seq += 1
    got = 0
    while got < seq:
        assert sub.poll(5000)
        topic, s, payload = sub.recv_multipart()
        if topic != b"kv":
            continue
        assert int.from_bytes(s, "big") == got
        consumer.apply(payload)
        got += 1
    check_against_cache(cache, ev, consumer)
    ev.close()
    cache.close()
    ctx.destroy(linger=0)
