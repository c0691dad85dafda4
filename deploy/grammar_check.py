"""A frontend's check of structured output's grammars, before admission: a spec the workers
could not compile is refused whole, here (400).

A spec already compiled is answered from the cache on the event loop. Others compile on a
small pool of threads (xgrammar lets go of the GIL), one compile per distinct spec however many
requests wait for it, and at most MAX_COMPILING distinct specs at once: past that a request is
told to retry (429). Before, every check, a cache hit too, queued behind every compile on one
thread, without a bound: a two-choice grammar waited 58.6 s behind 12 large schemas (an attack,
2026-12-07).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading

from folio.worker.errors import OverloadedError

THREADS = 2
MAX_COMPILING = 16


class GrammarChecks:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._grammars = None  # worker/guided.py's Grammars, made on a thread for the first spec
        self._made = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(THREADS, thread_name_prefix="folio-grammar")
        self._compiling: dict = {}  # spec -> the future of its compile

    async def check(self, spec, params=None) -> None:
        """Returns when `spec` compiles and leaves the request (`params`) a first token; InvalidRequestError
        when it does not; OverloadedError when MAX_COMPILING other specs are compiling."""
        if params is not None and (params.allowed_token_ids is not None or params.bad_words_token_ids):
            await self.check(spec)  # compiled (or refused) first, then its first tokens, on the pool
            await asyncio.get_running_loop().run_in_executor(self._pool, self._grammars.check_first_token, params)
            return
        if self._grammars is not None and self._grammars.cached(spec) is not None:
            return
        fut = self._compiling.get(spec)
        if fut is None:
            if len(self._compiling) >= MAX_COMPILING:
                raise OverloadedError(f"{len(self._compiling)} grammars are compiling: retry later")
            fut = self._compiling[spec] = asyncio.get_running_loop().run_in_executor(self._pool, self._compile, spec)
            fut.add_done_callback(lambda _: self._compiling.pop(spec, None))
        await asyncio.shield(fut)  # (a waiter that leaves does not cancel the others' compile)

    def _compile(self, spec) -> None:
        with self._made:
            if self._grammars is None:
                from folio.worker.guided import Grammars
                self._grammars = Grammars(self.tokenizer, self.vocab_size)
        self._grammars.compiled(spec)
