"""Request text to token ids, for both frontends, off the event loop.

    p = Prompts(model_dir, max_model_len, vocab_size)
    ids = await p.text_ids("def f():")            # or p.token_ids([1, 2, 3]) (checked, no tokenizer)
    ids = await p.chat_ids([{"role": "user", "content": "hi"}])

Tokenizing runs in a small thread pool (the Rust tokenizer releases the GIL), so one
large prompt does not stall /health or other requests on the frontend's event loop.
A text so long that it cannot fit in `max_model_len` tokens, whatever it tokenizes to,
is refused before it is tokenized at all: no token is longer than `max_token_chars`
characters, so a text of more than `max_model_len * max_token_chars` characters has at
least `max_model_len` tokens.

Chat: special tokens typed inside message content are text, never role markers. Where no
content holds a special token's text, the ids are `apply_chat_template(tokenize=True)`'s: the
rendering tokenized whole. Where one does, the template is rendered again with a sentinel in
place of each content; the template's own text is tokenized with special tokens parsed, each
content (as the template put it in: verbatim, or stripped as Llama 3's template does; other
changes are refused) with them split (`split_special_tokens=True`), and the pieces are
joined. (Tokenized in pieces, 2026-12-07 and before, a content's edge could merge otherwise
than in the whole, and a trimming template's contents went in untrimmed.) What the template renders
from other fields (a message's name, tool_calls, tool_call_id; chat_template_kwargs)
cannot be split out that way: such text holding a special token's text is refused.
"""

from __future__ import annotations

import asyncio
import re
import secrets
from concurrent.futures import ThreadPoolExecutor

from folio.worker.errors import InvalidRequestError
from folio.worker.sampling_params import check_token_ids

TOKENIZER_THREADS = 2


