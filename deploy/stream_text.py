"""Text for a request's stream, made in the frontend: the workers send token ids only.

A worker's step thread then only schedules, runs the model and samples; incremental
detokenization and stop strings happen here, with the engine's own rules
(worker/detokenizer.py: `TextStream`), so a stream's text is what the offline engine
would produce. A stop string found here ends that completion at its exact character;
the tokens the worker made after it are dropped, and once every completion has ended the
stream ends (the frontend closes it, which aborts the request on its worker).

A request that asked for no detokenization passes through untouched (no text, no stop
strings: the engine's behaviour).

`StreamInterval`: vLLM's `--stream-interval` / `stream_interval` for a stream's chunks (fewer,
larger chunks; less work per token in the frontend and the client).
"""

from __future__ import annotations

import dataclasses

from folio.worker.detokenizer import TextStream
from folio.worker.messages import CompletionDelta, StreamChunk, merge_chunks
from folio.worker.sampling_params import SamplingParams


def worker_params(params: SamplingParams) -> SamplingParams:
    """What the worker is asked to run: the same request, without its detokenization."""
    return dataclasses.replace(params, detokenize=False) if params.detokenize else params


class StreamText:
    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.prompt_ids = prompt_ids
        self.params = params
        self.active = params.detokenize
        self.texts: dict[int, TextStream] = {}
        self.ended: set[int] = set()  # completions that have finished (here or on the worker)

    def _text(self, index: int) -> TextStream:
        ts = self.texts.get(index)
        if ts is None:
            p = self.params
            ts = self.texts[index] = TextStream(self.tokenizer, self.prompt_ids, p.stop, p.include_stop_str_in_output,
                                                p.skip_special_tokens, p.min_tokens)
        return ts

    def apply(self, chunk: StreamChunk) -> StreamChunk:
        """The chunk with its text filled in, cut at a stop string, finished once every
        completion is."""
        if not self.active:
            return chunk
        deltas = []
        for d in chunk.deltas:
            if d.index in self.ended:
                continue  # made after its stop string (or a duplicate end): dropped
            ts = self._text(d.index)
            ids, keep = d.token_ids, len(d.token_ids)
            # the worker's "stop" ends on a stop token (EOS, stop_token_ids, the grammar's end): its text is
            # not the output's, unless include_stop_str_in_output (vLLM's rule; the offline engine's too)
            texts = keep - (d.finish_reason == "stop" and keep > 0 and not self.params.include_stop_str_in_output)
            for k, t in enumerate(ids[:texts]):
                if ts.append(t):
                    keep = k + 1
                    break
            reason = "stop" if ts.stop is not None else d.finish_reason
            if reason is not None:
                self.ended.add(d.index)
            lps = d.logprobs[:keep] if d.logprobs is not None else None
            # vLLM's stop_reason: the stop string, or the worker's (a stop_token_ids id; None for EOS, checked first)
            stopped_by = ts.stop if ts.stop is not None else (d.stop_reason if keep == len(ids) else None)
            deltas.append(CompletionDelta(index=d.index, token_ids=ids[:keep], text=ts.delta(reason is not None),
                                          num_tokens=d.num_tokens - (len(ids) - keep), finish_reason=reason,
                                          logprobs=lps, stop_reason=stopped_by))
        finished = chunk.finished or len(self.ended) >= self.params.n
        return dataclasses.replace(chunk, deltas=deltas, finished=finished)


class StreamInterval:
    """A stream's chunks merged until one of its completions has `every` tokens not sent yet,
    as vLLM's stream_interval: each completion's first tokens, a finished completion and the
    stream's last chunk go at once. `every` = 1 sends every chunk as it comes."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.pending: StreamChunk | None = None
        self.unsent: dict[int, int] = {}  # completion -> tokens in `pending`
        self.started: set[int] = set()  # completions whose first tokens went out

    def add(self, chunk: StreamChunk) -> StreamChunk | None:
        """The chunk to send now (`chunk`, or it merged after those held back), or None."""
        if self.every <= 1:
            return chunk
        self.pending = chunk if self.pending is None else merge_chunks(self.pending, chunk)
        now = self.pending.finished
        for d in chunk.deltas:
            if d.token_ids:
                n = self.unsent[d.index] = self.unsent.get(d.index, 0) + len(d.token_ids)
                now = now or n >= self.every or d.index not in self.started
                self.started.add(d.index)
            now = now or d.finish_reason is not None
        return self.flush() if now else None

    def flush(self) -> StreamChunk | None:
        """Whatever is held back (None if nothing): sent before an error ends the stream."""
        out, self.pending, self.unsent = self.pending, None, {}
        return out
