"""`folio drain`: a running cluster's workers stop admitting, finish what they have (for
`--grace-period-s`), then abort the rest: the Helm chart's preStop hook on the head pod."""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("drain", help="stop a running cluster's workers admitting; wait for in-flight requests "
                                     "(a Kubernetes preStop hook)")
    p.add_argument("--address", default="auto", help="the Ray cluster")
    p.add_argument("--namespace", default="folio")
    p.add_argument("--redis-url", required=True)
    p.add_argument("--grace-period-s", type=float, default=30.0)
    return p


def main(args) -> int:
    """Every live worker stops admitting, gets `--grace-period-s` for its in-flight requests,
    then aborts the rest. Prints how many were aborted per worker."""
    import ray

    from folio.cluster.state import ClusterState
    from folio.cluster.worker_client import actor_name

    ray.init(address=args.address, namespace=args.namespace, log_to_driver=False)
    try:
        ids = sorted(ClusterState(args.redis_url, args.namespace).live_loads())
        handles = {w: ray.get_actor(actor_name(args.namespace, w), namespace=args.namespace) for w in ids}
        aborted = ray.get([h.drain.remote(args.grace_period_s) for h in handles.values()],
                          timeout=args.grace_period_s + 30)
        for w, n in zip(handles, aborted):
            print(f"folio drain: {w} drained, {n} requests aborted", flush=True)
    finally:
        ray.shutdown()
    return 0
