"""`folio serve --tensor-parallel-size 2` as a user runs it: one worker whose model is sharded
over two ranks (two logical GPUs on this CPU), answering the OpenAI API with the text one
rank gives, the second rank a Ray actor (in the worker's placement group) that ends with the server."""

from __future__ import annotations

import json
import os
import urllib.request

import psutil

from folio.worker import LLM, SamplingParams
from conftest import PROMPTS, folio_serve

MAX_TOKENS = 24


def complete(server, prompt: str) -> dict:
    body = {"model": os.path.basename(server["model"]), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True}
    req = urllib.request.Request(server["http"] + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def test_folio_serve_with_a_tp2_worker_answers_as_one_rank(model_dirs):
    model = model_dirs["qwen2"]
    expected = [o.outputs[0].text for o in LLM(model, block_size=8, num_kv_blocks=128).generate(
        PROMPTS[:2], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))]
    with folio_serve(model, "--num-workers", "1", "--tensor-parallel-size", "2", "--block-size", "8",
                     "--num-kv-blocks", "128", "--namespace", "fetp", "--grace-period-s", "1") as server:
        followers = [p for p in psutil.Process(server["pid"]).children(recursive=True)  # Ray's workers too
                     if "RankActor" in " ".join(p.cmdline())]
        assert len(followers) == 1, "the worker's second rank is not running"
        got = [complete(server, p)["choices"][0]["text"] for p in PROMPTS[:2]]
    assert got == expected
    psutil.wait_procs(followers, timeout=30)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in followers), "a rank outlived serve"
