"""The end of a frontend replica's drain (deploy/replica_drain.py): `Frontend.cut` ends every
request still streaming through the frontend with ShuttingDownError. Real pieces from the
OpenAI handlers down: the frontend, its router, RayWorkerClient's channel over the worker's
real TCP data plane, and a real engine on the tiny model (the worker in this process: its Ray
calls go to it directly). Each client gets a 503 it can act on (`server_shutting_down`): a
stream as its last event before `data: [DONE]`, after every token made before the cut; a
request not streamed as its answer. Each request is aborted on its worker (no token made
after, every KV block free), and none is tried again elsewhere through the replica that goes.
A request that comes after the cut is refused with the same 503 before any answer starts.
Before, the cut closed the connections: a stream ended inside its body (the `openai` client
raised "Connection error."), a request not streamed got the server's bare 503."""

import asyncio
import json

import pytest

from folio.cluster.router import Router
from folio.cluster.state import ClusterState
from folio.cluster.worker_client import RayWorkerClient
from folio.deploy import openai_http as oai
from folio.deploy.frontend import Frontend, FrontendConfig
from folio.deploy.openai_errors import http_error
from folio.worker.errors import ShuttingDownError

from conftest import step_delay, until
from test_worker_actor import _shutdown_workers, make_worker, model  # noqa: F401 (fixtures)

NO_REDIS = "redis://127.0.0.1:9/0"  # never reached: the router below picks its one worker itself


class InProcess(RayWorkerClient):
    """RayWorkerClient (its channels, over the worker's real data plane) with its Ray calls made
    on the in-process workers."""

    def __init__(self, workers: dict) -> None:
        super().__init__("t")
        self.workers = workers

    async def call(self, wid: str, method: str, *args):
        return await getattr(self.workers[wid], method)(*args)


class OneWorker(Router):
    picked = 0

    async def pick(self, req, exclude=frozenset()):
        OneWorker.picked += 1
        return "w0"


def events(body: bytes) -> list:
    return [e[6:] for e in body.decode().split("\n\n") if e.startswith("data: ")]


def test_a_cut_ends_every_request_with_a_503_and_aborts_it_on_its_worker(model):  # noqa: F811
    w = make_worker(model, "w0")
    step_delay(w, 0.02)  # 200 tokens outlast the test's steps on any CPU
    client = InProcess({"w0": w})
    frontend = Frontend(FrontendConfig(model=model, redis_url=NO_REDIS, max_model_len=256),
                        router=OneWorker(ClusterState(NO_REDIS, "t"), client))
    long = {"model": frontend.cfg.model_name, "max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def main():
        completion = await oai.completions(frontend, {**long, "prompt": "one two three", "stream": True})
        chat = await oai.chat_completions(frontend, {**long, "messages": [{"role": "user", "content": "hi"}],
                                                     "stream": True, "stream_interval": 4})
        whole = asyncio.ensure_future(oai.completions(frontend, {**long, "prompt": "four five"}))
        got = {"completion": [await completion.__anext__()], "chat": [await chat.__anext__()]}
        await until(_running(w, 3), "all three running on the worker", 60)
        OneWorker.picked = 0
        frontend.cut(ShuttingDownError("the replica stopped"))
        for name, stream in (("completion", completion), ("chat", chat)):
            got[name] += [e async for e in stream]
        with pytest.raises(ShuttingDownError) as e:
            await whole
        answer = http_error(e.value)
        assert answer.status == 503 and answer.body()["error"]["code"] == "server_shutting_down"
        for name, chunks in got.items():
            data = events(b"".join(chunks))
            assert data[-1] == "[DONE]", (name, data[-3:])
            error = json.loads(data[-2])["error"]
            assert error["code"] == "server_shutting_down" and "the replica stopped" in error["message"], error
            assert len(data) >= 3 and all("choices" in json.loads(d) for d in data[:-2]), (name, data[:3])
        await until(_idle(w), "every request aborted on the worker and its blocks free", 60)
        made = await w._call(lambda e: e.num_generated_tokens)
        await asyncio.sleep(0.3)
        assert await w._call(lambda e: e.num_generated_tokens) == made, "a request ran on after the cut"
        assert made < 3 * 200 / 2, "the requests ran on long after the cut"
        assert frontend.in_flight == 0 and OneWorker.picked == 0  # none tried again elsewhere
        # a request after the cut (pipelined behind a stream, or its body in after the cut) is refused as
        # it comes, a 503 before any byte of an answer: it was streamed, then cut mid-body 0.5 s later
        for body in ({**long, "prompt": "later", "stream": True}, {**long, "prompt": "later"}):
            with pytest.raises(ShuttingDownError) as e:
                await oai.completions(frontend, body)
            assert http_error(e.value).status == 503 and e.value is not frontend.cut_with  # each its own
        with pytest.raises(ShuttingDownError):  # refused at admission, before it is routed at all
            frontend.admit(1)
        from folio.worker.messages import GenerateRequest
        from folio.worker.sampling_params import SamplingParams
        with pytest.raises(ShuttingDownError):  # a stream opened after (a move's attach): refused too
            async for _ in client.generate("w0", GenerateRequest(request_id="after", prompt_token_ids=[5, 6],
                                                                 params=SamplingParams(max_tokens=5))):
                pass
        assert frontend.in_flight == 0 and (await w.stats())["num_running"] == 0
        await w.check_invariants()

    asyncio.run(main())


def _running(w, n: int):
    async def running():
        st = await w.stats()
        return st if st["num_running"] == n else None
    return running


def _idle(w):
    async def idle():
        st = await w.stats()
        return st if (st["num_running"] == 0 and st["num_streams"] == 0
                      and st["num_free_blocks"] == st["num_kv_blocks"]) else None
    return idle
