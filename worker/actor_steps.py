"""Part of EngineWorker (actor.py): the step thread. It alone touches the engine: it runs
the commands the event loop sends it between two steps, steps the engine, and hands each
step's chunks to the event loop in one hop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import threading
import time
import traceback
from typing import Any, Callable

from folio.worker.errors import InvalidRequestError, RequestFailedError, UnavailableError, WorkerFailedError
from folio.worker.messages import CompletionDelta, FinishReason, GenerateRequest, StreamChunk
from folio.worker.outbox import Route

log = logging.getLogger("folio.worker")
WATCH_PERIOD_S = 1.0  # how often the watchdog looks at the step running


def _name_os_thread(name: bytes) -> None:
    """The calling thread's name as the OS shows it (Linux prctl PR_SET_NAME, 15 bytes)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _request_error(why: str, param: str | None = None) -> Exception:
    """A fault traced to one request (fault_isolation.describe's line): its own bad input
    found in the step (a grammar) stays a 400 naming the field it came in; anything else is the engine's 500."""
    head = f"{InvalidRequestError.__module__}.{InvalidRequestError.__name__}: "
    line = why.split(" failed in the engine: ", 1)[-1]  # (after the engine's "request X failed in the engine: ")
    if line.startswith(head):
        return InvalidRequestError(line[len(head):], param=param or "response_format")
    return RequestFailedError(why)


