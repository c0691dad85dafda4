"""Incremental detokenisation and stop-string detection, one sequence at a time."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from folio.worker.sequence import Sequence

_PROMPT_CONTEXT = 4  # prompt tokens fed to the stream so the first output token decodes in context


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
        if seq._decoder is None:
            skip = seq.params.skip_special_tokens
            ctx = seq.token_ids[max(0, seq.num_prompt_tokens - _PROMPT_CONTEXT) : seq.num_prompt_tokens]
            seq._decoder = DecodeStream(ids=ctx, skip_special_tokens=skip)
            # feed output tokens produced before this stream existed (an imported sequence:
            # their text is already in output_text) so the next token decodes in context
            for t in seq.token_ids[seq.num_prompt_tokens : seq.num_tokens - 1]:
                self._step(seq._decoder, t)
        return seq._decoder

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
        prev_len = len(seq.output_text)
        seq.output_text += new
        for stop in seq.params.stop:
            # only look where the new text could complete a match
            start = max(0, prev_len - len(stop) + 1)
            pos = seq.output_text.find(stop, start)
            if pos != -1:
                end = pos + len(stop) if seq.params.include_stop_str_in_output else pos
                seq.output_text = seq.output_text[:end]
                return stop
        return None
