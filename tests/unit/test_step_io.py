"""The step thread's socket I/O (worker/step_io.py) over real socket pairs: frames that come
in any fragments are applied whole and in order; a reader that is behind gets every item in
order, merged, never a growing buffer; a put from another thread goes out at once and keeps
each request's order; a malformed or oversized frame, or EOF, ends the connection once."""

import pickle
import socket
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from folio.worker.messages import CompletionDelta, StreamChunk
from folio.worker.outbox import Outbox
from folio.worker.step_io import FRAME_HEAD, StepIO, frame_bytes


def _pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    return a, b


def _io():
    applied, dropped = [], []
    io = StepIO(lambda c, seq, batch: applied.append((seq, batch)), dropped.append, max_frame=1 << 20)
    return io, applied, dropped


def _frames(sock, timeout=5.0) -> list:
    """Every frame the other end sent until it has been quiet for 0.2 s."""
    sock.settimeout(0.2)
    buf, out, end = bytearray(), [], time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            data = sock.recv(1 << 16)
        except socket.timeout:
            break
        if not data:
            break
        buf += data
    while len(buf) >= FRAME_HEAD:
        n = int.from_bytes(buf[:FRAME_HEAD], "big")
        out.append(pickle.loads(buf[FRAME_HEAD:FRAME_HEAD + n]))
        del buf[:FRAME_HEAD + n]
    assert not buf
    return out


def _chunk(rid, toks, finished=False):
    return StreamChunk(request_id=rid, worker_id="w", finished=finished,
                       deltas=[CompletionDelta(index=0, token_ids=list(toks), text="", num_tokens=0)])


@settings(max_examples=60, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 1000), max_size=5), min_size=1, max_size=12),
       cuts=st.lists(st.integers(1, 64), min_size=1, max_size=40))
def test_frames_in_any_fragments_are_applied_whole_and_in_order(batches, cuts):
    io, applied, dropped = _io()
    a, b = _pair()
    io.adopt(a, b"", Outbox("s"))
    data = b"".join(frame_bytes((i, batch)) for i, batch in enumerate(batches))
    pos, k = 0, 0
    while pos < len(data):
        n = cuts[k % len(cuts)]
        b.sendall(data[pos:pos + n])
        pos, k = pos + n, k + 1
        io.poll(0, lambda: False)
    for _ in range(3):
        io.poll(0.01, lambda: False)
    assert applied == list(enumerate(batches)) and not dropped
    b.close()
    io.poll(0.5, lambda: False)
    assert len(dropped) == 1 and not io.conns
    io.close()


@settings(max_examples=20, deadline=None)
@given(bad=st.one_of(st.binary(min_size=1, max_size=200).filter(lambda d: not d.startswith(b"\x80")),
                     st.just(b"not a tuple"), st.just(pickle.dumps([1, 2, 3]))))
def test_a_malformed_frame_ends_the_connection_once(bad):
    io, applied, dropped = _io()
    a, b = _pair()
    io.adopt(a, b"", Outbox("s"))
    b.sendall(frame_bytes((1, [])) + len(bad).to_bytes(FRAME_HEAD, "big") + bad)
    for _ in range(5):
        io.poll(0.01, lambda: False)
    assert applied == [(1, [])] and len(dropped) == 1 and not io.conns
    assert b.recv(10) == b"", "the worker's end was not closed"
    io.close()
    assert len(dropped) == 1


def test_an_oversized_frame_ends_the_connection_before_it_is_read():
    io, applied, dropped = _io()
    a, b = _pair()
    io.adopt(a, b"", Outbox("s"))
    b.sendall((io.max_frame + 1).to_bytes(FRAME_HEAD, "big") + b"x" * 100)
    io.poll(0.05, lambda: False)
    assert not applied and len(dropped) == 1
    io.close()


