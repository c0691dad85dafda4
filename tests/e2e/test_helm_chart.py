"""The Helm chart rendered offline (helm-python-sdk) and every object validated: built-in
kinds with kubernetes-validate --strict, RayService / RayCluster against KubeRay's real
CRD schemas (../shared/kuberay-crds), values against values.schema.json; the serve
arguments parsed with `folio serve`'s own parser; the Dockerfile and its build context."""

import fnmatch
import os

import jsonschema
import pytest
import yaml

helm = pytest.importorskip("helm_python")
kv = pytest.importorskip("kubernetes_validate")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "helm", "folio")
CRDS = os.path.join(ROOT, "..", "shared", "kuberay-crds")
BUILTIN = ("v1", "apps/v1", "policy/v1")

OVERRIDES = {
    "default": {},
    "external-redis": {"redis": {"enabled": False, "url": "redis://redis.infra:6379/0",
                                 "passwordSecret": {"name": "redis-auth", "key": "password"}}},
    "four-gpu-workers": {"workers": {"replicas": 2, "gpusPerPod": 2}},
    "tensor-parallel": {"workers": {"replicas": 2, "gpusPerPod": 4, "tensorParallelSize": 2}},
    "auth-on": {"apiKey": {"enabled": True, "value": "s3cret"}},
    "auth-existing-secret": {"apiKey": {"enabled": True, "existingSecret": "folio-keys"}},
    "servicemonitor-pdb": {"serviceMonitor": {"enabled": True}, "podDisruptionBudget": {"enabled": True}},
    "cpu-only": {"cpuOnly": True, "workers": {"replicas": 1, "gpusPerPod": 2},
                 "serve": {"dtype": "float32", "kvCacheLayout": "layer_major"}},
    "download-model": {"model": {"source": "download", "download": {"command": ["sh", "-c", "fetch-model"]}}},
    "hostpath-model": {"model": {"source": "hostPath", "hostPath": {"path": "/mnt/models/llama"}}},
    "migrate-queued-connections": {"serve": {"migrateQueuedConnections": True, "frontendReplicas": 2}},
}


@pytest.fixture(scope="module")
def chart():
    return helm.Chart.load(CHART)


VENDORED = os.path.join(ROOT, "tests", "data", "kuberay_v1_schemas.json.gz")


def shared_crd_schemas() -> dict | None:
    """The v1 openAPIV3Schema of each CRD in ../shared/kuberay-crds, when that folder is there."""
    if not os.path.isdir(CRDS):
        return None
    out = {}
    for kind, name in (("RayService", "ray.io_rayservices.yaml"), ("RayCluster", "ray.io_rayclusters.yaml")):
        crd = yaml.load(open(os.path.join(CRDS, name)), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        out[kind] = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    return out


@pytest.fixture(scope="module")
def crd_schemas():
    """KubeRay's real schemas: from ../shared/kuberay-crds when the checkout has it, else the copy
    of the same schemas in tests/data (a clean clone elsewhere has no ../shared)."""
    import gzip
    import json

    with gzip.open(VENDORED, "rt") as f:
        vendored = json.load(f)["schemas"]
    shared = shared_crd_schemas()
    if shared is not None:
        assert shared == vendored, "tests/data/kuberay_v1_schemas.json.gz drifted from ../shared/kuberay-crds"
        return shared
    return vendored


def render(chart, values):
    chart.validate_schema(values)
    docs = []
    for path, text in chart.render(values, name="demo", namespace="ai").items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def serve_config(docs):
    rs = next(d for d in docs if d["kind"] == "RayService")
    return rs, yaml.safe_load(rs["spec"]["serveConfigV2"])


@pytest.mark.parametrize("case", sorted(OVERRIDES))
def test_every_rendered_object_validates(chart, crd_schemas, case):
    docs = render(chart, OVERRIDES[case])
    kinds = sorted(d["kind"] for d in docs)
    assert "RayService" in kinds and kinds.count("Service") >= 3
    for d in docs:
        if d["apiVersion"] in BUILTIN:
            kv.validate(d, kv.latest_version(), strict=True)
        elif d["kind"] == "RayService":
            jsonschema.validate(d, crd_schemas["RayService"])
            cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "demo"},
                       "spec": d["spec"]["rayClusterConfig"]}
            jsonschema.validate(cluster, crd_schemas["RayCluster"])
        elif d["kind"] == "ServiceMonitor":  # the Prometheus Operator's CRD is not vendored here
            assert d["apiVersion"] == "monitoring.coreos.com/v1" and d["spec"]["endpoints"][0]["port"] == "metrics"
        else:
            pytest.fail(f"unexpected kind {d['kind']}")


