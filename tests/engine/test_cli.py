"""The `folio` command: make-tiny-model output loads in transformers; generate runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from folio.deploy.cli import build_parser


def test_parser_knows_the_commands():
    args = build_parser().parse_args(["make-tiny-model", "d", "--arch", "qwen2", "--num-kv-heads", "1"])
    assert (args.command, args.arch, args.num_kv_heads) == ("make-tiny-model", "qwen2", 1)


def test_serve_stream_interval_is_at_least_one(capsys):
    assert build_parser().parse_args(["serve", "--model", "m", "--stream-interval", "8"]).stream_interval == 8
    assert build_parser().parse_args(["serve", "--model", "m"]).stream_interval == 1
    for bad in ("0", "-3", "two"):
        try:
            build_parser().parse_args(["serve", "--model", "m", "--stream-interval", bad])
        except SystemExit as e:
            assert e.code == 2 and "--stream-interval" in capsys.readouterr().err
        else:
            raise AssertionError(f"--stream-interval {bad} was taken")


def test_make_tiny_model_and_generate(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    d = str(tmp_path / "m")
    subprocess.run([sys.executable, "-m", "folio.deploy.cli", "make-tiny-model", d, "--arch", "mistral",
                    "--vocab-size", "600", "--seed", "5"], check=True, env=env, capture_output=True)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    assert type(model).__name__ == "MistralForCausalLM" and len(tok) == model.config.vocab_size
    assert tok.decode(tok("def f(x): return x").input_ids, skip_special_tokens=True) == "def f(x): return x"
    r = subprocess.run([sys.executable, "-m", "folio.deploy.cli", "generate", "--model", d, "--json",
                        "--max-tokens", "5", "--ignore-eos", "hello", "world"],
                       check=True, env=env, capture_output=True, text=True)
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["hello", "world"]
    assert all(len(x["outputs"][0]["token_ids"]) == 5 for x in lines)
    bad = subprocess.run([sys.executable, "-m", "folio.deploy.cli", "generate", "--model", d,
                          "--max-tokens", "0", "hello"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "max_tokens" in bad.stderr
