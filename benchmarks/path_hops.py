"""Where one request's milliseconds go between the hops of `folio serve` (issue #15: the path
adds < 2 ms over gRPC), timed on one clock across its processes.

    python benchmarks/path_hops.py --model models/tiny-llama-8l [--api grpc|http] [--requests 300]
        [--runs 1] [--fine] [--out benchmarks/results/path_hops.json]

`folio serve --num-workers 1` (its default router), then one-token requests (16-token prompt,
greedy) one at a time, 2 ms apart: gRPC `Generate`, or an HTTP completion by a minimal client
(frontend_overhead.RawHttp: one keep-alive connection, the JSON body, the response parsed). No product code is changed: a
`sitecustomize` put on PYTHONPATH (which Ray's workers inherit) wraps, as each module is
imported, the functions at the hops, and each process appends `time.monotonic_ns()` stamps to
a file of its own (CLOCK_MONOTONIC is one clock for every process of the machine):

    R0 handler      GenerationServicer.Generate entered (replica); over HTTP, openai_http.completions
    R2 picked       Router.pick returned
    R3 submit sent  the command frame written to the worker's connection
    W0 frame in     the worker read it (its event loop; since step_io.py, its step thread)
    W1 added        the request added on the step thread (EngineWorker._add)
    W3 step start   LLMEngine.step entered (the forward and sampling, to W4)
    W4 step end     LLMEngine.step returned
    W5 on loop      the step's chunks reach the worker's event loop (_deliver; gone since
                    step_io.py: the step thread sends them itself)
    W6 chunk sent   the chunk frame written
    R4 chunk in     the replica read it
    R6 response     Generate returned (grpc then sends it); over HTTP, completions returned (then
                    the response is serialized and sent)

Each request's stamps are read within its client window, and the table gives each stamp's
p50 offset from the client's send and the p50 of the gaps between consecutive stamps; "path"
is the client's time less the step's (W3 -> W4). The stamps themselves cost each ~2-5 us (a
line-buffered write). Results: --out.
"""

from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "deploy", "proto"))

# (module, qualified name, stamp on entry or None, stamp on return or None); "frame" stamps
# name the frame by its kind (a command batch, a reply, chunks) and the process's role.
HOOKS = [
    ("folio.deploy.grpc_servicer", "GenerationServicer.Generate", "R0 handler", "R6 response"),
    ("folio.deploy.openai_http", "completions", "R0 handler", "R6 response"),
    ("folio.cluster.router", "Router.pick", None, "R2 picked"),
    ("folio.worker.data_plane", "write_frame", None, "frame out"),
    ("folio.worker.data_plane", "read_frame", None, "frame in"),
    ("folio.worker.actor_steps", "StepLoop._add", None, "W1 added"),
    ("folio.worker.engine", "LLMEngine.step", "W3 step start", "W4 step end"),
    ("folio.worker.actor_steps", "StepLoop._deliver", "W5 on loop", None),
    # since the step thread owns the worker's end of the connection (worker/step_io.py)
    ("folio.worker.actor_channel", "FrontendChannels._apply_frame", "W0 frame in", None),
    ("folio.worker.step_io", "frame_bytes", None, "frame bytes"),
]

# --fine: the replica's own steps between the handler and the submit, and between the chunk
# and the response (each stamp costs ~2-5 us)
FINE_HOOKS = [
    ("folio.deploy.frontend", "Frontend.check", "R1a check", "R1b checked"),
    ("folio.deploy.stream_text", "StreamText.__init__", None, "R1c text ready"),
    ("folio.cluster.router", "Router._claim", "R1d claim", None),
    ("folio.cluster.channel", "Channel.send", None, "R2b queued"),
    ("folio.cluster.channel", "Inbox.put", None, "R5a inbox"),
    ("folio.deploy.stream_text", "StreamText.apply", "R5b text", None),
]

SITE = r'''
import os, sys, time, functools, inspect, importlib.abc, importlib.machinery
_DIR = os.environ["FOLIO_HOPS_DIR"]
_HOOKS = %r
_f = None
def _stamp(name):
    global _f
    if _f is None:
        _f = open(os.path.join(_DIR, "hops-%%d.txt" %% os.getpid()), "a", buffering=1)
    _f.write("%%d %%s\n" %% (time.monotonic_ns(), name))
def _frame_name(out, value):
    if out:  # write_frame(writer, obj)
        kind = value[0]
        return {"c": "W6 chunk sent", "r": "W2 reply sent", "e": "W2 reply sent"}.get(kind, "R3 submit sent")
    kind = value[0]
    return {"c": "R4 chunk in", "r": "R4 reply in", "e": "R4 reply in"}.get(kind, "W0 frame in")
def _wrap(fn, enter, leave):
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def w(*a, **k):
            if enter: _stamp(enter)
            r = await fn(*a, **k)
            if leave == "frame in": _stamp(_frame_name(False, r))
            elif leave: _stamp(leave)
            return r
        return w
    @functools.wraps(fn)
    def w(*a, **k):
        if enter: _stamp(enter)
        r = fn(*a, **k)
        if leave == "frame out": _stamp(_frame_name(True, a[1]))
        elif leave == "frame bytes": _stamp(_frame_name(True, a[0]))
        elif leave: _stamp(leave)
        return r
    return w
def _patch(mod):
    for m, qual, enter, leave in _HOOKS:
        if m != mod.__name__:
            continue
        owner, parts = mod, qual.split(".")
        for p in parts[:-1]:
            owner = getattr(owner, p, None)
        if owner is None or not hasattr(owner, parts[-1]):  # (code before or after that hop existed)
            continue
        setattr(owner, parts[-1], _wrap(getattr(owner, parts[-1]), enter, leave))
class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in {h[0] for h in _HOOKS}:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                loader = spec.loader
                orig = loader.exec_module
                def exec_module(module, orig=orig):
                    orig(module)
                    _patch(module)
                loader.exec_module = exec_module
                return spec
        return None
sys.meta_path.insert(0, _Finder())
'''

