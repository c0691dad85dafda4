"""An OpenAI request's Run and the connection it came on (deploy/openai_run.py): a run made
inside `aborts_listed_in(hooks)` lists its `abort_soon` there (the HTTP server calls it when the
client's connection is lost: each prompt's request aborted on its worker), and leaves the list
when its events end, however they end, so that a keep-alive connection does not keep its
last request's run (its prompts, texts and offsets) while it idles."""

import asyncio

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from folio.worker.errors import WorkerFailedError
from folio.worker.messages import CompletionDelta, StreamChunk


class _Router:
    """Each request makes `n` tokens, one a step (a worker failure after `fail_after`); records
    the ids given to abort_soon."""

    def __init__(self, n: int, fail_after: int | None) -> None:
        self.n, self.fail_after, self.aborted = n, fail_after, []

    async def generate(self, req):
        for t in range(self.n):
            if t == self.fail_after:
                raise WorkerFailedError("worker w failed: killed")
            await asyncio.sleep(0)
            end = t == self.n - 1
            yield StreamChunk(request_id=req.request_id, worker_id="w", finished=end,
                              deltas=[CompletionDelta(index=0, token_ids=[100 + t], text="", num_tokens=t + 1,
                                                      finish_reason="length" if end else None)])

    def abort_soon(self, request_id: str) -> None:
        self.aborted.append(request_id)


@pytest.fixture(scope="module")
def frontend(model_dirs):
    from folio.deploy.frontend import Frontend, FrontendConfig

    return Frontend(FrontendConfig(model=model_dirs["llama"], redis_url="redis://127.0.0.1:9/0"),
                    router=_Router(1, None))


@settings(max_examples=60, deadline=None)
@given(prompts=st.integers(1, 3), tokens=st.integers(1, 5), fail_after=st.one_of(st.none(), st.integers(0, 4)),
       read=st.one_of(st.none(), st.integers(0, 6)), lost=st.booleans())
def test_a_run_lists_its_abort_while_its_events_run_and_leaves_when_they_end(frontend, prompts, tokens, fail_after,
                                                                              read, lost):
    from folio.deploy import openai_run
    from folio.worker import SamplingParams

    router = frontend.router = _Router(tokens, fail_after)
    hooks: list = []
    other = object()  # the scope's list may hold others' hooks: they stay

    async def serve():
        with openai_run.aborts_listed_in(hooks):
            run = openai_run.Run(frontend, [[5 + i, 6] for i in range(prompts)],
                                 SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), 0,
                                 frontend.admit(prompts))
        hooks.append(other)
        assert hooks == [run.abort_soon, other]
        if lost:  # the connection lost first: every prompt's request aborted, once each
            for hook in hooks[:1]:
                hook()
            assert router.aborted == [f"{run.id}-{i}" for i in range(prompts)]
        events = run.events()
        got = 0
        try:
            async for _ in events:
                got += 1
                if read is not None and got >= read:
                    break
        except WorkerFailedError:
            pass
        finally:
            await events.aclose()
        return run

    asyncio.run(serve())
    assert hooks == [other]
    assert frontend.in_flight == 0
