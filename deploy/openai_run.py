"""The run of one admitted OpenAI API request: its prompts' streams on the workers, merged into
one sequence of (choice index, CompletionDelta), with the request's token usage.

Choice i is completion i % n of prompt i // n. Admitted whole by the caller (an Admission holding
a slot per prompt, openai_http.py) and released whole when `events()` ends, however it ends; an
error in any stream, or a client gone (the events closed early), aborts all of the request's streams.
A run made inside `aborts_listed_in(hooks)` puts its `abort_soon` in `hooks` until its events
end: the HTTP server calls it when the client's connection is lost, ahead of the events' close
(http_deadlines.py). (uvicorn keeps a connection's last request, and so its hooks, until the next.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from contextvars import ContextVar
from typing import AsyncIterator

from folio.deploy.frontend import Admission, Frontend
from folio.deploy.openai_logprobs import logprobs_completion, prompt_entries
from folio.deploy.text_offsets import TextOffsets
from folio.worker.detokenizer import PROMPT_CONTEXT
from folio.worker.sampling_params import SamplingParams

CLIENT_LOST: ContextVar[list | None] = ContextVar("folio_client_lost", default=None)


@contextlib.contextmanager
def aborts_listed_in(hooks: list):
    """Runs made in this context (tasks made in it too) append their `abort_soon` to `hooks`."""
    token = CLIENT_LOST.set(hooks)
    try:
        yield
    finally:
        CLIENT_LOST.reset(token)


class Run:
    """The streams of one API request: one per prompt, each with n completions; admitted whole
    (`admission` holds a slot per prompt) and released whole when `events` ends, however it ends."""

    def __init__(self, frontend: Frontend, prompts: list[list[int]], params: SamplingParams, priority: int,
                 admission: Admission) -> None:
        self.frontend, self.prompts, self.params, self.priority = frontend, prompts, params, priority
        self.admission = admission
        self.stream_interval: int | None = None  # the request's own (streamed requests only)
        self.id = uuid.uuid4().hex
        n_prompt = sum(len(p) for p in prompts)
        self.usage = {"prompt_tokens": n_prompt, "completion_tokens": 0, "total_tokens": n_prompt}
        self.echo: list[str] | None = None  # completions' echo: each prompt's text, put before its choices
        self.echo_only = False  # echo with max_tokens 0: the token made for the prompt's logprobs is not shown
        self.prompt_logprobs: dict[int, list] = {}  # echo + logprobs: per prompt, from its first chunk
        self._echo_logprobs: dict[int, asyncio.Future] = {}  # per prompt: its echo's logprobs, formatted
        self._offsets: dict[int, TextOffsets] = {}  # per choice: its text_offset, delta by delta
        self._hooks = CLIENT_LOST.get()  # kept by the connection's request: left when the events end
        if self._hooks is not None:
            self._hooks.append(self.abort_soon)

    def abort_soon(self) -> None:
        """Its client is gone: abort each prompt's request on its worker now, without waiting
        for the events to be closed (they are still closed, as before)."""
        for i in range(len(self.prompts)):
            self.frontend.router.abort_soon(f"{self.id}-{i}")

    def text_offsets(self, choice: int) -> TextOffsets:
        """The choice's TextOffsets: its generated text decodes after its prompt's tail, as the
        frontend's text stream is primed; one per choice, kept across a stream's deltas."""
        if choice not in self._offsets:
            prompt = self.prompts[choice // self.params.n]
            self._offsets[choice] = TextOffsets(prompt[-PROMPT_CONTEXT:], self.params.skip_special_tokens)
        return self._offsets[choice]

    def prompt_entries(self, choice: int) -> list[dict]:
        """Completions' logprobs entries of the echoed prompt of `choice` ([] without echo + logprobs)."""
        if not self.echo or self.params.prompt_logprobs is None:
            return []
        i = choice // self.params.n
        return prompt_entries(self.prompts[i], self.prompt_logprobs.get(i))

    async def echo_logprobs(self, choice: int, k: int, as_ids: bool) -> dict | None:
        """The echoed prompt's logprobs of `choice` in completions' shape (None without echo +
        logprobs): formatted once per prompt, on the tokenizer threads, for all its n choices. A
        7,700-token prompt with logprobs=20 and n=32, formatted per choice on the event loop,
        held the replica's /health 17 s."""
        entries = self.prompt_entries(choice)
        if not entries:
            return None
        p = choice // self.params.n
        if p not in self._echo_logprobs:
            self._echo_logprobs[p] = asyncio.ensure_future(self.frontend.prompts.run(
                logprobs_completion, self.frontend.tokenizer, entries, k, [(0, len(self.echo[p]), len(entries))],
                as_ids))
        return await asyncio.shield(self._echo_logprobs[p])

    async def events(self) -> AsyncIterator[tuple[int, object]]:
        """(choice index, CompletionDelta) as they come, across all prompts."""
        n = self.params.n
        queue: asyncio.Queue = asyncio.Queue()
        gens = [self.frontend.generate(p, self.params, self.priority, f"{self.id}-{i}", self.admission,
                                       self.stream_interval) for i, p in enumerate(self.prompts)]

        async def pump(i, gen):
            try:
                async for chunk in gen:
                    if chunk.prompt_logprobs is not None:
                        self.prompt_logprobs[i] = chunk.prompt_logprobs
                    for d in chunk.deltas:
                        await queue.put((i * n + d.index, d))
            except asyncio.CancelledError:
                raise
            except BaseException as e:
                await queue.put(e)
            finally:
                queue.put_nowait(None)
        tasks: list[asyncio.Task] = []
        try:
            # the first prompt's admission error surfaces before anything is sent
            try:
                head = await gens[0].__anext__()
            except StopAsyncIteration:
                head = None
            tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens) if i > 0]
            if head is not None:
                if head.prompt_logprobs is not None:
                    self.prompt_logprobs[0] = head.prompt_logprobs
                for d in head.deltas:
                    yield d.index, self._shown(d)
                tasks.append(asyncio.create_task(pump(0, gens[0])))
            open_ = len(tasks)
            while open_:
                item = await queue.get()
                if item is None:
                    open_ -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item[0], self._shown(item[1])
        finally:  # stop every stream (a client gone, or an error, aborts all its requests)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                for g in gens:
                    await g.aclose()
            finally:
                self.admission.release()
                if self._hooks is not None:  # the connection keeps its last request: not this run
                    with contextlib.suppress(ValueError):
                        self._hooks.remove(self.abort_soon)

    def _shown(self, d):
        """The delta as the client gets it: with echo_only, no tokens, no text (its end "length", as vLLM's)."""
        if not self.echo_only:
            return d
        reason = "length" if d.finish_reason in ("stop", "length") else d.finish_reason  # (an abort stays one)
        return dataclasses.replace(d, token_ids=[], text="", num_tokens=0, logprobs=None, finish_reason=reason,
                                   stop_reason=None)

    def count(self, d) -> None:
        self.usage["completion_tokens"] += len(d.token_ids)
        self.usage["total_tokens"] = self.usage["prompt_tokens"] + self.usage["completion_tokens"]
