"""The client loop of `folio bench`: issue a workload's jobs on a load shape against a
target and time every request.

Targets: `http://host:port` (OpenAI-compatible /v1/completions with streaming, so
vLLM's server works too) and `grpc://host:port` (Folio's GenerateStream).
Load shapes: Poisson or gamma arrivals at a rate (gamma shape < 1 is burstier), or
everything at once; at most `max_concurrency` in flight; a request count (the
workload's) and an optional duration after which no new job starts. Always bounded:
every request has a timeout, so a run stops by itself.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field

from folio.deploy.bench.workloads import Workload


@dataclass
class Record:
    start: float  # seconds from the run's start
    ttft: float | None = None
    latency: float | None = None  # end to end
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks with tokens
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None  # "429", "503", "INVALID_ARGUMENT", "timeout", ...
    text: str = ""
    last_token_at: float | None = None

    def tokens_arrived(self, now: float) -> None:
        """A streamed chunk with tokens arrived `now` seconds after the run's start."""
        if self.ttft is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last_token_at)
        self.last_token_at = now


@dataclass
class LoadShape:
    rate: float | None = None  # requests/s; None: every job at t=0
    arrival: str = "poisson"  # "poisson" | "gamma"
    burstiness: float = 1.0  # gamma shape (1.0 = Poisson)
    max_concurrency: int | None = None
    duration_s: float | None = None  # no job starts after this
    request_timeout_s: float = 300.0

    def gaps(self, n: int, rng: random.Random) -> list[float]:
        if not self.rate:
            return [0.0] * n
        if self.arrival == "gamma":
            theta = 1.0 / (self.rate * self.burstiness)
            return [rng.gammavariate(self.burstiness, theta) for _ in range(n)]
        return [rng.expovariate(self.rate) for _ in range(n)]


class HttpTarget:
    def __init__(self, url: str, model: str | None, api_key: str | None, ignore_eos: bool,
                 endpoint: str = "completions", stream_interval: int | None = None) -> None:
        import aiohttp

        self.base = url.rstrip("/")
        self.model, self.ignore_eos = model, ignore_eos
        self.stream_interval = stream_interval  # vLLM's and Folio's: tokens per streamed chunk
        self.chat = endpoint == "chat"  # /v1/chat/completions: the prompt is one user message
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))

    async def resolve_model(self) -> None:
        if self.model is None:
            async with self.session.get(self.base + "/v1/models", headers=self.headers) as r:
                self.model = (await r.json())["data"][0]["id"]

    async def request(self, prompt: str | list[int], max_tokens: int, rec: Record, t0: float) -> None:
        body = {"model": self.model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": self.ignore_eos}
        if self.stream_interval is not None:
            body["stream_interval"] = self.stream_interval
        if self.chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        path = "/v1/chat/completions" if self.chat else "/v1/completions"
        async with self.session.post(self.base + path, json=body, headers=self.headers) as r:
            if r.status != 200:
                rec.error = str(r.status)
                await r.read()
                return
            parts = []
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    rec.error = str(data["error"].get("code") or "stream_error")
                    return
                if data.get("usage"):
                    rec.prompt_tokens = data["usage"]["prompt_tokens"]
                    rec.output_tokens = data["usage"]["completion_tokens"]
                choice = data["choices"][0] if data.get("choices") else {}
                text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
                if text:
                    rec.tokens_arrived(time.perf_counter() - t0)
                    parts.append(text)
            rec.text = "".join(parts)

    async def close(self) -> None:
        await self.session.close()


class GrpcTarget:
    def __init__(self, address: str, api_key: str | None, ignore_eos: bool, stream_interval: int | None = None) -> None:
        import grpc

        from folio.v1 import generate_pb2_grpc

        self.channel = grpc.aio.insecure_channel(address)
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.ignore_eos = ignore_eos
        self.stream_interval = stream_interval  # GenerateRequest.stream_interval (unset: the server's)
        self.model = address

    async def resolve_model(self) -> None:
        from folio.v1 import generate_pb2 as pb

        self.model = (await self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)).model

    async def request(self, prompt: str | list[int], max_tokens: int, rec: Record, t0: float) -> None:
        import grpc

        from folio.v1 import generate_pb2 as pb

        sampling = pb.SamplingParameters(max_tokens=max_tokens, temperature=0.0, ignore_eos=self.ignore_eos)
        req = (pb.GenerateRequest(text=prompt, sampling=sampling) if isinstance(prompt, str) else
               pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=sampling))
        if self.stream_interval is not None:
            req.stream_interval = self.stream_interval
        parts = []
        try:
            async for msg in self.stub.GenerateStream(req, metadata=self.metadata):
                if any(d.token_ids for d in msg.deltas):
                    rec.tokens_arrived(time.perf_counter() - t0)
                    parts += [d.text for d in msg.deltas]
                if msg.finished:
                    rec.prompt_tokens, rec.output_tokens = msg.usage.prompt_tokens, msg.usage.completion_tokens
        except grpc.aio.AioRpcError as e:
            rec.error = e.code().name
        rec.text = "".join(parts)

    async def close(self) -> None:
        await self.channel.close()


