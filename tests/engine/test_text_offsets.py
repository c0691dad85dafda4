"""Completions' text_offset (deploy/text_offsets.py): each token's offset is where the frontend's
text stream (TextStream, primed with the prompt's tail) emits its text, in whichever delta it
goes out (not clipped to the token's own delta: a stop string's held-back text put offsets at
the delta's end); streamed delta by delta and formatted whole alike. Generated
texts mix characters of 1-4 UTF-8 bytes (split over several byte-level tokens, or over byte-
fallback tokens), arbitrary delta sizes, and stop strings that hold text back and cut it.
Chat logprobs' `bytes` (deploy/token_bytes.py) on the same texts: each token's own bytes, which
joined are the text's."""

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from tokenizers.decoders import DecodeStream

from folio.deploy.openai_logprobs import logprobs_completion
from folio.deploy.text_offsets import TextOffsets
from folio.deploy.token_bytes import TokenBytes
from folio.worker.detokenizer import PROMPT_CONTEXT, TextStream

PIECES = ["a", "b", "o", "k", "ok", " ", "  ", "\n", "\t", "é", "ö", "—", "“", "日本", "語", "😀", "👍🏽", " x", "the"]


def sentencepiece_like():
    """A Llama-style tokenizer: "▁" for spaces, characters out of its vocabulary as byte
    tokens <0xNN> (byte fallback), its decoder dropping the first space."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for t in ["▁", "a", "b", "o", "k", "ok", "x", "t", "h", "e", "é"]:
        vocab.setdefault(t, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("o", "k")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte-level", "byte-fallback"])
def tok(request, model_dirs):
    if request.param == "byte-fallback":
        return sentencepiece_like()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dirs["llama"])


def stream(tok, prompt: list[int], ids: list[int], sizes: list[int], stop: str | None):
    """The deltas a frontend makes of `ids` arriving `sizes` at a time: (token ids, text) each,
    with the offsets TextOffsets gives them one delta at a time and those expected."""
    ref, pos, made = DecodeStream(ids=prompt[-PROMPT_CONTEXT:], skip_special_tokens=True), [], 0
    for t in ids:  # where the stream emits each token's text
        pos.append(made)
        made += len(ref.step(tok.backend_tokenizer, t) or "")
    ts = TextStream(tok, prompt, [stop] if stop else [])
    offsets = TextOffsets(prompt[-PROMPT_CONTEXT:], True)
    deltas, got, want, text, i = [], [], [], "", 0
    for size in sizes * len(ids):
        chunk, stopped = ids[i:i + size], False
        for k, t in enumerate(chunk):
            if ts.append(t):
                chunk, stopped = chunk[:k + 1], True
                break
        end = stopped or i + len(chunk) >= len(ids)
        delta = ts.delta(end)
        deltas.append((chunk, delta))
        got += offsets.offsets(tok, chunk, len(text), len(delta))
        want += pos[i:i + len(chunk)]
        text, i = text + delta, i + len(chunk)
        if end:
            return deltas, got, want, text
    raise AssertionError("sizes too short")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.sampled_from(PIECES), min_size=1, max_size=4),
       gen=st.lists(st.sampled_from(PIECES), min_size=1, max_size=14),
       sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6), data=st.data())
def test_text_offset_is_where_the_stream_puts_each_token(tok, prompt, gen, sizes, data):
    prompt_ids = tok.encode("".join(prompt), add_special_tokens=False) or [tok.bos_token_id]
    ids = tok.encode("".join(gen), add_special_tokens=False)
    text = "".join(gen)
    stop = None
    if data.draw(st.booleans()):  # a stop string from the text: held back while it may match, then cut
        a = data.draw(st.integers(0, len(text) - 1))
        stop = text[a:data.draw(st.integers(a + 1, min(len(text), a + 3)))]
    deltas, got, want, out = stream(tok, prompt_ids, ids, sizes, stop)
    assert got == want
    # each token's text is at its offset, where the text holds it whole (what a client maps spans by)
    ref = DecodeStream(ids=prompt_ids[-PROMPT_CONTEXT:], skip_special_tokens=True)
    for t, o in zip([t for chunk, _ in deltas for t in chunk], got):
        piece = ref.step(tok.backend_tokenizer, t) or ""
        if piece and o + len(piece) <= len(out):
            assert out[o:o + len(piece)] == piece, (out, o, piece)
    # the whole choice formatted at once (a non-streamed response): the same offsets
    entries = [{t: -1.0} for chunk, _ in deltas for t in chunk]
    spans, at = [], 0
    for chunk, delta in deltas:
        spans.append((at, len(delta), len(chunk)))
        at += len(delta)
    whole = logprobs_completion(tok, entries, 0, spans, offsets=TextOffsets(prompt_ids[-PROMPT_CONTEXT:], True))
    assert whole["text_offset"] == want


def test_a_token_after_a_character_split_over_deltas(tok):
    """The case that was wrong: "b" after an emoji whose bytes came in two deltas sat one
    character early (each delta's ids were decoded alone)."""
    prompt = tok.encode("ok", add_special_tokens=False)
    ids = tok.encode("a😀b", add_special_tokens=False)
    assert len(ids) >= 3  # the emoji is more than one token in both tokenizers
    _, got, want, text = stream(tok, prompt, ids, [1], None)
    assert text.endswith("a😀b") and got == want and got[-1] == len(text) - 1  # " a😀b" after "▁"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=12))
def test_chat_logprobs_bytes_are_each_tokens_own_and_join_into_the_text(tok, pieces):
    """A token holding part of a character decodes alone to "\ufffd": its `bytes` were that
    character's (239, 191, 189), so the bytes of "日本" or "😀" joined gave replacement characters."""
    text = "".join(pieces)
    ids = tok(text, add_special_tokens=False).input_ids
    tb = TokenBytes(tok)
    joined = b"".join(bytes(tb(t)) for t in ids)
    # (the SentencePiece-like normalizer puts "▁" before the text, which its decoder drops)
    assert joined in (text.encode(), b" " + text.encode()), (text, ids, joined)
    assert [bytes(tb(tok.convert_tokens_to_ids(s))) for s in ("<s>", "</s>")] == [b"<s>", b"</s>"]
