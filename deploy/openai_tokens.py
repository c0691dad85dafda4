"""vLLM's tokenizer endpoints and /version, with vLLM's request and response shapes
(`vllm bench serve` aligns its token counts through /tokenize):

    POST /tokenize   {"model", "prompt"} | {"model", "messages"}  -> {"tokens", "count", "max_model_len"}
                     (+ "token_strs" with return_token_strs; add_special_tokens: default true for
                     a prompt, false for messages; messages go through the chat template as in chat
                     completions, add_generation_prompt, continue_final_message,
                     chat_template_kwargs and tools included)
    POST /detokenize {"model", "tokens"}                          -> {"prompt": text}
    GET  /version                                                 -> {"version": Folio's version}

A prompt is tokenized whatever its length (up to the body limit and the character bound of
prompts.py), so a client can learn that it is too long. Token ids must be in the vocabulary.
"""

from __future__ import annotations

from importlib import metadata

from folio.deploy.frontend import Frontend
from folio.deploy.openai_http import parse_body, resolve_model, too_many_messages
from folio.deploy.openai_schema import DetokenizeRequest, TokenizeRequest, generation_prompt
from folio.deploy.openai_tools import check_template_tools, tool_plan
from folio.worker.errors import InvalidRequestError
from folio.worker.sampling_params import check_token_ids


async def tokenize(frontend: Frontend, body: dict) -> dict:
    too_many_messages(frontend, body)
    req = await parse_body(TokenizeRequest, body)
    resolve_model(frontend, req.model)
    req.check()
    p = frontend.prompts
    if req.messages is not None:
        messages = [m.template_dict(i) for i, m in enumerate(req.messages)]
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools:  # checked and shown as chat completions shows them (vLLM's /tokenize takes them too)
            check_template_tools(frontend.tokenizer)
            kwargs["tools"] = tool_plan(req.tools, "auto").tools
        ids = await p.chat_ids(messages, generation_prompt(req.add_generation_prompt, req.continue_final_message),
                               kwargs, bool(req.continue_final_message))
    elif req.tools:
        raise InvalidRequestError("tools need messages", param="tools")
    elif req.prompt:
        p.check_length(len(req.prompt))
        ids = await p.run(p.encode, req.prompt, req.add_special_tokens is not False, False)
    else:
        ids = []
    out = {"count": len(ids), "max_model_len": frontend.cfg.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = await p.run(frontend.tokenizer.convert_ids_to_tokens, ids)
    return out


async def detokenize(frontend: Frontend, body: dict) -> dict:
    req = await parse_body(DetokenizeRequest, body)
    resolve_model(frontend, req.model)
    ids = check_token_ids(req.tokens, frontend.vocab_size, "tokens", "tokens") if req.tokens else []
    return {"prompt": await frontend.prompts.run(frontend.tokenizer.decode, ids)}


def version() -> dict:
    try:
        v = metadata.version("folio-serve")
    except metadata.PackageNotFoundError:  # a checkout that is not installed
        from folio import __version__ as v
    return {"version": v}
