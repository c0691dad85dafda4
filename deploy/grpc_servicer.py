"""folio.v1.Generation's servicer: Generate (the whole result), GenerateStream (each chunk's
deltas, usage on the last), Abort and GetModelInfo, over the Frontend that HTTP shares.

Status codes: INVALID_ARGUMENT (bad input: a request_id past MAX_REQUEST_ID_CHARS, no prompt, a
prompt plus max_tokens past max_model_len, refused as over HTTP and never clamped),
RESOURCE_EXHAUSTED (admission queue full), UNAVAILABLE (no live worker), CANCELLED (aborted),
INTERNAL with its reason for anything unexpected (never UNKNOWN). A client that cancels or
disconnects (or whose deadline passes) closes the handler's stream, which aborts its request on
the worker within one engine step.
"""

from __future__ import annotations

import grpc

from folio.deploy.frontend import Frontend, fit_context
from folio.deploy.grpc_convert import pb_logprobs, sampling_params, status_of
from folio.v1 import generate_pb2 as pb
from folio.v1 import generate_pb2_grpc as pb_grpc
from folio.worker.errors import FolioError, InvalidRequestError

MAX_REQUEST_ID_CHARS = 256


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    async def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which == "text":
            return await self.frontend.text_ids(request.text)
        if which == "token_ids":
            return self.frontend.token_ids(list(request.token_ids.ids))
        raise InvalidRequestError("the request has no prompt: set text or token_ids")

    async def _stream(self, request, context):
        """(chunk) of the request, with errors turned into the RPC's status: bad input is
        INVALID_ARGUMENT, and anything unexpected INTERNAL with its reason, never UNKNOWN."""
        try:
            if len(request.request_id) > MAX_REQUEST_ID_CHARS:
                raise InvalidRequestError(f"request_id is longer than {MAX_REQUEST_ID_CHARS} characters")
            params = sampling_params(request.sampling)
            interval = request.stream_interval if request.HasField("stream_interval") else None
            if interval == 0:
                raise InvalidRequestError("stream_interval must be at least 1")
            ids = await self._prompt(request)
            params = fit_context(self.frontend.cfg.max_model_len, [ids], params)
            gen = self.frontend.generate(ids, params, request.priority, request.request_id or None,
                                         stream_interval=interval)
            try:
                async for chunk in gen:
                    yield ids, chunk
            finally:
                await gen.aclose()
        except FolioError as e:
            self.frontend.count_error(e)
            await context.abort(status_of(e), str(e))
        except Exception as e:
            self.frontend.count_error(e)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__}): {e}")

    async def Generate(self, request, context):
        texts, tokens, reasons, lps = {}, {}, {}, {}
        rid, n_prompt = request.request_id, 0
        async for ids, chunk in self._stream(request, context):
            rid, n_prompt = chunk.request_id, len(ids)
            for d in chunk.deltas:
                texts.setdefault(d.index, []).append(d.text)
                tokens.setdefault(d.index, []).extend(d.token_ids)
                lps.setdefault(d.index, []).extend(d.logprobs or [])
                if d.finish_reason:
                    reasons[d.index] = d.finish_reason
        if "abort" in reasons.values():
            await context.abort(grpc.StatusCode.CANCELLED, f"request {rid} was aborted")
        completions = [pb.Completion(index=i, text="".join(texts[i]), token_ids=tokens[i],
                                     finish_reason=reasons.get(i, ""), logprobs=pb_logprobs(lps[i]))
                       for i in sorted(texts)]
        out = sum(len(t) for t in tokens.values())
        return pb.GenerateResponse(request_id=rid, completions=completions,
                                   usage=pb.Usage(prompt_tokens=n_prompt, completion_tokens=out,
                                                  total_tokens=n_prompt + out))

    async def GenerateStream(self, request, context):
        out = 0
        async for ids, chunk in self._stream(request, context):
            out += sum(len(d.token_ids) for d in chunk.deltas)
            if any(d.finish_reason == "abort" for d in chunk.deltas):
                await context.abort(grpc.StatusCode.CANCELLED, f"request {chunk.request_id} was aborted")
            msg = pb.GenerateStreamResponse(
                request_id=chunk.request_id, finished=chunk.finished,
                deltas=[pb.Completion(index=d.index, text=d.text, token_ids=d.token_ids,
                                      finish_reason=d.finish_reason or "", logprobs=pb_logprobs(d.logprobs))
                        for d in chunk.deltas])
            if chunk.finished:
                msg.usage.CopyFrom(pb.Usage(prompt_tokens=len(ids), completion_tokens=out,
                                            total_tokens=len(ids) + out))
            yield msg

    async def Abort(self, request, context):
        if not 0 < len(request.request_id) <= MAX_REQUEST_ID_CHARS:  # as Generate's ids: none can match
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"request_id must be 1 to {MAX_REQUEST_ID_CHARS} characters")
        return pb.AbortResponse(aborted=await self.frontend.abort(request.request_id))

    async def GetModelInfo(self, request, context):
        cfg = self.frontend.cfg
        return pb.ModelInfo(model=cfg.model_name, max_model_len=cfg.max_model_len, block_size=cfg.block_size,
                            vocab_size=self.frontend.vocab_size, num_workers=cfg.num_workers)