class StepLoop:
    def _send(self, fn: Callable) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        self._io.kick()
        return fut

    async def _call(self, fn: Callable):
        if self.failed:
            raise UnavailableError(f"worker {self.worker_id} failed: {self.failed}")
        return await asyncio.wrap_future(self._send(fn))

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    result = fn(self.engine)
                except BaseException as e:  # the caller gets it; the engine is unchanged (its contract)
                    self._flush_out()
                    fut.set_exception(e)
                else:
                    self._flush_out()  # what the command put goes out before its caller resumes
                    fut.set_result(result)

    def _add(self, e, rid: str, req: GenerateRequest, arrival: float | None) -> None:
        if self._tombstones.take(rid, req.arrival_time):  # its abort came first: it ends before it starts
            ended = CompletionDelta(index=0, token_ids=[], text="", num_tokens=0, finish_reason=FinishReason.ABORT)
            self._put(rid, StreamChunk(request_id=rid, worker_id=self.worker_id, deltas=[ended], finished=True))
            return
        e.add_request(rid, req.prompt_token_ids, req.params, priority=req.priority, arrival_time=arrival,
                      output_kind="delta")
        self.num_prompt_tokens += len(req.prompt_token_ids)
        self._tombstones.seen(rid)

    def _abort(self, rid: str) -> bool:
        if not self.engine.abort(rid) and self._moving.pop(rid, None) is None:
            self._tombstones.abort_unknown(rid)  # an abort that overtook its request still wins
            return False
        sent = self._sent.get(rid, {0: 0})
        deltas = [CompletionDelta(index=i, token_ids=[], text="", num_tokens=n, finish_reason=FinishReason.ABORT)
                  for i, n in sorted(sent.items()) or [(0, 0)]]
        self._put(rid, StreamChunk(request_id=rid, worker_id=self.worker_id, deltas=deltas, finished=True))
        return True

    def _put(self, rid: str, item) -> None:
        """Queue `item` for the request's stream. The step thread's items go to the event loop
        together, once per step (and after each command); anyone else's at once. Either way
        they reach the loop in the order they were put."""
        if threading.current_thread() is self._step_thread:
            self._out.append((rid, item))
        else:
            self._post([(rid, item)])

    def _flush_out(self) -> None:
        """The step thread's items to their streams: a request streamed over a TCP connection
        into its Outbox, which the step thread sends itself; any other's through the event loop."""
        if self._out:
            items, self._out, rest = self._out, [], []
            for rid, item in items:
                sink = self._streams.get(rid)
                if isinstance(sink, Route) and sink.direct and sink.box.conn is not None:
                    sink.put_nowait(item)
                else:
                    rest.append((rid, item))
            if rest:
                self._post(rest)
        if threading.current_thread() is self._step_thread:
            self._io.flush()

    def _post(self, items: list) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._deliver, items)
            except RuntimeError:  # the event loop is gone (an in-process worker outliving it)
                pass

    def _deliver(self, items: list) -> None:
        for rid, item in items:
            q = self._streams.get(rid)
            if q is not None:
                q.put_nowait(item)

    def _step_loop(self, engine_factory: Callable[[], Any], built: concurrent.futures.Future) -> None:
        # OpenMP's thread count is per OS thread, and a new thread starts from OMP_NUM_THREADS,
        # which Ray sets to the actor's num_cpus (1 for a fractional CPU): without this the
        # forward ran on one core, at half speed, while torch.get_num_threads() said 2.
        import torch

        torch.set_num_threads(torch.get_num_threads())
        _name_os_thread(b"folio-step")  # top -H names it; OpenMP's threads started from it inherit the name
        self._step_thread = threading.current_thread()
        # The engine is built here, on the thread that runs it: an engine loaded (and its
        # linear layers warmed up) on another thread left that thread's OpenMP pool beside
        # this one's, and every step ran 10-15 % slower (benchmarks/step_thread.py).
        try:
            self.engine = engine = engine_factory()
        except BaseException as e:
            self._io.close()
            built.set_exception(e)
            return
        built.set_result(None)
        next_beat = 0.0
        while not self._stop:
            self._run_commands()
            self._io.poll(0, self._queued)  # the frontends' frames that came during the last step
            if self.failed is None and engine.has_unfinished_requests():
                self._step_started = time.monotonic()
                try:
                    outs = engine.step()
                except Exception:
                    self._fail(traceback.format_exc())
                    continue
                finally:
                    self._step_started = None
                if self.failed is not None:  # the watchdog failed the worker while this step was stuck
                    continue
                for out in outs:
                    if out.error is not None:  # the engine failed this request alone (fault_isolation.py)
                        self._put(out.request_id, _request_error(out.error, out.error_param))
                    else:
                        self._dispatch(out)
                self._flush_out()  # the whole step's chunks: sent from here, or one hop to the event loop
            else:  # idle: asleep in the selector until a frame, a command or the next beat
                self._io.poll(0.05, self._queued)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + self.heartbeat_s
                self._offer_load()
        self._io.close()

    def _queued(self) -> bool:
        return not self._commands.empty()

    def _dispatch(self, out) -> None:
        sent = self._sent.get(out.request_id)
        if sent is None:  # its reader left (the abort it sent is on its way): nothing to stream
            return
        deltas = []
        for c in out.outputs:
            n = sent.get(c.index, 0) + len(c.token_ids)
            sent[c.index] = n
            deltas.append(CompletionDelta(index=c.index, token_ids=list(c.token_ids), text=c.text, num_tokens=n,
                                          finish_reason=c.finish_reason, logprobs=c.logprobs,
                                          stop_reason=c.stop_reason))
        m = out.metrics
        npre = m.num_preemptions if m is not None else 0
        queue_s = None
        if m is not None and m.first_scheduled_time is not None and not any(sent.get(c.index, 0) > len(c.token_ids)
                                                                            for c in out.outputs):
            queue_s = m.first_scheduled_time - m.arrival_time  # the request's first chunk
        self._put(out.request_id, StreamChunk(request_id=out.request_id, worker_id=self.worker_id, deltas=deltas,
                                              finished=out.finished, migrated_to=None, num_preemptions=npre,
                                              queue_s=queue_s, prompt_logprobs=out.prompt_logprobs))

    def _fail(self, tb: str) -> None:
        """The engine raised inside a step: its state cannot be trusted. Every request fails
        with a clear error, the worker refuses new ones, and its heartbeat stops."""
        self.failed = tb.strip().splitlines()[-1]
        log.error("worker %s failed:\n%s", self.worker_id, tb)
        err = WorkerFailedError(f"worker {self.worker_id} failed: {self.failed}")
        for rid in list(self._streams):
            self._put(rid, err)
        self._flush_out()
        while True:  # commands still queued (a step thread stuck for good never takes them)
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(UnavailableError(f"worker {self.worker_id} failed: {self.failed}"))
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake_arrivals)
            except RuntimeError:
                pass
        if self.exit_on_failure_s is not None:  # the cluster restarts this process with a new engine
            t = threading.Timer(self.exit_on_failure_s, os._exit, args=(1,))
            t.daemon = True
            t.start()

    def _watch(self) -> None:
        """The step watchdog (a thread of its own): a step running longer than STEP_STALL_S is
        stuck (a grammar that never finishes evaluating a token, a kernel that hangs) and cannot
        be interrupted. Its requests fail with a clear error (a request whose grammar was being
        evaluated is blamed alone: 400), then the worker fails, so that the cluster restarts its
        process (exit_on_failure_s) and the router stops sending it work meanwhile."""
        while not self._stop and self.failed is None:
            time.sleep(WATCH_PERIOD_S)
            started = self._step_started
            if started is None or time.monotonic() - started <= self.STEP_STALL_S:
                continue
            why = f"a step ran longer than {self.STEP_STALL_S:g} s"
            seq = getattr(getattr(self.engine, "grammars", None), "evaluating", None)
            if seq is not None:
                from folio.worker.guided import TOO_AMBIGUOUS  # (loaded already: a grammar was running)

                rid, kind = seq.group.request_id, seq.params.guided.kind.replace("_", " ")
                why += f" evaluating the grammar of request {rid}"
                self._put(rid, InvalidRequestError(f"the request's {kind} {TOO_AMBIGUOUS}: one token took "
                                                   f"longer than {self.STEP_STALL_S:g} s, and the worker running "
                                                   f"it restarts", param=seq.params.guided.param))
            self._fail(why)
            return

    def _wake_arrivals(self) -> None:
        for evs in self._arrivals.values():
            for ev in evs:
                ev.set()
