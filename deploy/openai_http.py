"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. Server-sent events end with `data: [DONE]`; errors use OpenAI's
JSON shape: {"error": {"message", "type", "param", "code"}}.

    400 bad input, a field Folio does not implement (param names it), or max_tokens above
        max_model_len (a prompt plus max_tokens past it gets max_tokens cut to what fits, and
        finish_reason "length" there, as vLLM 0.32 answers: frontend.fit_context)
    401 missing/wrong API key · 404 an unknown model (code model_not_found) · 413 body too large
    429 admission queue full (Retry-After) · 503 no live worker (or the worker serving it
    died after streaming tokens) · 500 anything unexpected, still in this shape

`model` must be one of the served names (`--served-model-name`, aliases allowed; absent: the
first), and the response names the one asked for. Completions without max_tokens get 16
(OpenAI's and vLLM's default) or what fits if less; `max_tokens: null`, and chat without a
limit, get what fits. Completions logprobs carry `text_offset`: each token's character
offset in the choice's text (the echoed prompt included).

Bodies are parsed by the typed models of openai_schema.py (the bounds are SamplingParams');
a request's prompts are checked, then admitted whole, and every path out of a run after
admission (an error, a client gone) aborts its streams and releases its slots (openai_run.py).
The answer is one JSON body (openai_response.py) or server-sent events (openai_sse.py); the
error shape and statuses are openai_errors.py's.

Handlers are plain functions of (frontend, body); deploy/serve_deployment.py mounts them on
the FastAPI app that Ray Serve runs. A client that disconnects closes the stream,
which aborts its request on the worker.
"""

from __future__ import annotations

import asyncio

from folio.deploy.auth import bearer_ok
from folio.deploy.frontend import Frontend, fit_context
from folio.deploy.openai_errors import HTTPError
from folio.deploy.openai_response import respond
from folio.deploy.openai_run import Run
from folio.deploy.openai_sampling import keep_tokens
from folio.deploy.openai_tools import check_template_tools
from folio.deploy.openai_schema import ChatCompletionRequest, CompletionRequest, parse
from folio.worker.errors import InvalidRequestError
from folio.worker.sampling_params import MAX_TOKENS, SamplingParams


def check_auth(api_key: str | None, authorization: str | None) -> None:
    if not bearer_ok(api_key, authorization):
        raise HTTPError(401, "a valid API key is required: Authorization: Bearer <key>", "authentication_error",
                        "invalid_api_key")


# ---- model names ---------------------------------------------------------------------------
def served_names(cfg) -> list[str]:
    """What `model` may be: `--served-model-name`'s names (aliases), else the checkpoint's name."""
    names = cfg.served_model_name
    names = [names] if isinstance(names, str) else list(names or [])
    return [n for n in names if n] or [cfg.model_name]


def resolve_model(frontend: Frontend, model: str | None) -> str:
    """The served name a request asked for (absent: the first), or 404 model_not_found."""
    names = served_names(frontend.cfg)
    if model is None:
        return names[0]
    if model not in names:
        raise HTTPError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model_not_found",
                        param="model")
    return model


# ---- request parsing ---------------------------------------------------------------------
async def completion_prompts(frontend: Frontend, req: CompletionRequest) -> list[list[int]]:
    special = req.add_special_tokens is not False
    return [req.truncate(frontend.token_ids(p) if isinstance(p, list) else await frontend.prompts.text_ids(p, special),
                         frontend.cfg.max_model_len) for p in req.prompts()]


def _too_many_prompts(frontend: Frontend, body) -> None:
    """Before anything runs per prompt (checks, parsing, tokenizing): a list of more prompts
    than the frontend can ever admit, or token ids that cannot fit, is refused at once (a
    body of 2 million one-token prompts held the event loop for 17 s). Token ids are cut to
    `truncate_prompt_tokens` first: 8,192 ids with truncate_prompt_tokens 100 were refused as
    too long, while the same ids nested ([[ids]]) or as text were served."""
    p = body.get("prompt") if isinstance(body, dict) else None
    if not isinstance(p, list) or not p:
        return
    if isinstance(p[0], int):
        k = body.get("truncate_prompt_tokens")
        k = keep_tokens(k, frontend.cfg.max_model_len) if type(k) is int else None
        if k is not None and k < len(p):  # kept to its last k ids first, as every other prompt form is
            body["prompt"] = p = p[-k:]
        if len(p) >= frontend.cfg.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(p)} tokens; max_model_len is {frontend.cfg.max_model_len}",
                                      param="prompt")
    elif len(p) > frontend.cfg.max_num_requests:
        raise InvalidRequestError(f"{len(p)} prompts in one request exceed the frontend's limit of "
                                  f"{frontend.cfg.max_num_requests} in flight", param="prompt")


def too_many_messages(frontend: Frontend, body) -> None:
    """Before a chat body is parsed: more objects and arrays in its `messages` and `tools`
    (messages, content parts, tool calls, tools and their schemas: each renders as one token
    at least) than max_model_len is refused at once. Each costs work in proportion before the
    prompt's length is known (parsing, the template's dicts, their strings): 120,000
    one-letter messages (4 MB) took 5.7 s to refuse and held /health up to 4.2 s, 50,000 tools
    4 s and 2.4 s (attacks, 2026-12-07)."""
    if not isinstance(body, dict):
        return
    limit = frontend.cfg.max_model_len
    n, todo = 0, [body.get("messages"), body.get("tools")]
    while todo and n <= limit:  # stops past the limit: a walk of at most that many
        v = todo.pop()
        if isinstance(v, dict):
            n += 1
            todo.extend(v.values())
        elif isinstance(v, list):
            n += 1
            todo.extend(v)
    if n > limit:
        raise InvalidRequestError(f"the messages and tools hold more than {limit} objects and arrays: they cannot "
                                  f"fit in max_model_len ({limit}) tokens", param="messages")


async def parse_body(model, body):
    """parse() on the event loop for a small body; a body with long lists or objects (whose
    checks take time in proportion) is parsed on a thread, so it stalls no other request."""
    small = isinstance(body, dict) and all(not isinstance(v, (list, dict)) or len(v) < 256 for v in body.values())
    return parse(model, body) if small else await asyncio.to_thread(parse, model, body)


# ---- the handlers: parse, check, admit, run (openai_run.py), respond (openai_response.py) --
async def completions(frontend: Frontend, body: dict):
    """Returns a dict (non-streaming) or an async iterator of SSE byte strings."""
    _too_many_prompts(frontend, body)
    req = await parse_body(CompletionRequest, body)
    model = resolve_model(frontend, req.model)
    # echo with max_tokens 0: the prompt scored, nothing generated (the old OpenAI API's, vLLM's): one token is
    # made, for the prompt's logprobs, and not shown (Run.echo_only)
    echo_only = bool(req.echo) and req.max_tokens == 0
    # the cheap checks (and the refusals) before any tokenizing; max_tokens may be unknown yet, so its largest
    # stands in (min_tokens is checked against the real one below: a stand-in of 1 refused min_tokens 4 alone)
    replace_max_tokens(req, MAX_TOKENS) if echo_only else req.sampling_params(MAX_TOKENS)
    prompts = await completion_prompts(frontend, req)
    if req.max_tokens is not None and not echo_only:
        default = req.max_tokens
    else:  # absent or null (vLLM 0.32 reads null as its default): 16, or what fits if less
        default = max(1, min([16] + [frontend.cfg.max_model_len - len(p) for p in prompts]))
    params = fit_context(frontend.cfg.max_model_len, prompts,
                         req.sampling_params(default) if not echo_only else replace_max_tokens(req, 1))
    echo = None
    if req.echo:  # the prompt as given; token ids (or a truncated prompt) decoded
        echo = [p if isinstance(p, str) and req.truncate_prompt_tokens is None
                else await frontend.prompts.run(frontend.tokenizer.decode, ids)
                for p, ids in zip(req.prompts(), prompts)]
    return await _start(frontend, req, prompts, params, False, model, echo, echo_only)


async def chat_completions(frontend: Frontend, body: dict):
    too_many_messages(frontend, body)
    req = await parse_body(ChatCompletionRequest, body)
    model = resolve_model(frontend, req.model)
    n = req.sampling_params(MAX_TOKENS).n  # the cheap checks before the template is rendered (as above)
    if req.tool_plan().renders:
        check_template_tools(frontend.tokenizer)
    messages = req.template_messages() if len(req.messages) < 256 else await asyncio.to_thread(req.template_messages)
    ids = req.truncate(await frontend.prompts.chat_ids(messages, req.generation_prompt(), req.template_kwargs(),
                                                       bool(req.continue_final_message)), frontend.cfg.max_model_len)
    params = fit_context(frontend.cfg.max_model_len, [ids],
                         req.sampling_params(await frontend.default_max_tokens(len(ids), n)),
                         "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    return await _start(frontend, req, [ids], params, True, model, None)


def replace_max_tokens(req, max_tokens: int) -> SamplingParams:
    """The request's sampling parameters with `max_tokens` in place of its own (echo with 0)."""
    return req.model_copy(update={"max_tokens": None}).sampling_params(max_tokens)


async def _start(frontend: Frontend, req, prompts: list[list[int]], params: SamplingParams, chat: bool, model: str,
                 echo: list[str] | None, echo_only: bool = False):
    priority = 0 if req.priority is None else req.priority
    await frontend.check(prompts, params, priority, "messages" if chat else "prompt")
    admission = frontend.admit(len(prompts))
    try:
        run = Run(frontend, prompts, params, priority, admission)
    except BaseException:
        admission.release()
        raise
    run.echo, run.echo_only = echo, echo_only
    run.stream_interval = req.stream_interval if req.stream else None  # (vLLM ignores it unstreamed too)
    return await respond(frontend, req, run, chat, model)


# ---- /v1/models ---------------------------------------------------------------------------
def model_card(frontend: Frontend, name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "folio", "root": served_names(frontend.cfg)[0],
            "parent": None, "max_model_len": frontend.cfg.max_model_len}


def models(frontend: Frontend) -> dict:
    return {"object": "list", "data": [model_card(frontend, n) for n in served_names(frontend.cfg)]}


def model(frontend: Frontend, model_id: str) -> dict:
    """GET /v1/models/{id}: the card, or 404 model_not_found."""
    return model_card(frontend, resolve_model(frontend, model_id))