def test_serve_arguments_parse_with_the_cli_and_match_the_ports(chart):
    from ray.serve.schema import ServeDeploySchema

    from folio.deploy.rayservice import parse_argv

    for case, values in OVERRIDES.items():
        docs = render(chart, values)
        rs, cfg = serve_config(docs)
        app = cfg["applications"][0]
        assert app["import_path"] == "folio.deploy.rayservice:build"
        ServeDeploySchema.model_validate(cfg)  # what `serve deploy` (KubeRay) accepts
        args = parse_argv(app["args"]["argv"])  # exits (SystemExit) on anything `folio serve` rejects
        merged = chart.merge_values(values)
        # the replica count is the deployment's, so a new count scales; in the app's args it would be
        # part of the code version, and replace (drain) every replica
        assert set(app["args"]) == {"argv"} and args.frontend_replicas == 1, case
        assert app["deployments"] == [{"name": "FolioFrontend", "num_replicas": merged["serve"]["frontendReplicas"]}]
        tp = merged["workers"].get("tensorParallelSize", 1)
        assert args.num_workers * tp == merged["workers"]["replicas"] * merged["workers"]["gpusPerPod"], case
        assert args.tensor_parallel_size == tp, case
        assert args.model == merged["model"]["path"] and args.address == "auto"
        assert args.kv_cache_layout == merged["serve"]["kvCacheLayout"], case
        assert args.host == "0.0.0.0", case  # explicit: `folio serve` alone listens on loopback only
        head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in head["ports"]}
        assert (ports["http"], ports["grpc"], ports["metrics"]) == (args.http_port, args.grpc_port,
                                                                    args.metrics_port)
        # the frontends serve the API on httpPort themselves; Serve's proxy (KubeRay's health checks) beside it
        assert cfg["http_options"]["port"] == merged["serve"]["proxyPort"] == ports["serve"] != args.http_port
        services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        assert services["demo-folio-grpc"]["spec"]["ports"][0]["port"] == args.grpc_port
        assert head["livenessProbe"]["grpc"]["port"] == args.grpc_port
        assert head["readinessProbe"]["httpGet"]["path"] == "/health"
        from folio.deploy.cli import build_parser

        stop = head["lifecycle"]["preStop"]["exec"]["command"]
        assert stop[:2] == ["folio", "drain"]
        drain = build_parser().parse_args(stop[1:])  # the hook's arguments are the CLI's
        assert (drain.namespace, drain.redis_url) == (args.namespace, args.redis_url)
        assert drain.grace_period_s == args.grace_period_s
        pod = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= args.grace_period_s + 10
        if merged["redis"]["enabled"]:
            assert args.redis_url == "redis://demo-folio-redis:6379/0"
        else:
            assert args.redis_url == merged["redis"]["url"]


