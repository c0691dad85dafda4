"""The report of `folio bench`: metrics as `vllm bench serve` reports them, Folio's own
counters from /metrics before and after, a summary table, JSON, PNG plots, and
`compare` for two result files.

Definitions (per request): TTFT = first streamed token - send; E2E = last byte - send;
TPOT = (E2E - TTFT) / (output tokens - 1); ITL = each gap between streamed chunks;
normalized latency = E2E / output tokens. Percentiles are numpy's (linear
interpolation). Goodput = requests/s that completed within every SLO given.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections import Counter

import numpy as np

from folio.deploy.bench.client import Record

STATS = ("mean", "median", "p90", "p99")
FOLIO_COUNTERS = ("folio_preemptions_total", "folio_swapped_out_blocks_total", "folio_swapped_in_blocks_total",
                  "folio_migrations_total", "folio_prefix_cache_queries_total", "folio_prefix_cache_hits_total",
                  "folio_generation_tokens_total")


def describe(xs: list[float]) -> dict | None:
    if not xs:
        return None
    a = np.asarray(xs, dtype=float)
    return {"mean": float(a.mean()), "median": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def parse_slo(spec: str | None) -> dict[str, float]:
    """'ttft=0.5,tpot=0.05,e2e=10' (seconds) -> {"ttft": 0.5, ...}."""
    out = {}
    for part in (spec or "").split(","):
        if part:
            k, _, v = part.partition("=")
            if k not in ("ttft", "tpot", "e2e") or not v:
                raise ValueError(f"bad SLO {part!r}: ttft=S, tpot=S, e2e=S")
            out[k] = float(v)
    return out


def tpot(r: Record) -> float | None:
    if r.latency is None or r.ttft is None or r.output_tokens < 2:
        return None
    return (r.latency - r.ttft) / (r.output_tokens - 1)


def summarize(records: list[Record], wall_s: float, slo: dict[str, float] | None = None) -> dict:
    ok = [r for r in records if r.error is None and r.latency is not None]
    slo = slo or {}

    def meets(r: Record) -> bool:
        vals = {"ttft": r.ttft, "tpot": tpot(r), "e2e": r.latency}
        return all(vals[k] is not None and vals[k] <= limit for k, limit in slo.items() if not
                   (k == "tpot" and r.output_tokens < 2))
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records), "completed": len(ok),
        "failed": len(records) - len(ok), "errors": dict(Counter(r.error for r in records if r.error)),
        "duration_s": wall_s, "request_throughput": len(ok) / wall_s if wall_s else 0.0,
        "output_throughput": out_tokens / wall_s if wall_s else 0.0,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / wall_s if wall_s else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
        "ttft_s": describe([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": describe([t for t in (tpot(r) for r in ok) if t is not None]),
        "itl_s": describe([g for r in ok for g in r.itl]),
        "e2e_s": describe([r.latency for r in ok]),
        "normalized_latency_s": describe([r.latency / r.output_tokens for r in ok if r.output_tokens]),
        "slo": slo, "goodput": (sum(1 for r in ok if meets(r)) / wall_s if wall_s else 0.0) if slo else None,
    }


# ---- Folio's /metrics ----------------------------------------------------------------------
def scrape(url: str, api_key: str | None = None) -> dict[str, float]:
    """Sum of each folio_* sample over its labels (and the max KV usage over workers)."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # /metrics needs the key too
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("folio_"):
                if s.name == "folio_kv_cache_usage_ratio":
                    out[s.name] = max(out.get(s.name, 0.0), s.value)
                else:
                    out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class MetricsPoller:
    """Samples /metrics every `interval_s` during a run: the timeline for the plots and the
    counters before and after. A target without Folio's metrics gives an empty timeline."""

    def __init__(self, url: str | None, interval_s: float = 0.5, api_key: str | None = None) -> None:
        self.url, self.interval_s, self.api_key = url, interval_s, api_key
        self.timeline: list[dict] = []
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}
        self._task = None
        self._t0 = 0.0

    async def _sample(self) -> dict[str, float]:
        try:
            return await asyncio.to_thread(scrape, self.url, self.api_key)
        except Exception:
            return {}

    async def start(self) -> None:
        if not self.url:
            return
        self._t0 = time.perf_counter()
        self.before = await self._sample()

        async def loop():
            while True:
                m = await self._sample()
                if m:
                    self.timeline.append({"t": time.perf_counter() - self._t0,
                                          "running": m.get("folio_requests_running", 0.0),
                                          "kv_usage": m.get("folio_kv_cache_usage_ratio", 0.0)})
                await asyncio.sleep(self.interval_s)
        self._task = asyncio.create_task(loop())

    async def stop(self, settle_s: float = 0.35) -> dict | None:
        """The counters' change over the run. Workers publish them with their heartbeat
        (~100 ms), so the last scrape waits `settle_s` for the run's last tokens to land."""
        if not self.url:
            return None
        self._task.cancel()
        await asyncio.sleep(settle_s)
        self.after = await self._sample()
        if not self.after:
            return None
        delta = {k.removeprefix("folio_").removesuffix("_total"): self.after.get(k, 0.0) - self.before.get(k, 0.0)
                 for k in FOLIO_COUNTERS}
        q = delta.get("prefix_cache_queries", 0.0)
        delta["prefix_cache_hit_rate"] = delta.get("prefix_cache_hits", 0.0) / q if q else None
        delta["peak_kv_usage"] = max((p["kv_usage"] for p in self.timeline), default=None)
        delta["peak_running"] = max((p["running"] for p in self.timeline), default=None)
        return delta


