"""The response to an admitted completions or chat completions request: one JSON body
({"id", "object", "created", "model", "choices", "usage"}), or with `stream` an async iterator
of server-sent events (openai_sse.py).

`respond()` waits for the run's first event before answering, so that admission and validation
errors surface as a status code; after it, a stream reports errors in the stream. Chat choices
carry the tool calls that the request's tool plan finds in their text (finish_reason "tool_calls"
where it was "stop"), their role is vLLM's (the final message's without a generation prompt), and
under `echo` their content starts with a continued final message's text; completion choices start
with their prompt's text under `echo`.
"""

from __future__ import annotations

import time
import uuid

from folio.deploy.frontend import Frontend
from folio.deploy.openai_logprobs import Choice, joined, logprobs_chat, logprobs_completion
from folio.deploy.openai_run import Run
from folio.deploy.openai_sse import sse


async def respond(frontend: Frontend, req, run: Run, chat: bool, model: str):
    created = int(time.time())
    obj = "chat.completion" if chat else "text_completion"
    # not the run's own id: its requests on the workers are "<run.id>-<i>", and a response id
    # made of it let any client that saw one abort that request over gRPC
    rid = ("chatcmpl-" if chat else "cmpl-") + (req.request_id or uuid.uuid4().hex)
    events = run.events()
    try:
        first = await events.__anext__()  # admission and validation errors surface here, as a status code
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()  # (finished already when it raised; released its admission)
        raise

    async def all_events():
        try:
            if first is not None:
                yield first
            async for e in events:
                yield e
        finally:
            await events.aclose()

    if req.stream:
        return sse(all_events(), run, rid, obj + (".chunk" if chat else ""), created, model, chat, req, frontend)
    choices: dict[int, Choice] = {}
    try:
        async for i, d in all_events():
            run.count(d)
            if i not in choices:
                choices[i] = Choice(run.echo[i // run.params.n] if run.echo else "")
            choices[i].add(d)
    finally:
        await events.aclose()
    out = []
    as_ids = bool(req.return_tokens_as_token_ids)
    for i in sorted(choices):
        c = choices[i]
        text = "".join(c.texts)
        lp = None
        if run.params.logprobs is not None:
            if chat:
                lp = await frontend.prompts.run(logprobs_chat, frontend.tokenizer, c.entries, run.params.logprobs,
                                                as_ids)
            else:
                lp = await frontend.prompts.run(logprobs_completion, frontend.tokenizer, c.entries,
                                                run.params.logprobs, c.spans, as_ids, run.text_offsets(i))
                echo = await run.echo_logprobs(i, run.params.logprobs, as_ids)  # once per prompt
                lp = lp if echo is None else joined(echo, lp)
        if chat:
            message: dict = {"role": req.response_role(), "content": text}
            reason = c.reason
            plan = req.tool_plan()
            if plan.mode != "none":
                message["content"], calls = plan.parse(text)
                if calls:
                    message["tool_calls"] = calls
                    reason = "tool_calls" if reason == "stop" else reason
            if req.echoed():
                message["content"] = req.echoed() + (message["content"] or "")
            out.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason,
                        "stop_reason": c.stop_reason})
        else:
            out.append({"index": i, "text": text, "logprobs": lp, "finish_reason": c.reason,
                        "stop_reason": c.stop_reason})
            if req.return_token_ids:  # vLLM's: a completion's prompt on its choice
                out[-1]["prompt_token_ids"] = run.prompts[i // run.params.n]
        if req.return_token_ids:
            out[-1]["token_ids"] = c.token_ids
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": out, "usage": run.usage}
    if chat and req.return_token_ids:  # vLLM's: a chat's prompt on the response
        body["prompt_token_ids"] = run.prompts[0]
    return body