def test_a_reader_behind_gets_every_item_in_order_merged_and_the_buffer_stays_bounded():
    io, _, dropped = _io()
    a, b = _pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    box = Outbox("s")
    io.adopt(a, b"", box)
    io.poll(0, lambda: False)
    sent = {f"r{i}": [] for i in range(8)}
    for step in range(3000):  # nobody reads b meanwhile
        for rid, toks in sent.items():
            toks.append(step)
            box.put(rid, _chunk(rid, [step], finished=step == 2999))
        io.flush()
        io.poll(0, lambda: False)
    conn = io.conns[0]
    assert len(conn.wbuf) < 1 << 16, "the unsent bytes grew with the steps"
    assert sum(len(v) for v in box.pending.values()) <= 8, "the box kept chunks unmerged"
    got = {rid: [] for rid in sent}
    done = threading.Event()

    def pump():
        while not done.is_set():
            io.poll(0.01, lambda: False)
    t = threading.Thread(target=pump)
    t.start()
    try:
        frames = _frames(b)
    finally:
        done.set()
        t.join()
    for kind, items in frames:
        assert kind == "c"
        for rid, ch in items:
            got[rid] += ch.deltas[0].token_ids
    assert got == sent and not dropped
    io.close()


def test_a_put_from_another_thread_goes_out_at_once_in_each_requests_order():
    io, _, _ = _io()
    a, b = _pair()
    box = Outbox("s")
    io.adopt(a, b"", box)
    io.poll(0, lambda: False)  # the step thread (this one) owns it now
    box.put("mine", _chunk("mine", [1]))  # the owner's put waits for its flush
    order = []
    t = threading.Thread(target=lambda: (box.put("other", _chunk("other", [7])), order.append("put")))
    t.start()
    t.join()
    frames = _frames(b, timeout=1.0)  # nobody polled: the other thread sent it itself
    assert order == ["put"] and [(rid, ch.deltas[0].token_ids) for _, items in frames for rid, ch in items] == \
        [("mine", [1]), ("other", [7])]
    io.close()


def test_kick_wakes_a_sleeping_poll_at_once():
    io, _, _ = _io()
    t0 = time.monotonic()
    threading.Timer(0.05, io.kick).start()
    io.poll(5.0, lambda: False)
    assert time.monotonic() - t0 < 2.0
    io.close()


def test_out_of_descriptors_the_listener_waits_instead_of_spinning():
    """accept() failing with EMFILE leaves the listener readable: the data server stops
    watching it for a moment (a level-triggered reader would spin the event loop) and then
    watches it again."""
    import asyncio
    import errno

    from folio.worker.data_plane import DataServer

    class Full:
        def __init__(self, real):
            self.real = real

        def accept(self):
            raise OSError(errno.EMFILE, "Too many open files")

        def fileno(self):
            return self.real.fileno()

    async def main():
        ds = DataServer(lambda sub: None, lambda *a: None)
        await ds.address()
        loop, fd = asyncio.get_running_loop(), ds._listener.fileno()
        ds._accept(Full(ds._listener))
        assert not loop.remove_reader(fd), "still watched: the loop would spin on it"
        await asyncio.sleep(0.3)
        assert loop.remove_reader(fd), "never watched again"
        ds.close()

    asyncio.run(main())


def test_commands_are_applied_while_the_reader_is_behind_until_too_much_is_owed(monkeypatch):
    """An abort must not wait behind the chunks of the requests it stops: a frontend whose
    reads lag (bytes owed in `wbuf`) still has its batches applied, and only a frontend that
    sends and never reads (more than MAX_UNSENT owed) is no longer read."""
    from folio.worker import step_io

    io, applied, _ = _io()
    io.apply = lambda c, seq, batch: (applied.append(seq), c.push(("r", seq, [None] * 64)))
    a, b = _pair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    box = Outbox("s")
    io.adopt(a, b"", box)
    io.poll(0, lambda: False)
    conn = io.conns[0]
    for step in range(200):  # nobody reads b: bytes are owed
        box.put(f"r{step}", _chunk(f"r{step}", list(range(50))))
        io.flush()
    assert conn.wbuf, "the socket never filled"
    monkeypatch.setattr(step_io, "MAX_UNSENT", len(conn.wbuf) + 2000)
    seq = 0
    while len(conn.wbuf) <= step_io.MAX_UNSENT:
        seq += 1
        b.sendall(frame_bytes((seq, [("abort", f"r{seq}")])))
        io.poll(0.05, lambda: False)
        assert applied[-1] == seq, "a batch waited behind the chunks owed"
    b.sendall(frame_bytes((seq + 1, [("abort", "late")])))
    io.poll(0.05, lambda: False)
    io.poll(0.05, lambda: False)
    assert applied[-1] == seq, "read on past MAX_UNSENT: the unsent bytes could grow without bound"
    io.close()
