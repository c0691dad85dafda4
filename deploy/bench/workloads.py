"""Workloads for `folio bench`: what to send. Prompts are text (so the same workload
runs against any OpenAI-compatible server, vLLM's included), built from a seeded
pseudo-word vocabulary; lengths are in words (1-4 tokens each, by tokenizer; the report
uses the token counts the server returns). With unit="tokens" (random, burst and
shared-prefix) a prompt is a list of token ids drawn from id_range, so its length is
exact on any server of the same vocabulary (as vLLM's `bench serve --dataset-name random`).

    random         lengths from fixed / uniform / long-tailed (log-normal) distributions
    shared-prefix  N prefixes x M suffixes (prefix caching, prefix-aware routing)
    multi-turn     sessions whose conversation grows turn by turn (each turn waits for
                   the previous answer and sends the whole conversation again)
    burst          many long requests at t=0, past the KV cache (forces preemption)
    sharegpt       a ShareGPT-format JSON file: first human turn -> prompt, the answer's
                   length -> max_tokens
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

WORKLOADS = ("random", "shared-prefix", "multi-turn", "burst", "sharegpt")


@dataclass
class Turn:
    text: str | list[int]  # what the user adds in this turn (the whole prompt for a one-turn job)
    max_tokens: int


@dataclass
class Job:
    """One arrival: a single request, or a multi-turn session run turn by turn."""

    turns: list[Turn]
    at_once: bool = False  # burst: sent at t=0 whatever the arrival process says
    group: int | None = None  # shared-prefix group


@dataclass
class Workload:
    name: str
    jobs: list[Job] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(j.turns) for j in self.jobs)


def parse_dist(spec: str):
    """'fixed:N' | 'uniform:A-B' | 'lognormal:MEDIAN,SIGMA[,MAX]' -> a sampler rng -> int >= 1."""
    kind, _, arg = spec.partition(":")
    try:
        if kind == "fixed":
            n = int(arg)
            return lambda rng: max(n, 1)
        if kind == "uniform":
            a, b = (int(x) for x in arg.split("-"))
            if a > b:
                raise ValueError
            return lambda rng: max(rng.randint(a, b), 1)
        if kind == "lognormal":
            parts = [float(x) for x in arg.split(",")]
            median, sigma = parts[0], parts[1]
            cap = int(parts[2]) if len(parts) > 2 else int(median * 20)
            return lambda rng: min(max(int(rng.lognormvariate(math.log(median), sigma)), 1), cap)
    except (ValueError, IndexError):
        pass
    raise ValueError(f"bad length distribution {spec!r}: fixed:N, uniform:A-B or lognormal:MEDIAN,SIGMA[,MAX]")


class Words:
    """A seeded vocabulary of pseudo-words: cheap, reproducible text of a chosen length."""

    def __init__(self, seed: int = 0, size: int = 4000) -> None:
        rng = random.Random(seed)
        syl = ["ka", "lo", "mi", "ten", "ra", "su", "vel", "dor", "pi", "an", "ex", "qua", "zo", "ri", "mon", "tal"]
        self.vocab = sorted({"".join(rng.choice(syl) for _ in range(rng.randint(1, 3))) for _ in range(size)})

    def text(self, rng: random.Random, n: int) -> str:
        return " ".join(rng.choice(self.vocab) for _ in range(n))


class TokenIds:
    """Random token ids in [lo, hi): prompts of an exact token length, no tokenizer needed."""

    def __init__(self, lo: int, hi: int) -> None:
        if not 0 <= lo < hi:
            raise ValueError(f"bad token id range {lo}-{hi}")
        self.lo, self.hi = lo, hi

    def text(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(self.lo, self.hi) for _ in range(n)]


def _join(head, tail):
    """A shared prefix and its suffix: list concatenation for token ids, a space between words."""
    return head + tail if isinstance(head, list) else head + " " + tail


def parse_id_range(spec: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in spec.split("-"))
        return lo, hi
    except ValueError:
        raise ValueError(f"bad token id range {spec!r}: LO-HI (HI excluded)") from None


def build(name: str, num_requests: int, seed: int = 0, input_len: str = "uniform:32-256",
          output_len: str = "uniform:32-128", prefixes: int = 4, prefix_len: int = 256, turns: int = 4,
          sharegpt_path: str | None = None, unit: str = "words", id_range: tuple[int, int] = (1000, 8000)) -> Workload:
    rng = random.Random(seed)
    if unit == "tokens":
        if name in ("multi-turn", "sharegpt"):
            raise ValueError(f"the {name} workload is text: use --input-unit words")
        words = TokenIds(*id_range)
    elif unit == "words":
        words = Words(seed)
    else:
        raise ValueError(f"unknown input unit {unit!r}: words or tokens")
    inp, out = parse_dist(input_len), parse_dist(output_len)
    w = Workload(name)
    if name == "random":
        w.jobs = [Job([Turn(words.text(rng, inp(rng)), out(rng))]) for _ in range(num_requests)]
    elif name == "shared-prefix":
        heads = [words.text(rng, prefix_len) for _ in range(prefixes)]
        w.jobs = [Job([Turn(_join(heads[i % prefixes], words.text(rng, inp(rng))), out(rng))], group=i % prefixes)
                  for i in range(num_requests)]
    elif name == "multi-turn":
        sessions = max(num_requests // turns, 1)
        w.jobs = [Job([Turn(words.text(rng, inp(rng)), out(rng)) for _ in range(turns)]) for _ in range(sessions)]
    elif name == "burst":
        w.jobs = [Job([Turn(words.text(rng, inp(rng)), out(rng))], at_once=True) for _ in range(num_requests)]
    elif name == "sharegpt":
        if not sharegpt_path:
            raise ValueError("the sharegpt workload needs --dataset PATH")
        w.jobs = sharegpt(sharegpt_path, num_requests, rng)
    else:
        raise ValueError(f"unknown workload {name!r}: one of {WORKLOADS}")
    return w


def sharegpt(path: str, n: int, rng: random.Random) -> list[Job]:
    with open(path) as f:
        data = json.load(f)
    jobs = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) >= 2 and turns[0].get("value") and turns[1].get("value"):
            jobs.append(Job([Turn(turns[0]["value"], max(len(turns[1]["value"].split()), 1))]))
    if not jobs:
        raise ValueError(f"{path}: no conversation with a human turn and an answer")
    rng.shuffle(jobs)
    return (jobs * (n // len(jobs) + 1))[:n]
