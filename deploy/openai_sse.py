"""A run's events as OpenAI's server-sent events: one `data: <chunk>` per CompletionDelta, a
usage chunk last with stream_options.include_usage (usage in every chunk with vLLM's
continuous_usage_stats), then `data: [DONE]`.

Chat chunks carry `delta`s: first a chunk of each choice with only the role (and "content": ""),
as OpenAI and vLLM send it, then under `echo` one with a continued final message's text, then
content and tool-call deltas from the request's tool plan; completion chunks carry `text`, the first of each choice led by its echoed prompt, with
logprobs' text_offset counted over the choice's text. An error after the first byte (the status is
sent) is reported as an error chunk before [DONE]; the stream's end, however it comes, closes the
run's events, which aborts every stream of the request.
"""

from __future__ import annotations

import json
from typing import AsyncIterator

from folio.deploy.openai_errors import http_error
from folio.deploy.openai_logprobs import joined, logprobs_chat, logprobs_completion
from folio.deploy.openai_tools import ToolCallStream


async def sse(events, run, rid, obj, created, model, chat, req, frontend) -> AsyncIterator[bytes]:
    tok = frontend.tokenizer
    as_ids = bool(req.return_tokens_as_token_ids)

    def line(payload) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()
    lengths: dict[int, int] = {}  # characters streamed so far per choice
    plan = req.tool_plan() if chat else None
    tools: dict[int, ToolCallStream] = {}  # per choice, with tools: text -> content and tool-call deltas
    try:
        for chunk in _chat_heads(run, {"id": rid, "object": obj, "created": created, "model": model}, req) if chat \
                else ():
            yield line(chunk)
        async for i, d in events:
            run.count(d)
            echoed: list = []  # completions' echoed prompt's logprobs, on its choice's first chunk
            if chat:
                delta = {}
                text, calls, reason = d.text, [], d.finish_reason
                if plan.mode != "none":
                    parser = tools.get(i) or tools.setdefault(i, plan.stream())  # made once per choice
                    text, calls = parser.feed(d.text)
                    if reason is not None:
                        more, last = parser.finish()
                        text, calls = text + more, calls + last
                        if parser.calls and reason == "stop":
                            reason = "tool_calls"
                if text:
                    delta["content"] = text
                if calls:
                    delta["tool_calls"] = calls
                choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": reason,
                          "stop_reason": d.stop_reason}
                if d.logprobs and run.params.logprobs is not None:
                    choice["logprobs"] = logprobs_chat(tok, d.logprobs, run.params.logprobs, as_ids)
            else:
                first = i not in lengths
                echoed = run.prompt_entries(i) if first else []
                prefix = run.echo[i // run.params.n] if run.echo and first else ""
                at = lengths.get(i, 0) + len(prefix)
                lengths[i] = at + len(d.text)
                choice = {"index": i, "text": prefix + d.text, "logprobs": None, "finish_reason": d.finish_reason,
                          "stop_reason": d.stop_reason}
                if req.return_token_ids and first:  # vLLM's: a choice's prompt on its first chunk
                    choice["prompt_token_ids"] = run.prompts[i // run.params.n]
                if (d.logprobs or echoed) and run.params.logprobs is not None:
                    lp = logprobs_completion(tok, d.logprobs or [], run.params.logprobs,
                                             [(at, len(d.text), len(d.logprobs or []))], as_ids,
                                             run.text_offsets(i))
                    if echoed:  # formatted once per prompt, off the event loop (openai_run.py)
                        lp = joined(await run.echo_logprobs(i, run.params.logprobs, as_ids), lp)
                    choice["logprobs"] = lp
                elif d.text and run.params.logprobs is not None:  # held-back text only: the offsets follow it
                    run.text_offsets(i).offsets(tok, [], at, len(d.text))
            if req.return_token_ids:
                choice["token_ids"] = d.token_ids
            chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if req.include_usage:
                chunk["usage"] = dict(run.usage) if req.continuous_usage else None
            yield await frontend.prompts.run(line, chunk) if echoed else line(chunk)  # megabytes: off the loop
        if req.include_usage:
            yield line({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                        "usage": run.usage})
    except Exception as e:  # after the first byte the status is sent: report in the stream
        frontend.count_error(e)
        yield line(http_error(e).body())
    finally:
        await events.aclose()  # a client gone (or an error) aborts every stream of the request
    yield b"data: [DONE]\n\n"


def _chat_heads(run, head: dict, req) -> list[dict]:
    """A chat stream's first chunks: the role alone per choice (OpenAI's and vLLM's order; with
    return_token_ids the prompt's ids too, as vLLM's), then a continued final message's echo."""
    echo = [{"content": req.echoed()}] if req.echoed() else []
    out = []
    for delta in [{"role": req.response_role(), "content": ""}] + echo:
        for i in range(run.params.n):
            chunk = {**head, "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]}
            if req.include_usage:
                chunk["usage"] = dict(run.usage) if req.continuous_usage else None
            if req.return_token_ids and "role" in delta:
                chunk["prompt_token_ids"] = run.prompts[0]
            out.append(chunk)
    return out