def test_gpu_requests_auth_and_termination(chart):
    rs, _ = serve_config(render(chart, OVERRIDES["four-gpu-workers"]))
    group = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2 and group["rayStartParams"]["num-gpus"] == "2"
    assert group["template"]["spec"]["terminationGracePeriodSeconds"] == 45  # drain 30 s + 15
    rs, _ = serve_config(render(chart, OVERRIDES["tensor-parallel"]))  # 2 pods x 4 GPUs: 4 workers of 2 GPUs
    group = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    assert group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert group["rayStartParams"]["num-gpus"] == "4"
    with pytest.raises(Exception, match="must divide"):  # a worker's GPUs must be on one pod
        render(chart, {"workers": {"replicas": 1, "gpusPerPod": 3, "tensorParallelSize": 2}})
    rs, _ = serve_config(render(chart, OVERRIDES["cpu-only"]))
    worker = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in worker["resources"]["limits"]
    docs = render(chart, OVERRIDES["auth-on"])
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-api-key"))
    rs, _ = serve_config(docs)
    env = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    ref = next(e for e in env if e["name"] == "FOLIO_API_KEY")["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
    assert not any(d["kind"] == "StatefulSet" for d in render(chart, OVERRIDES["external-redis"]))


def test_queued_connections_migrate_on_the_head_alone_when_asked(chart):
    """serve.migrateQueuedConnections: the sysctl on the head's pod (the frontends' node), not on
    the workers' (whose kubelets then need not allow it); nowhere by default."""
    def sysctls(values):
        spec = serve_config(render(chart, values))[0]["spec"]["rayClusterConfig"]
        return [spec["headGroupSpec"]["template"]["spec"]["securityContext"].get("sysctls"),
                spec["workerGroupSpecs"][0]["template"]["spec"]["securityContext"].get("sysctls")]
    assert sysctls(OVERRIDES["migrate-queued-connections"]) == [[{"name": "net.ipv4.tcp_migrate_req", "value": "1"}],
                                                                None]
    assert sysctls(OVERRIDES["default"]) == [None, None]


@pytest.mark.parametrize("values, message", [
    ({"workers": {"replicas": -1}}, "replicas"),
    ({"workers": {"replicas": 0}}, "replicas"),
    ({"workers": {"tensorParallelSize": 0}}, "tensorParallelSize"),
    ({"model": {"source": None}}, "source"),
    ({"model": {"source": "s3"}}, "source"),
    ({"model": {"pvc": {"claimName": ""}}}, "claimName"),
    ({"model": {"source": "hostPath"}}, "path"),
    ({"redis": {"enabled": False}}, "url"),
    ({"apiKey": {"enabled": True}}, "apiKey"),
    ({"serve": {"router": "random"}}, "router"),
    ({"serve": {"grpcPort": 70000}}, "grpcPort"),
    ({"serve": {"kvCacheLayout": "heads_major"}}, "kvCacheLayout"),
    ({"serve": {"migrateQueuedConnections": "yes"}}, "migrateQueuedConnections"),
])
def test_bad_values_fail_the_schema_with_a_clear_message(chart, values, message):
    with pytest.raises(helm.HelmValuesError) as e:
        chart.validate_schema(values)
    assert message in str(e.value)


# ---- the container image ---------------------------------------------------------------------
def dockerfile_instructions(path):
    lines, cur = [], ""
    for raw in open(path):
        line = raw.rstrip("\n")
        if not cur and (not line.strip() or line.lstrip().startswith("#")):
            continue
        cur += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            lines.append(cur.strip())
            cur = ""
    return [(ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "") for ln in lines]


def test_dockerfile_parses_and_runs_folio_as_non_root():
    ins = dockerfile_instructions(os.path.join(ROOT, "deploy", "Dockerfile"))
    kinds = [k for k, _ in ins]
    assert set(kinds) <= {"ARG", "FROM", "ENV", "RUN", "WORKDIR", "COPY", "USER", "EXPOSE", "ENTRYPOINT", "CMD"}
    assert kinds.index("ARG") < kinds.index("FROM")  # the base is a build argument (CUDA or CPU)
    user = [a for k, a in ins if k == "USER"][-1]
    assert user not in ("root", "0")
    assert [a for k, a in ins if k == "ENTRYPOINT"] == ['["folio"]']
    exposed = " ".join(a for k, a in ins if k == "EXPOSE").split()
    assert {"8000", "50051", "9090"} <= set(exposed)
    for k, a in ins:
        if k == "COPY":
            for src in a.split()[:-1]:
                assert os.path.exists(os.path.join(ROOT, src)), src


def test_dockerfile_names_no_ppa_or_download_host_but_in_build_arguments():
    import re

    ins = dockerfile_instructions(os.path.join(ROOT, "deploy", "Dockerfile"))
    for k, a in ins:
        if k != "ARG":
            assert not re.search(r"https?://|ppa:|add-apt-repository|deadsnakes", a), (k, a)
    args = {a.split("=", 1)[0] for k, a in ins if k == "ARG"}
    assert {"BASE", "TORCH_INDEX", "PIP_INDEX", "PIP_FIND_LINKS", "PIP_CERT"} <= args
    run = " ".join(a for k, a in ins if k == "RUN")
    assert "python3 -m venv" in run and "python3.1" not in run  # the distribution's own Python


def test_build_context_excludes_tests_venvs_and_results():
    patterns = [p.strip() for p in open(os.path.join(ROOT, ".dockerignore")) if p.strip() and not p.startswith("#")]

    def ignored(path):
        for p in patterns:
            p = p.rstrip("/")
            if fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p + "/*") or path.startswith(p + "/"):
                return True
            if p.startswith("**/") and fnmatch.fnmatch(os.path.basename(path), p[3:]):
                return True
        return False
    for path in ("tests/engine/test_engine.py", ".venv/bin/python", ".venv-vllm/bin/python", "benchmarks/results/x.json",
                 "models/tiny/config.json", ".git/HEAD", "worker/__pycache__/engine.cpython-311.pyc"):
        assert ignored(path), path
    for path in ("worker/engine.py", "deploy/commands/serve.py", "deploy/proto/folio/v1/generate.proto",
                 "pyproject.toml",
                 "setup.py", "README.md", "folio_pkg/__init__.py"):
        assert not ignored(path), path


def test_the_charts_redis_requires_the_password_its_clients_get(chart):
    import base64

    for case in ("default", "auth-on"):
        docs = render(chart, OVERRIDES.get(case, {}))
        secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "demo-folio-redis")
        assert len(base64.b64decode(secret["data"]["password"])) == 32
        redis = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
        args = redis["args"]
        assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
        ref = next(e for e in redis["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "demo-folio-redis", "key": "password"}
        assert "REDIS_PASSWORD" in " ".join(redis["readinessProbe"]["exec"]["command"])
        rs, _ = serve_config(docs)
        for pod in (rs["spec"]["rayClusterConfig"]["headGroupSpec"],
                    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]):
            env = pod["template"]["spec"]["containers"][0]["env"]
            assert next(e for e in env if e["name"] == "FOLIO_REDIS_PASSWORD")["valueFrom"]["secretKeyRef"] == ref
    docs = render(chart, OVERRIDES["external-redis"])  # the given Secret, none generated
    assert not any(d["kind"] == "Secret" and d["metadata"]["name"] == "demo-folio-redis" for d in docs)
    rs, _ = serve_config(docs)
    env = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert next(e for e in env if e["name"] == "FOLIO_REDIS_PASSWORD")["valueFrom"]["secretKeyRef"] == {
        "name": "redis-auth", "key": "password"}
