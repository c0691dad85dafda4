"""Incremental detokenisation and stop-string detection, one completion at a time.

The rules live here once, for both places that turn tokens into text: the offline
engine (`Detokenizer`, on a Sequence) and a serving frontend (`TextStream`, on the
token ids a worker streams to it; the workers then do no detokenization at all):

- a token's text is decoded in context (a DecodeStream primed with the prompt's tail);
- a stop string is looked for only where the new text could complete it, and the text
  is cut before it (after it with include_stop_str_in_output);
- a stream sends text up to what could still be the start of a stop string
  (`sendable_end`): once matched, a stop string is cut, so it must never have been sent.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from folio.worker.sequence import Sequence

PROMPT_CONTEXT = 4  # prompt tokens fed to the stream so the first output token decodes in context


def load_tokenizer(path: str):
    """The checkpoint's own tokenizer (a fast one: its backend drives the streams below); a GGUF
    file's is built from its metadata, chat template included."""
    from transformers import AutoTokenizer  # heavy import, only when an engine is built

    from folio.worker.models import gguf_loader

    gguf_file = gguf_loader.find_gguf(path)
    if gguf_file is not None:
        return gguf_loader.load_tokenizer(gguf_file)
    return AutoTokenizer.from_pretrained(path)


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer  # a `tokenizers.Tokenizer`

    def _stream(self, seq: Sequence) -> DecodeStream:
        if seq.decoder is None:
            skip = seq.params.skip_special_tokens
            ctx = seq.token_ids[max(0, seq.num_prompt_tokens - PROMPT_CONTEXT) : seq.num_prompt_tokens]
            seq.decoder = DecodeStream(ids=ctx, skip_special_tokens=skip)
            # feed output tokens produced before this stream existed (an imported sequence:
            # their text is already in output_text) so the next token decodes in context
            for t in seq.token_ids[seq.num_prompt_tokens : seq.num_tokens - 1]:
                self._step(seq.decoder, t)
        return seq.decoder

    def _step(self, stream: DecodeStream, token_id: int) -> str:
        try:
            return stream.step(self.backend, token_id) or ""
        except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode adds no text
            return ""

    def append_token(self, seq: Sequence, token_id: int) -> str | None:
        """Add the text of `token_id` (already appended to seq.token_ids).

        Returns the stop string that matched, if any; the text is then cut before it
        (or after it with include_stop_str_in_output).
        """
        stream = self._stream(seq)
        new = self._step(stream, token_id)
        if not new:
            return None
        p = seq.params  # stop strings are looked for once past min_tokens (vLLM's rule)
        stops = p.stop if seq.num_output_tokens > p.min_tokens else ()
        seq.output_text, stop = match_stop(seq.output_text, new, stops, p.include_stop_str_in_output)
        return stop


def match_stop(text: str, new: str, stops, include: bool) -> tuple[str, str | None]:
    """(`text` + `new`, cut at the stop string the new text completes first, that stop; or
    None). First: the match that ends earliest, as if the text came one character at a time,
    then the one that starts earliest. So the cut does not depend on how the text was split
    into tokens, nor on the order of `stops`, and what is left holds no stop string (the first
    listed match won before: stop=["e", " "] left " OptionPars")."""
    prev_len = len(text)
    text += new
    best, best_key = None, None
    for stop in stops:
        pos = text.find(stop, max(0, prev_len - len(stop) + 1))  # only where the new text completes one
        if pos != -1 and (best_key is None or (pos + len(stop), pos) < best_key):
            best, best_key = stop, (pos + len(stop), pos)
    if best is None:
        return text, None
    end, pos = best_key
    return text[: end if include else pos], best


def sendable_end(text_len: int, sent: int, stops, finished: bool) -> int:
    """How much of a completion's text a stream may have sent: all of it once finished,
    else all but what could still be the start of a stop string."""
    if not stops or finished:
        return text_len
    return max(sent, text_len - (max(len(s) for s in stops) - 1))


class TextStream:
    """One completion's text in a serving frontend, from the token ids its worker streams:
    the engine's rules above, and the delta to send at each chunk."""

    __slots__ = ("_backend", "_decoder", "_stops", "_include", "_min_tokens", "_count", "text", "sent", "stop")

    def __init__(self, tokenizer, prompt_ids: list[int], stops=(), include_stop: bool = False,
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._decoder = DecodeStream(ids=list(prompt_ids[-PROMPT_CONTEXT:]), skip_special_tokens=skip_special_tokens)
        self._stops, self._include = tuple(stops), include_stop
        self._min_tokens, self._count = min_tokens, 0  # stop strings are looked for past min_tokens
        self.text = ""
        self.sent = 0  # characters of `text` already handed out
        self.stop: str | None = None  # the stop string that ended it

    def append(self, token_id: int) -> bool:
        """Add one token's text; True when it completed a stop string (the text is cut)."""
        try:
            new = self._decoder.step(self._backend, token_id) or ""
        except Exception:  # noqa: BLE001 - an id the tokenizer cannot decode adds no text
            new = ""
        self._count += 1
        if new:
            stops = self._stops if self._count > self._min_tokens else ()
            self.text, self.stop = match_stop(self.text, new, stops, self._include)
        return self.stop is not None

    def delta(self, finished: bool) -> str:
        """The text not yet handed out that may be now."""
        end = sendable_end(len(self.text), self.sent, self._stops, finished or self.stop is not None)
        out, self.sent = self.text[self.sent : end], end
        return out
