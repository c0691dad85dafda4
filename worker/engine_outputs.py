"""Part of LLMEngine (engine.py): after the forward, a step's postprocess. Forks the n
completions of a request whose prompt is done, appends each sampled token (detokenizing,
checking stops and grammars), fails the requests a fault was traced to, and makes the
outputs of the requests that changed."""

from __future__ import annotations

import time

import torch

from folio.worker import fault_isolation
from folio.worker.errors import InvalidRequestError
from folio.worker.outputs import make_request_output
from folio.worker.sampler import NO_TOKEN
from folio.worker.sequence import CompletionOutput, RequestOutput, Sequence, SequenceGroup


class Postprocess:
    def _fork(self, to_sample: list[Sequence], logits: torch.Tensor,
              blamed: dict[str, str] | None = None) -> tuple[list[Sequence], torch.Tensor]:
        """A request with n > 1 forks its completions when its prompt's prefill completes;
        the children sample from the parent's logits row. A request whose fork raises is
        blamed (and left unforked: nothing changed) when `blamed` is given."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        for r, seq in enumerate(to_sample):
            group = seq.group
            gens: list = []
            if not group.forked:
                try:  # everything that can fail comes before the first change
                    gens = [group.make_generator(i) for i in range(1, group.params.n)]
                except Exception as e:
                    if blamed is None:
                        raise
                    blamed[group.request_id] = fault_isolation.describe(e)
                    continue
            rows.append(r)
            seqs.append(seq)
            if not group.forked:
                group.forked = True
                for i, gen in zip(range(1, group.params.n), gens):
                    child = Sequence(group, i, seq.token_ids)
                    child.generator = gen
                    child.num_computed_tokens = seq.num_computed_tokens
                    group.seqs.append(child)
                    if self.kv.fork(seq, child):
                        self.scheduler.add_running(child)
                        rows.append(r)
                        seqs.append(child)
                    else:  # no room to share: it waits and recomputes, sampling then
                        self.scheduler.requeue(child)
        if len(rows) != len(to_sample):
            logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
        return seqs, logits

    def _apply_samples(self, seqs: list[Sequence], result, blamed: dict[str, str] | None = None) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, SequenceGroup] = {}
        for seq, token, lp in zip(seqs, result.token_ids, result.logprobs):
            group = seq.group
            if blamed and group.request_id in blamed:
                continue
            try:
                self._append_token(seq, token, lp)
            except Exception as e:  # detokenizing or a stop check raised: this request's fault
                if blamed is None:
                    raise
                blamed[group.request_id] = fault_isolation.describe(e)
                touched.pop(group.request_id, None)
                continue
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            touched[group.request_id] = group
        self.num_generated_tokens += len(seqs)
        return self._make_outputs(touched.values(), now)

    def _append_token(self, seq: Sequence, token: int, logprob: dict[int, float] | None) -> None:
        p = seq.params
        if token == NO_TOKEN:  # its row was empty: the request's own bad words ban all it allows
            raise InvalidRequestError(f"bad_words ban every token allowed_token_ids allows after "
                                      f"{seq.num_output_tokens} output tokens: no token to draw", param="bad_words")
        seq.token_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(logprob)
        reason = None
        if p.guided is not None:
            self.guided_grammars().accept(seq, token)
        # the grammar complete (it took its stop token), EOS, or one of stop_token_ids
        if (p.guided is not None and seq.grammar.is_terminated()) or (not p.ignore_eos and token in self.eos_token_ids):
            reason = "stop"
        elif token in p.stop_token_ids:
            reason, seq.stop_reason = "stop", token
        # a stop token's text is not the output's (vLLM's rule), unless include_stop_str_in_output
        if p.detokenize and self.detokenizer is not None and (reason is None or p.include_stop_str_in_output):
            stop = self.detokenizer.append_token(seq, token)  # no detokenizer: a runner without a tokenizer
            if reason is None and stop is not None:
                reason, seq.stop_reason = "stop", stop
        if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason = reason
            self.scheduler.finish(seq, reason)

    def _fail_requests(self, blamed: dict[str, str]) -> list[RequestOutput]:
        """End every blamed request now: blocks freed, a final output with `error` set."""
        outs = []
        for rid, why in blamed.items():
            group = self.groups.pop(rid, None)
            self.output_kinds.pop(rid, None)
            if group is None:
                continue
            for seq in group.seqs:
                if not seq.is_finished:
                    seq.finish_reason = "error"
                    self.scheduler.finish(seq, "error")
            group.forked = True
            group.metrics.finished_time = time.monotonic()
            done = [CompletionOutput(s.index, [], "", "error") for s in group.seqs]
            guided = group.params.guided
            param = getattr(why, "param", None) or (guided.param if guided is not None else None)
            outs.append(RequestOutput(rid, group.prompt, group.prompt_token_ids, done, True, group.metrics,
                                      error=f"request {rid} failed in the engine: {why}", error_param=param))
        return outs

    def _make_outputs(self, groups, now: float) -> list[RequestOutput]:
        outs = []
        for group in groups:
            kind = self.output_kinds.get(group.request_id, "final")
            out = make_request_output(group, kind)
            if out is None:
                continue
            if out.finished:
                group.metrics.finished_time = now
                self.groups.pop(group.request_id, None)
                self.output_kinds.pop(group.request_id, None)
            outs.append(out)
        return outs