def plain_chat_prompt(messages: list[dict], add_generation_prompt: bool = True, continue_final: bool = False) -> str:
    """For tokenizers without a chat template: one `role: content` line per message, then `assistant:`
    (or, continuing the final message, up to its last character)."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text[:-1] if continue_final else text + "assistant:" * add_generation_prompt


class Prompts:
    def __init__(self, model_dir: str, max_model_len: int, vocab_size: int | None = None) -> None:
        from folio.worker.detokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)  # a checkpoint directory or a GGUF file
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size or len(self.tokenizer)
        self.max_token_chars = max([len(t) for t in self.tokenizer.get_vocab()] + [1])
        self._special = [t for t in self.tokenizer.all_special_tokens + list(self.tokenizer.added_tokens_encoder)
                         if t]
        self._special_re = re.compile("|".join(map(re.escape, self._special))) if self._special else None
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="folio-tokenize")

    async def run(self, fn, *args):
        """fn(*args) on the tokenizer threads."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    # ---- checks ------------------------------------------------------------------------
    def check_length(self, n_chars: int, param: str = "prompt") -> None:
        if n_chars > self.max_model_len * self.max_token_chars:
            raise InvalidRequestError(f"the prompt has {n_chars} characters: more than max_model_len "
                                      f"({self.max_model_len}) tokens whatever it tokenizes to", param=param)

    def token_ids(self, ids: list[int]) -> list[int]:
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return check_token_ids(ids, self.vocab_size)

    # ---- text --------------------------------------------------------------------------
    async def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        self.check_length(len(text))
        ids = await self.run(self.encode, text, add_special_tokens, False)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return ids

    def encode(self, text: str, add_special: bool, split_special: bool, param: str = "prompt") -> list[int]:
        try:
            return self.tokenizer(text, add_special_tokens=add_special, split_special_tokens=split_special).input_ids
        except (TypeError, ValueError) as e:  # e.g. a lone UTF-16 surrogate, which UTF-8 cannot hold
            raise InvalidRequestError(f"the prompt cannot be tokenized: {type(e).__name__}", param=param) from None

    # ---- chat --------------------------------------------------------------------------
    async def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True,
                       template_kwargs: dict | None = None, continue_final: bool = False) -> list[int]:
        """messages as openai_schema's `template_messages()` gives them (content a string; name,
        tool_calls, tool_call_id as transformers' templates expect); template_kwargs go to the template.
        `continue_final` ends the prompt inside the final message (an assistant's prefill, which the
        model continues: vLLM's continue_final_message), without a generation prompt."""
        if not messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        messages = developer_as_system(messages, getattr(self.tokenizer, "chat_template", None))
        extra = (self._extra(messages, template_kwargs) if len(messages) < 256 else  # (off the loop when long)
                 await asyncio.to_thread(self._extra, messages, template_kwargs))
        ids = await self.run(self._chat, messages, add_generation_prompt and not continue_final,
                             template_kwargs or {}, extra, continue_final)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="messages")
        return ids

    def _extra(self, messages: list[dict], template_kwargs: dict | None) -> list[list[str]]:
        """Each message's strings but its content, and the template kwargs', once the length is checked."""
        extra = [_strings(m, skip="content") for m in messages] + [_strings(template_kwargs or {})]
        self.check_length(sum(len(m["content"]) for m in messages) + sum(len(s) for e in extra for s in e), "messages")
        return extra

    def _chat(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict, extra: list[list[str]],
              continue_final: bool = False) -> list[int]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            # (reasoning_effort's switches are dropped, as a template that does not read them drops them)
            if any(m.get("tool_calls") for m in messages) or set(kwargs) - {"reasoning_effort", "enable_thinking"}:
                raise InvalidRequestError("this model has no chat template: tool_calls and chat_template_kwargs "
                                          "cannot be rendered", param="messages")
            return self.encode(plain_chat_prompt(messages, add_generation_prompt, continue_final), True, True,
                               "messages")
        if continue_final:  # transformers cuts its rendering after the final message's content
            kwargs = {**kwargs, "continue_final_message": True}
        # the template renders names, tool calls and kwargs itself: their text cannot be kept
        # apart from its markers, so one holding a special token's text is refused
        self._refuse_special([s for e in extra for s in e], "a message's name, tool_calls or tool_call_id, or "
                             "chat_template_kwargs,")
        whole = self._render(messages, add_generation_prompt, kwargs)
        if not any(self._holds_special(m["content"]) for m in messages):
            return self.encode(whole, False, False, "messages")  # transformers' own ids
        nonce = secrets.token_hex(8)
        marked = [i for i, m in enumerate(messages) if m["content"]]
        marks = {i: f"\x00{nonce}:{i}\x00" for i in marked}
        rendered = self._render([{**m, "content": marks.get(i, m["content"])} for i, m in enumerate(messages)],
                                add_generation_prompt, kwargs)
        pieces = re.split("\x00" + nonce + r":(\d+)\x00", rendered)
        # pieces: text, index, text, index, ..., text; each sentinel exactly once and in order
        contents = _contents(messages, pieces, marked, whole)
        if contents is None:
            raise InvalidRequestError("message content contains a special token's text, which this model's chat "
                                      "template cannot keep apart from its markers", param="messages")
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            if k % 2:
                ids += self.encode(contents[int(piece)], False, True, "messages")
            elif piece:
                ids += self.encode(piece, False, False, "messages")
        return ids

    def _holds_special(self, text: str) -> bool:
        return self._special_re is not None and self._special_re.search(text) is not None

    def _refuse_special(self, texts: list[str], what: str) -> None:
        if any(self._holds_special(t) for t in texts):
            raise InvalidRequestError(f"{what} contains a special token's text, which this model's chat "
                                      "template cannot keep apart from its markers", param="messages")

    def _render(self, messages: list[dict], add_generation_prompt: bool = True, kwargs: dict | None = None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **(kwargs or {}))
        except Exception as e:  # the template itself raised (a jinja error on these messages)
            why = str(e) if len(str(e)) <= 300 else str(e)[:300] + " ..."  # (some carry the whole rendering)
            raise InvalidRequestError(f"the chat template cannot render these messages: {why}",
                                      param="messages") from None

    # ---- text of token ids (logprobs) ---------------------------------------------------
    def decode_each(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]


def _contents(messages: list[dict], pieces: list[str], marked: list[int], whole: str) -> dict[int, str] | None:
    """Each marked message's content as the template put it in (`whole`, its rendering of the messages):
    verbatim, or stripped (Llama 3's template trims each content); None when it is neither, or when a
    sentinel was dropped or repeated."""
    if [int(i) for i in pieces[1::2]] != marked:
        return None
    for shape in (str, str.strip):
        contents = {i: shape(messages[i]["content"]) for i in marked}
        if "".join(contents[int(p)] if k % 2 else p for k, p in enumerate(pieces)) == whole:
            return contents
    return None


def _strings(x, skip: str | None = None) -> list[str]:
    """Every string in a JSON value (keys too), but the top-level key `skip`."""
    stack = [x] if not isinstance(x, dict) else [v for k, v in x.items() if k != skip]
    out: list[str] = []
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def developer_as_system(messages: list[dict], template: str | None) -> list[dict]:
    """OpenAI's `developer` role (its clients' name for system messages since o1) as `system` where the
    chat template has no branch of its own for it, the system messages then merged into one at the start
    (some templates take a system message only there), as vLLM does: a template without one spelled
    `<|developer|>` out as plain text, 8 tokens of it (a differential test against vLLM, 2026-12-07)."""
    if not any(m["role"] == "developer" for m in messages) or any(q in (template or "") for q in ('"developer"',
                                                                                                 "'developer'")):
        return messages
    converted = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    systems = [m["content"] for m in converted if m["role"] == "system"]
    if len(systems) == 1 and converted[0]["role"] == "system":
        return converted
    return [{"role": "system", "content": "\n\n".join(c for c in systems if c)}] + [
        m for m in converted if m["role"] != "system"]
