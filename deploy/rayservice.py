"""Folio's Serve application for KubeRay's RayService (helm/folio): the import path
`folio.deploy.rayservice:build` in `serveConfigV2`, with `folio serve`'s own arguments.

    applications:
      - name: folio
        import_path: folio.deploy.rayservice:build
        args: {argv: ["--model", "/models/model", "--num-workers", "4", "--address", "auto", ...]}
        deployments: [{name: FolioFrontend, num_replicas: 2}]

The replica count goes in `deployments` (the chart's `serve.frontendReplicas`), where a new
count scales the deployment. In `args` (`frontend_replicas`, still read, or the argv's
`--frontend-replicas`) it is part of the application's code version for Serve, so a new count
replaced every replica (an attack, 2026-12-07: 1 -> 2 drained the only one).

The builder runs inside the Ray cluster: it starts (or finds, after a redeploy) the
workers and the coordinator as detached actors, waits for their heartbeats in Redis,
and returns the frontend deployment, pinned to the head by the `folio-frontend`
resource that the chart gives only the head pod.
"""

from __future__ import annotations


def parse_argv(argv: list[str]):
    """`folio serve`'s parser on the chart's arguments (the chart test uses this too)."""
    from folio.deploy.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def build(args: dict):
    from folio.cluster.launcher import FolioCluster
    from folio.deploy.commands.serve import cluster_config, frontend_config
    from folio.deploy.replica_drain import serve_options
    from folio.deploy.serve_deployment import FolioFrontend

    ns = parse_argv(list(args["argv"]))
    if not ns.redis_url:
        raise ValueError("on Kubernetes --redis-url is required (the chart's Redis or an external one)")
    config = cluster_config(ns)
    config.detached = True
    cluster = FolioCluster(config).start()
    cfg = frontend_config(ns, cluster)
    return FolioFrontend.options(num_replicas=int(args.get("frontend_replicas", ns.frontend_replicas)),
                                 ray_actor_options={"num_cpus": 0.1, "resources": {"folio-frontend": 1}},
                                 **serve_options(cfg.drain_s)).bind(cfg)