ORDER = ["R0 handler", "R2 picked", "R3 submit sent", "W0 frame in", "W1 added", "W3 step start", "W2 reply sent",
         "R4 reply in", "W4 step end", "W5 on loop", "W6 chunk sent", "R4 chunk in", "R6 response"]


def one_run(model: str, requests: int, api: str = "grpc", fine: bool = False) -> dict:
    from frontend_overhead import RawHttp
    from request_timeline import PROMPT, client_call
    from serve_local import start_server, stop_server

    stamps = tempfile.mkdtemp(prefix="folio-hops-")
    site = tempfile.mkdtemp(prefix="folio-hops-site-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITE % (HOOKS + (FINE_HOOKS if fine else []),))
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "FOLIO_HOPS_DIR")}
    os.environ["FOLIO_HOPS_DIR"] = stamps
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, saved["PYTHONPATH"]) if p)
    windows = []
    try:
        server, http, grpc_port = start_server(model, 1, "--served-model-name", "m")
    except BaseException:
        shutil.rmtree(stamps, ignore_errors=True)
        shutil.rmtree(site, ignore_errors=True)
        raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        if api == "grpc":
            call = client_call("grpc", http, grpc_port)
        else:
            raw = RawHttp(http)
            call = lambda: raw.complete("m", PROMPT)  # noqa: E731
        for _ in range(60):
            call()
        for _ in range(requests):
            t0 = time.monotonic_ns()
            call()
            windows.append((t0, time.monotonic_ns()))
            time.sleep(0.002)
    finally:
        stop_server(server)
    events = []
    files = glob.glob(os.path.join(stamps, "hops-*.txt"))
    for path in files:
        with open(path) as f:
            for line in f:
                t, name = line.rstrip("\n").split(" ", 1)
                events.append((int(t), name))
    shutil.rmtree(stamps, ignore_errors=True)
    shutil.rmtree(site, ignore_errors=True)
    events.sort()
    times = [t for t, _ in events]
    offsets: dict[str, list[float]] = {}
    totals, paths, steps = [], [], []
    for a, b in windows:
        seen: dict[str, float] = {}
        for t, name in events[bisect.bisect_left(times, a):bisect.bisect_right(times, b)]:
            seen.setdefault(name, (t - a) / 1e6)  # the first of each in the window
        for name, ms in seen.items():
            offsets.setdefault(name, []).append(ms)
        total = (b - a) / 1e6
        totals.append(total)
        if "W3 step start" in seen and "W4 step end" in seen:
            steps.append(seen["W4 step end"] - seen["W3 step start"])
            paths.append(total - steps[-1])
    missing = [n for n in ORDER if n not in offsets and n != "W5 on loop"]  # (no W5 since step_io.py)
    if missing or len(files) < 2:
        raise SystemExit(f"stamps missing ({missing}, {len(files)} processes wrote): did PYTHONPATH reach Ray's workers?")
    order = ORDER + sorted((n for n in offsets if n not in ORDER), key=lambda n: statistics.median(offsets[n]))
    p50 = {n: round(statistics.median(offsets[n]), 3) for n in order if n in offsets}
    return {"api": api, "requests": requests, "client_p50_ms": round(statistics.median(totals), 3),
            "path_p50_ms": round(statistics.median(paths), 3),
            "step_p50_ms": round(statistics.median(steps), 3),
            "offset_p50_ms": p50, "seen_in": {n: len(offsets[n]) for n in order if n in offsets}}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--api", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--fine", action="store_true", help="also the replica's own steps (FINE_HOOKS)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "path_hops.json"))
    args = ap.parse_args()
    runs = []
    for _ in range(args.runs):
        r = one_run(args.model, args.requests, args.api, args.fine)
        runs.append(r)
        print(f"client p50 {r['client_p50_ms']:.3f} ms, step {r['step_p50_ms']:.3f}, path (client - step) "
              f"{r['path_p50_ms']:.3f}")
        prev = 0.0
        for n in sorted(r["offset_p50_ms"], key=r["offset_p50_ms"].get):
            ms = r["offset_p50_ms"][n]
            print(f"  {ms:8.3f}  (+{ms - prev:6.3f})  {n}")
            prev = ms
    out = {"benchmark": "path_hops", "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": "python benchmarks/path_hops.py " + " ".join(sys.argv[1:]), "cpus": os.cpu_count(),
           "runs": runs}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
