"""A stream's chunks merged up to a stream interval (deploy/stream_text.py, StreamInterval: vLLM's
--stream-interval): every token and every character arrives, in order, with nothing held back
at the end; each chunk sent carries a completion's first tokens, a finish, or a full interval
of some completion's tokens; an interval of 1 sends every chunk as it came."""

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from folio.deploy.stream_text import StreamInterval
from folio.worker.errors import WorkerFailedError
from folio.worker.messages import CompletionDelta, StreamChunk


@st.composite
def streams(draw):
    """A frontend's chunks for one request: 1-3 completions, each getting 0-3 tokens a step."""
    steps = draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=20), min_size=1, max_size=3))
    steps = [s if sum(s) else s + [1] for s in steps]  # every completion makes a token
    lengths = [sum(s) for s in steps]
    made = [0] * len(steps)
    chunks = []
    for step in range(max(len(s) for s in steps)):
        deltas = []
        for i, sizes in enumerate(steps):
            k = sizes[step] if step < len(sizes) else 0
            if not k:
                continue
            ids = list(range(made[i], made[i] + k))
            made[i] += k
            deltas.append(CompletionDelta(index=i, token_ids=ids, text="".join(f"<{i}:{t}>" for t in ids),
                                          num_tokens=made[i], finish_reason="length" if made[i] == lengths[i] else None))
        if deltas:
            chunks.append(StreamChunk(request_id="r", worker_id="w", deltas=deltas,
                                      finished=all(m == total for m, total in zip(made, lengths))))
    if draw(st.booleans()):  # the worker's last chunk after every completion ended here (a stop string): empty
        chunks[-1] = StreamChunk(request_id="r", worker_id="w", deltas=chunks[-1].deltas, finished=False)
        chunks.append(StreamChunk(request_id="r", worker_id="w", deltas=[], finished=True))
    return lengths, chunks


def _send(chunks, every):
    batcher = StreamInterval(every)
    return [out for out in (batcher.add(c) for c in chunks) if out is not None]


@settings(max_examples=300, deadline=None)
@given(streams(), st.integers(1, 8))
def test_every_token_arrives_in_order_and_each_chunk_sent_has_a_reason(stream, every):
    lengths, chunks = stream
    sent = _send(chunks, every)
    for i, total in enumerate(lengths):
        ids = [t for c in sent for d in c.deltas if d.index == i for t in d.token_ids]
        text = "".join(d.text for c in sent for d in c.deltas if d.index == i)
        assert ids == list(range(total))
        assert text == "".join(f"<{i}:{t}>" for t in range(total))
        last = [d for c in sent for d in c.deltas if d.index == i][-1]
        assert last.num_tokens == total and last.finish_reason == "length"
    assert sent[-1].finished and not any(c.finished for c in sent[:-1])
    started: set[int] = set()
    for c in sent:
        firsts = {d.index for d in c.deltas if d.token_ids} - started
        started |= firsts
        full = any(sum(len(d.token_ids) for d in c.deltas if d.index == i) >= every for i in range(len(lengths)))
        assert firsts or full or c.finished or any(d.finish_reason for d in c.deltas), c
    if every == 1:
        assert sent == chunks


def test_tokens_one_a_step_go_first_then_every_interval_then_the_rest():
    chunks = [StreamChunk(request_id="r", worker_id="w", finished=t == 9,
                          deltas=[CompletionDelta(index=0, token_ids=[t], text=str(t), num_tokens=t + 1,
                                                  finish_reason="length" if t == 9 else None)]) for t in range(10)]
    assert [len(c.deltas[0].token_ids) for c in _send(chunks, 4)] == [1, 4, 4, 1]
    assert [c.deltas[0].text for c in _send(chunks, 4)] == ["0", "1234", "5678", "9"]


class _OneTokenASteps:
    """A router whose worker makes one token a step, `n` in all."""

    def __init__(self, n: int, fail_after: int | None = None) -> None:
        self.n, self.fail_after = n, fail_after

    async def generate(self, req):
        for t in range(self.n):
            if t == self.fail_after:
                raise WorkerFailedError("worker w failed: killed")
            end = t == self.n - 1
            yield StreamChunk(request_id=req.request_id, worker_id="w", finished=end,
                              deltas=[CompletionDelta(index=0, token_ids=[100 + t], text="", num_tokens=t + 1,
                                                      finish_reason="length" if end else None)])


def test_the_frontend_merges_to_the_servers_interval_or_the_requests_when_it_asks_more(model_dirs):
    import asyncio

    from folio.deploy.frontend import Frontend, FrontendConfig
    from folio.worker import SamplingParams

    async def sizes(frontend, asked):
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        gen = frontend.generate([5, 6, 7], params, admission=frontend.admit(1), stream_interval=asked)
        return [len(c.deltas[0].token_ids) async for c in gen]

    for server, asked, want in [(1, None, [1] * 10), (3, None, [1, 3, 3, 3]), (3, 2, [1, 3, 3, 3]),
                                (3, 4, [1, 4, 4, 1]), (1, 4, [1, 4, 4, 1])]:
        frontend = Frontend(FrontendConfig(model=model_dirs["llama"], redis_url="redis://127.0.0.1:9/0",
                                           stream_interval=server), router=_OneTokenASteps(10))
        assert asyncio.run(sizes(frontend, asked)) == want, (server, asked)
        assert frontend.in_flight == 0


def test_tokens_held_back_go_out_before_an_error_ends_the_stream(model_dirs):
    """A worker that dies mid-stream (after tokens were streamed: WorkerFailedError): the
    tokens merged but not yet sent reach the client before the error, as with interval 1."""
    import asyncio

    from folio.deploy.frontend import Frontend, FrontendConfig
    from folio.worker import SamplingParams

    async def until_error(frontend):
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        got = []
        with pytest.raises(WorkerFailedError):
            async for c in frontend.generate([5, 6, 7], params, admission=frontend.admit(1), stream_interval=4):
                got.append(c.deltas[0].token_ids)
        return got

    for fail_after, want in [(6, [[100], [101, 102, 103, 104], [105]]), (5, [[100], [101, 102, 103, 104]]),
                             (1, [[100]])]:
        frontend = Frontend(FrontendConfig(model=model_dirs["llama"], redis_url="redis://127.0.0.1:9/0"),
                            router=_OneTokenASteps(10, fail_after))
        assert asyncio.run(until_error(frontend)) == want, fail_after
        assert frontend.in_flight == 0
