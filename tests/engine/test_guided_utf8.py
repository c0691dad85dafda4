"""Guided output is well-formed UTF-8 (worker/utf8_mask.py): xgrammar 0.2.9 takes an encoded
surrogate (ED A0..BF xx) as one character, so a string of maxLength 5 came back as ',ift' and
three U+FFFD. Checked byte by byte against Python's decoder: what xgrammar lets through, every
token the mask allows after every token that leaves a character open, and seeded requests."""

from __future__ import annotations

import codecs
import json
from types import SimpleNamespace

import jsonschema
import pytest

from folio.worker import LLM, SamplingParams
from folio.worker.errors import InvalidRequestError
from folio.worker.guided import Grammars, GuidedSpec
from conftest import PROMPTS

STRING5 = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 5}}, "required": ["a"],
           "additionalProperties": False}
# each spec with the text that leads into a place where any character may come
OPEN_TEXT = [(GuidedSpec("json_schema", json.dumps(STRING5)), '{"a":"'), (GuidedSpec("json_object"), '{"'),
             (GuidedSpec("regex", ".{1,4}"), ""), (GuidedSpec("grammar", "root ::= [^a]+"), "")]


def well_formed_prefix(data: bytes) -> bool:
    """Python's decoder takes `data` as the start of some well-formed UTF-8 text."""
    dec = codecs.getincrementaldecoder("utf-8")()
    try:
        dec.decode(data, final=False)
    except UnicodeDecodeError:
        return False
    open_ = dec.getstate()[0]  # the bytes of a character not yet complete
    if not open_:
        return True
    rest = (2 if open_[0] < 0xE0 else 3 if open_[0] < 0xF0 else 4) - len(open_) - 1
    return any(_decodes(open_ + bytes([c]) + b"\x80" * rest) for c in range(0x80, 0xC0))


def _decodes(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_xgrammar_lets_through_only_surrogates():
    """The cause, pinned: of every 1-4 byte sequence (continuations at their range ends), the
    ill-formed ones xgrammar's character classes take are surrogates only (0.2.9 takes all 128
    here), so the mask needs no more than Table 3-7's second-byte rule, which ILL_FORMED holds."""
    import xgrammar as xgr

    from folio.worker.utf8_mask import ILL_FORMED
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo([]))
    ends = (0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF)
    seqs = [bytes([a]) for a in range(0x80, 0x100)] + [bytes([a, b]) for a in range(0xC0, 0x100) for b in range(256)]
    seqs += [bytes([a, b, c]) for a in range(0xE0, 0xF0) for b in range(0x80, 0xC0) for c in ends + (0x41,)]
    seqs += [bytes([a, b, c, d]) for a in range(0xF0, 0x100) for b in range(0x80, 0xC0) for c in ends for d in ends]
    surrogates = {s for s in seqs if len(s) == 3 and s[0] == 0xED and s[1] >= 0xA0}
    for ebnf in ('root ::= "x" [^a]+ "y"', 'root ::= "x" [^\\0-\\x1f\\"\\\\]{0,5} "y"'):
        g = compiler.compile_grammar(ebnf)
        taken = {s for s in seqs if xgr.GrammarMatcher(g, terminate_without_stop_token=True).accept_string(
            b"x" + s + b"y")}
        assert {s for s in taken if not _decodes(s)} <= surrogates, ebnf
    assert all(ILL_FORMED.search(s) for s in surrogates)


@pytest.fixture(scope="module")
def grammars(model_dirs):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dirs["llama"])
    return tok, Grammars(tok, len(tok), [tok.eos_token_id])


def _allowed(grammars: Grammars, spec: GuidedSpec, tokens: list[int]) -> list[int]:
    seq = SimpleNamespace(grammar=None, params=SimpleNamespace(guided=spec), token_ids=tokens,
                          output_token_ids=tokens, num_prompt_tokens=0)
    words = grammars.bitmask([seq])[0].tolist()
    return [t for t in range(grammars.vocab_size) if (words[t // 32] >> (t % 32)) & 1]


@pytest.mark.parametrize("spec,text", OPEN_TEXT, ids=[s.kind for s, _ in OPEN_TEXT])
def test_every_allowed_token_keeps_the_output_well_formed(grammars, spec, text):
    """Every token allowed where a character may start, and every token allowed after each of
    those that leaves a character open (where the byte after a lead is decided: Table 3-7)."""
    tok, g = grammars
    start = tok.encode(text, add_special_tokens=False)
    vocab = g.info.decoded_vocab
    opened = 0
    for t1 in _allowed(g, spec, start):
        assert well_formed_prefix(vocab[t1]), (spec, vocab[t1])
        if _decodes(vocab[t1]) or not vocab[t1]:
            continue
        opened += 1
        for t2 in _allowed(g, spec, start + [t1]):
            assert well_formed_prefix(vocab[t1] + vocab[t2]), (spec, vocab[t1], vocab[t2])
    assert opened >= 40  # the byte-level vocabulary's lead bytes were reached


def test_a_grammar_of_only_surrogates_is_the_requests_error(grammars):
    _, g = grammars
    spec = GuidedSpec("grammar", "root ::= [\\uD800-\\uDFFF]")
    ed = _allowed(g, spec, [])
    assert [g.info.decoded_vocab[t] for t in ed] == [b"\xed"]
    with pytest.raises(InvalidRequestError, match="well-formed"):
        _allowed(g, spec, ed)


def test_seeded_bounded_strings_decode_as_the_grammar_counts(model_dirs):
    """128 seeded requests for a string of at most 5 characters, all well-formed and valid (before
    the mask, seed 29 wrote 'GE', an encoded surrogate and ' v' here: 5 characters to xgrammar, 7
    with its three U+FFFD)."""
    llm = LLM(model_dirs["llama"], block_size=8, num_kv_blocks=1024)
    spec = GuidedSpec("json_schema", json.dumps(STRING5))
    outs = llm.generate([PROMPTS[0]] * 128, [SamplingParams(max_tokens=40, temperature=1.0, seed=i, guided=spec)
                                             for i in range(128)])
    for o in outs:
        assert o.finish_reason == "stop" and "\ufffd" not in o.text, o.text
        jsonschema.validate(json.loads(o.text), STRING5)