# ---- output ----------------------------------------------------------------------------------
def table(summary: dict) -> str:
    rows = [("completed / failed", f"{summary['completed']} / {summary['failed']}"
             + (f"  {summary['errors']}" if summary["errors"] else "")),
            ("duration (s)", f"{summary['duration_s']:.2f}"),
            ("request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
            ("output throughput (tok/s)", f"{summary['output_throughput']:.1f}")]
    if summary.get("goodput") is not None:
        rows.append((f"goodput (req/s, {summary['slo']})", f"{summary['goodput']:.2f}"))
    if summary.get("client_cpu_s_per_1k_output_tokens") is not None:
        rows.append(("this client's CPU (s / 1k output tokens)", f"{summary['client_cpu_s_per_1k_output_tokens']:.3f}"))
    for key, label in (("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"), ("itl_s", "ITL (ms)"),
                       ("e2e_s", "E2E (ms)"), ("normalized_latency_s", "E2E / token (ms)")):
        d = summary.get(key)
        if d:
            rows.append((label + "  mean / median / p90 / p99",
                         " / ".join(f"{1e3 * d[s]:.1f}" for s in STATS)))
    for k, v in (summary.get("folio") or {}).items():
        if v is not None:
            rows.append((f"folio {k}", f"{v:g}" if float(v).is_integer() else f"{v:.3f}"))
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def plot(records: list[Record], timeline: list[dict], prefix: str) -> list[str]:
    """Latency CDFs, and throughput, running batch and KV usage over time; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.error is None and r.latency is not None]
    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, xs in (("TTFT", [r.ttft for r in ok if r.ttft is not None]), ("E2E", [r.latency for r in ok]),
                     ("ITL", [g for r in ok for g in r.itl])):
        if xs:
            xs = np.sort(xs)
            ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    ax.set_xscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction of requests")
    ax.legend()
    ax.set_title("Latency CDFs")
    paths.append(prefix + "_latency_cdf.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, axes = plt.subplots(3, 1, figsize=(6, 7), sharex=True)
    ends = sorted((r.start + r.latency, r.output_tokens) for r in ok)
    if ends:
        horizon = max(e for e, _ in ends)
        bins = np.arange(0, horizon + 1.0, 1.0)
        tok, _ = np.histogram([e for e, _ in ends], bins=bins, weights=[n for _, n in ends])
        axes[0].step(bins[:-1], tok, where="post")
    axes[0].set_ylabel("output tok/s")
    axes[1].plot([p["t"] for p in timeline], [p["running"] for p in timeline])
    axes[1].set_ylabel("running")
    axes[2].plot([p["t"] for p in timeline], [p["kv_usage"] for p in timeline])
    axes[2].set_ylabel("KV usage (max)")
    axes[2].set_xlabel("seconds")
    paths.append(prefix + "_timeline.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return paths


def compare(a: dict, b: dict) -> str:
    """Two result files (or two runs of a sweep) side by side, with B / A ratios."""
    def flat(doc):
        out = {}
        for run in doc["runs"]:
            s = run["summary"]
            key = f"rate={run['rate']}"
            out[(key, "output tok/s")] = s["output_throughput"]
            out[(key, "req/s")] = s["request_throughput"]
            if s.get("goodput") is not None:
                out[(key, "goodput req/s")] = s["goodput"]
            for k in ("ttft_s", "tpot_s", "e2e_s"):
                if s.get(k):
                    for st in ("median", "p99"):
                        out[(key, f"{k[:-2]} {st} (ms)")] = 1e3 * s[k][st]
        return out
    fa, fb = flat(a), flat(b)
    rows = [("", a.get("label", "A"), b.get("label", "B"), "B/A")]
    for k in fa:
        if k in fb:
            ratio = f"{fb[k] / fa[k]:.2f}" if fa[k] else "-"
            rows.append((f"{k[0]} {k[1]}", f"{fa[k]:.2f}", f"{fb[k]:.2f}", ratio))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


def write_json(path: str, doc: dict) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
