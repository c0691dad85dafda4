"""Turning a request's state into the outputs the caller sees.

Two kinds: "final" (one output when the request finishes, with everything) and
"delta" (an output at every step that produced tokens, with only what is new:
the streaming frontends use it).
"""

from __future__ import annotations

from folio.worker.detokenizer import sendable_end
from folio.worker.sequence import CompletionOutput, RequestOutput, SequenceGroup

OUTPUT_KINDS = ("final", "delta")


def make_request_output(group: SequenceGroup, kind: str) -> RequestOutput | None:
    """The output for `group` now, or None when `kind` has nothing to report yet."""
    finished = group.is_finished
    if kind == "final" and not finished:
        return None
    completions = []
    for seq in group.seqs:
        if kind == "delta":
            ids = seq.output_token_ids[seq.sent_tokens :]
            # hold back what could still turn out to be the start of a stop string (detokenizer.py)
            end = sendable_end(len(seq.output_text), seq.sent_text_len, seq.params.stop, seq.is_finished)
            text = seq.output_text[seq.sent_text_len : end]
            lps = seq.logprobs[seq.sent_tokens :] if seq.logprobs is not None else None
            seq.sent_tokens += len(ids)
            seq.sent_text_len = end
        else:
            ids, text, lps = seq.output_token_ids, seq.output_text, seq.logprobs
        completions.append(CompletionOutput(seq.index, ids, text, seq.finish_reason, seq.stop_reason, lps))
    pl = None
    if group.prompt_logprobs is not None and group.prompt_logprobs_done == len(group.prompt_token_ids):
        if kind != "delta" or not group.prompt_logprobs_sent:  # a stream gets them once, first
            pl = group.prompt_logprobs
            group.prompt_logprobs_sent = kind == "delta" or group.prompt_logprobs_sent
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions, finished,
                         group.metrics, prompt_logprobs=pl)
