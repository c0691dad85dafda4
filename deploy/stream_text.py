"""Text for a request's stream, made in the frontend: the workers send token ids only.

A worker's step thread then only schedules, runs the model and samples; incremental
detokenization and stop strings happen here, with the engine's own rules
(worker/detokenizer.py: `TextStream`), so a stream's text is what the offline engine
would produce. A stop string found here ends that completion at its exact character;
the tokens the worker made after it are dropped, and once every completion has ended the
stream ends (the frontend closes it, which aborts the request on its worker).

A request that asked for no detokenization passes through untouched (no text, no stop
strings: the engine's behaviour).
"""

from __future__ import annotations

import dataclasses

from folio.worker.detokenizer import TextStream
from folio.worker.messages import CompletionDelta, StreamChunk
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
            for k, t in enumerate(ids):
                if ts.append(t):
                    keep = k + 1
                    break
            reason = "stop" if ts.stop is not None else d.finish_reason
            if reason is not None:
                self.ended.add(d.index)
            lps = d.logprobs[:keep] if d.logprobs is not None else None
            deltas.append(CompletionDelta(index=d.index, token_ids=ids[:keep], text=ts.delta(reason is not None),
                                          num_tokens=d.num_tokens - (len(ids) - keep), finish_reason=reason,
                                          logprobs=lps))
        finished = chunk.finished or len(self.ended) >= self.params.n
        return dataclasses.replace(chunk, deltas=deltas, finished=finished)
