"""The wire types' pure helpers (folio.worker.messages)."""

from folio.worker.messages import CompletionDelta, StreamChunk, merge_chunks


def test_merge_chunks_joins_each_completions_tokens_and_text_and_keeps_the_first_queue_time():
    a = StreamChunk(request_id="r", worker_id="w0",
                    deltas=[CompletionDelta(index=0, token_ids=[1], text="a", num_tokens=1),
                            CompletionDelta(index=1, token_ids=[7], text="x", num_tokens=1)], queue_s=0.5)
    b = StreamChunk(request_id="r", worker_id="w0",
                    deltas=[CompletionDelta(index=0, token_ids=[2, 3], text="bc", num_tokens=3,
                                            finish_reason="length")], finished=True, num_preemptions=1)
    m = merge_chunks(a, b)
    assert [(d.index, d.token_ids, d.text, d.num_tokens, d.finish_reason, d.logprobs) for d in m.deltas] == [
        (0, [1, 2, 3], "abc", 3, "length", None), (1, [7], "x", 1, None, None)]
    assert m.finished and m.queue_s == 0.5 and m.num_preemptions == 1 and m.migrated_to is None