def make_target(url: str, model: str | None, api_key: str | None, ignore_eos: bool = True,
                endpoint: str = "completions", stream_interval: int | None = None):
    if url.startswith("grpc://"):
        if endpoint != "completions":
            raise ValueError("--endpoint chat needs an http:// target (gRPC has no chat API)")
        return GrpcTarget(url.removeprefix("grpc://"), api_key, ignore_eos, stream_interval)
    if url.startswith(("http://", "https://")):
        return HttpTarget(url, model, api_key, ignore_eos, endpoint, stream_interval)
    raise ValueError(f"a target is grpc://host:port or http://host:port, got {url!r}")


async def run_load(target, workload: Workload, shape: LoadShape, seed: int = 0,
                   progress: bool = True) -> tuple[list[Record], float]:
    """Run every job (or those started within the duration); returns the records and the wall time."""
    rng = random.Random(seed)
    records: list[Record] = []
    t0 = time.perf_counter()
    limit = asyncio.Semaphore(shape.max_concurrency) if shape.max_concurrency else None

    async def one(prompt: str | list[int], max_tokens: int) -> Record:
        rec = Record(start=time.perf_counter() - t0)
        records.append(rec)
        try:
            await asyncio.wait_for(target.request(prompt, max_tokens, rec, t0), shape.request_timeout_s)
        except asyncio.TimeoutError:
            rec.error = "timeout"
        except Exception as e:  # a connection refused or reset: counted, never raised
            rec.error = type(e).__name__
        if rec.error is None:
            rec.latency = time.perf_counter() - t0 - rec.start
        return rec

    async def job(j) -> None:
        history = ""
        for turn in j.turns:  # a session's turns run in order, each with the conversation so far
            prompt = (history + "\n" + turn.text).strip() if history else turn.text
            if limit:
                async with limit:
                    rec = await one(prompt, turn.max_tokens)
            else:
                rec = await one(prompt, turn.max_tokens)
            if rec.error:
                return
            if isinstance(prompt, str):  # token-id prompts are one-turn jobs
                history = prompt + rec.text

    tasks = []
    reporter = asyncio.create_task(_progress(records, workload.num_requests, t0)) if progress else None
    due = 0.0
    for j, gap in zip(workload.jobs, shape.gaps(len(workload.jobs), rng)):
        if not j.at_once:
            due += gap
            wait = due - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
        if shape.duration_s is not None and time.perf_counter() - t0 > shape.duration_s:
            break
        tasks.append(asyncio.create_task(job(j)))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    if reporter:
        reporter.cancel()
        sys.stderr.write("\n")
    return records, wall


async def _progress(records: list[Record], total: int, t0: float) -> None:
    while True:
        await asyncio.sleep(0.5)
        done = [r for r in records if r.latency is not None or r.error]
        errors = sum(1 for r in done if r.error)
        tokens = sum(r.output_tokens for r in done)
        elapsed = time.perf_counter() - t0
        bar = "#" * int(30 * len(done) / max(total, 1))
        sys.stderr.write(f"\r[{bar:<30}] {len(done)}/{total} requests, {tokens / elapsed:7.1f} output tok/s, "
                         f"{errors} errors, {elapsed:5.1f} s")
        sys.stderr.flush()
