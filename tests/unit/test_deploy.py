"""deploy/ holds what the code runs: every command line parses with the real CLI, every KVSTORE_
variable is one the code reads, the Kubernetes manifests pass the API's schemas, and every alert
and dashboard expression names only metrics the directory and the workers export."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import kubernetes_validate
import promql_parser
import pytest
import typer
import yaml
from typer._click.exceptions import BadParameter, UsageError  # typer carries its own click

from kvstore.cli.main import app
from kvstore.directory.metrics import DirectoryMetrics
from kvstore.directory.settings import DirectorySettings
from kvstore.worker.metrics import WorkerMetrics
from kvstore.worker.settings import WorkerSettings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.30.0"
OPERATOR_KINDS = {"ServiceMonitor", "PodMonitor"}  # Prometheus Operator CRDs: checked by hand below


def parse_cli(args: list[str]):
    """The command `kvstore ARGS` would run, its arguments parsed and converted (nothing runs)."""
    command = typer.main.get_command(app)
    ctx = command.make_context("kvstore", list(args))
    while hasattr(command, "resolve_command"):  # a group: its subcommand parses the rest
        name, command, rest = command.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
        ctx = command.make_context(name, rest, parent=ctx)
    return command


def known_env() -> set[str]:
    """KVSTORE_ variables the code reads: every setting's, and every CLI option's."""
    names = {"KVSTORE_CONFIG"} | {f"KVSTORE_{f.upper()}" for f in DirectorySettings.model_fields} \
        | {f"KVSTORE_WORKER_{f.upper()}" for f in WorkerSettings.model_fields}

    def walk(command) -> None:
        for param in command.params:
            for env in ([param.envvar] if isinstance(param.envvar, str) else param.envvar or []):
                names.add(env)
        for sub in getattr(command, "commands", {}).values():
            walk(sub)
    walk(typer.main.get_command(app))
    return names


def check_env(names, where: str) -> None:
    unknown = sorted(n for n in names if n.startswith("KVSTORE_") and n not in known_env())
    assert not unknown, f"{where}: no code reads {unknown}"


# ---- compose ---------------------------------------------------------------------------------------

def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def kvstore_command(service: dict) -> list[str] | None:
    """The kvstore arguments a compose service runs, through a shell entrypoint if it has one."""
    if not str(service.get("image", "")).startswith("kvstore"):
        return None
    entry = service.get("entrypoint")
    if entry is None:
        return list(service["command"])
    script = entry[2]
    found = re.search(r"exec kvstore ((?:[\w-]+ )*)\"\$\$@\"", script)
    assert found, f"the entrypoint must exec kvstore: {script}"
    return shlex.split(found.group(1)) + list(service["command"])


def test_every_compose_command_parses_with_the_cli_and_names_known_variables():
    services = compose()["services"]
    ran = {}
    for name, service in services.items():
        args = kvstore_command(service)
        if args is None:
            continue
        ran[name] = parse_cli(args).name
        check_env(service.get("environment", {}), f"compose service {name}")
        check_env(re.findall(r"KVSTORE_\w+", json.dumps(service.get("entrypoint", ""))), f"compose service {name}")
    assert ran == {"migrate": "upgrade", "directory": "serve", "worker1": "serve", "worker2": "serve"}
    assert {"postgres", "minio", "prometheus", "grafana"} <= set(services)


def test_a_bad_flag_in_a_command_line_would_be_caught():
    with pytest.raises(UsageError):
        parse_cli(["worker", "serve", "--dram-byte", "1GiB"])
    with pytest.raises(BadParameter):
        parse_cli(["directory", "serve", "--port", "eighty"])
    with pytest.raises(AssertionError):
        check_env(["KVSTORE_WORKER_DRAM"], "a typo")


def test_compose_mounts_what_prometheus_and_grafana_read():
    services = compose()["services"]
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            source = volume.split(":")[0]
            assert (DEPLOY / source).exists(), f"{service} mounts {source}, which is not in deploy/"
    prometheus = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    assert prometheus["rule_files"] == ["alerts.yml"]
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in prometheus["scrape_configs"]}
    ports = {name: f"{name}:{parse_port(services[name])}" for name in ("worker1", "worker2")}
    assert targets == {"kvstore-directory": ["directory:8700"], "kvstore-worker": [ports["worker1"], ports["worker2"]]}


def parse_port(service: dict) -> str:
    return next(a.split("=", 1)[1] for a in service["command"] if a.startswith("--port="))


# ---- Kubernetes ------------------------------------------------------------------------------------

def manifests() -> list[dict]:
    kustomization = yaml.safe_load((DEPLOY / "k8s/kustomization.yaml").read_text())
    docs = []
    for resource in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / "k8s" / resource).read_text()) if d]
    return docs


def containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    pod = spec.get("template", {}).get("spec", {})
    return pod.get("containers", []) + pod.get("initContainers", [])


def test_kubernetes_manifests_pass_the_api_schemas():
    kinds = []
    for doc in manifests():
        kinds.append(doc["kind"])
        if doc["kind"] not in OPERATOR_KINDS:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any error
    assert sorted(kinds) == ["DaemonSet", "Deployment", "Job", "Namespace", "PodDisruptionBudget", "PodMonitor",
                             "Secret", "Service", "ServiceMonitor"]


def test_pods_are_hardened_and_the_directory_survives_a_drain():
    docs = {d["kind"]: d for d in manifests()}
    for kind in ("Deployment", "DaemonSet", "Job"):
        pod = docs[kind]["spec"]["template"]["spec"]
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, kind
        main = pod["containers"][0]["securityContext"]
        assert main["readOnlyRootFilesystem"] is True and main["allowPrivilegeEscalation"] is False, kind
    assert docs["DaemonSet"]["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"][
        "add"] == ["IPC_LOCK"]  # memlock for UCX
    assert docs["Job"]["spec"]["ttlSecondsAfterFinished"] > 0
    budget, directory = docs["PodDisruptionBudget"], docs["Deployment"]
    assert budget["spec"]["maxUnavailable"] == 1 and directory["spec"]["replicas"] == 3
    assert budget["spec"]["selector"] == directory["spec"]["selector"]
    spread = directory["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = spread["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= directory["spec"]["template"]["metadata"]["labels"].items()


def test_compose_pins_its_images_and_checks_every_long_running_service():
    services = compose()["services"]
    for name, service in services.items():
        image = service.get("image", "")
        assert image.startswith("kvstore") or (":" in image and not image.endswith(":latest")), (name, image)
    for name in ("postgres", "minio", "directory", "worker1", "worker2"):
        assert services[name]["healthcheck"]["test"], name
    for name in ("worker1", "worker2"):  # the worker binds its own name's address, not loopback
        assert f"http://{name}:8710/healthz" in " ".join(services[name]["healthcheck"]["test"])


def test_kubernetes_containers_run_real_commands_and_monitors_select_real_ports():
    cross_check(manifests())


@pytest.mark.parametrize("break_it", ["monitor_port", "pod_monitor_labels", "no_host_path", "command"])
def test_the_cross_checks_catch_a_broken_manifest(break_it):
    """Each way a manifest could go wrong that the schemas cannot see is caught by `cross_check`."""
    docs = json.loads(json.dumps(manifests()))
    kind = {d["kind"]: d for d in docs}
    if break_it == "monitor_port":
        kind["ServiceMonitor"]["spec"]["endpoints"][0]["port"] = "no-such-port"
    elif break_it == "pod_monitor_labels":
        kind["PodMonitor"]["spec"]["selector"]["matchLabels"] = {"app": "someone-else"}
    elif break_it == "no_host_path":
        for volume in kind["DaemonSet"]["spec"]["template"]["spec"]["volumes"]:
            volume.pop("hostPath", None)
            volume["emptyDir"] = {}
    else:
        container = next(c for c in containers(kind["Deployment"]) if c["image"] == "kvstore")
        container["args"] = ["directory", "serv"]
    with pytest.raises(AssertionError):
        cross_check(docs)


def cross_check(docs: list[dict]) -> None:
    """What the Kubernetes schemas cannot check: containers run real commands, monitors select real
    ports and pods, the worker's NVMe tier is on the host."""
    ran = set()
    for doc in docs:
        for container in containers(doc):
            if container["image"] != "kvstore" or container.get("command", ["kvstore"])[0] != "kvstore":
                continue  # another image, or a shell step (chown) in ours
            args = container.get("command", [])[1:] + container["args"]
            try:
                command = parse_cli(args)
            except Exception as exc:  # the CLI's refusal (an unknown command or option), as a failed check
                raise AssertionError(f"{doc['kind']} runs `kvstore {shlex.join(args)}`: {exc}") from exc
            ran.add(command.name + ":" + doc["kind"])
            check_env([e["name"] for e in container.get("env", [])], f"{doc['kind']} {doc['metadata']['name']}")
    assert ran == {"upgrade:Job", "serve:Deployment", "serve:DaemonSet"}
    service = next(d for d in docs if d["kind"] == "Service")
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in service["spec"]["ports"]}
    daemonset = next(d for d in docs if d["kind"] == "DaemonSet")
    pods = next(d for d in docs if d["kind"] == "PodMonitor")
    assert pods["spec"]["selector"]["matchLabels"].items() <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    worker_ports = {p["name"] for c in containers(daemonset) for p in c.get("ports", [])}
    assert {e["port"] for e in pods["spec"]["podMetricsEndpoints"]} <= worker_ports
    volumes = {v["name"]: v for v in daemonset["spec"]["template"]["spec"]["volumes"]}
    assert any("hostPath" in v for v in volumes.values()), "the worker's NVMe tier lives on a hostPath"


# ---- alerts and dashboards -------------------------------------------------------------------------

def exported() -> set[str]:
    """Every series name the directory and the workers can export."""
    names = set()
    directory = DirectoryMetrics()
    for registry in (directory.registry, directory.cluster, WorkerMetrics().registry):
        for family in registry.collect():
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
            names |= {family.name + s for s in suffixes[family.type]}
    return names


def metric_names(expr: str) -> set[str]:
    found, todo = set(), [promql_parser.parse(expr)]
    while todo:
        node = todo.pop()
        if isinstance(node, promql_parser.VectorSelector):
            found.add(node.name)
        for attr in ("lhs", "rhs", "expr", "param", "vector_selector"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (int, float, str)):
                todo.append(child)
        todo += list(getattr(node, "args", None) or [])
    return found


def expressions() -> dict[str, str]:
    exprs = {}
    for group in yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            exprs[f"alert {rule['alert']}"] = rule["expr"]
    dashboard = json.loads((DEPLOY / "grafana/dashboards/kvstore.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            exprs[f"panel {panel['title']} {target['refId']}"] = target["expr"]
    return exprs


def test_every_alert_and_panel_names_only_exported_metrics():
    known, used = exported(), set()
    for where, expr in expressions().items():
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr}"
        assert names <= known, f"{where}: {sorted(names - known)} are not exported"
        used |= names
    wanted = {"kvstore_workers_declared_dead_total", "kvstore_checksum_failures_total",
              "kvstore_worker_checksum_failures_total", "kvstore_worker_moves_total", "kvstore_leases_active",
              "kvstore_pins", "kvstore_tier_high_watermark_ratio", "kvstore_lookup_hit_blocks_total",
              "kvstore_request_seconds_bucket", "kvstore_worker_s3_errors_total", "kvstore_worker_nixl_failures_total",
              "kvstore_leader"}
    assert wanted <= used, sorted(wanted - used)


def test_a_misspelt_metric_would_be_caught():
    assert metric_names('sum by (le) (rate(kvstore_request_second_bucket{route="/v1/lookup"}[5m])) > 0 '
                        'and on () kvstore_pins') == {"kvstore_request_second_bucket", "kvstore_pins"}
    assert "kvstore_request_second_bucket" not in exported()
    with pytest.raises(ValueError):
        promql_parser.parse("sum(rate(kvstore_pins[5m])")


# ---- images ----------------------------------------------------------------------------------------

def test_images_install_the_tested_versions_before_the_code_and_the_directory_has_no_torch():
    import importlib.util

    root = DEPLOY.parent
    dockerfile = (root / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\S+)", dockerfile, flags=re.M)
    assert {"build", "directory", "full"} <= set(stages) and stages[-1] == "full"  # full: the default target
    for stage in ("directory", "full"):
        body = dockerfile.split(f" AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        deps, wheel = body.index("-c /deps/constraints.txt"), body.index("/wheels/kvstore-*.whl")
        assert deps < wheel and "--no-deps /wheels/kvstore" in body, stage  # dependencies first, cached
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", dockerfile, flags=re.M):
        for path in source.split():
            assert (root / path).exists(), path
    spec = importlib.util.spec_from_file_location("requirements", root / "scripts/requirements.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    directory, everything = script.requirements(["directory"]), script.requirements(["all"])
    assert any(r.startswith("fastapi") for r in directory) and not any(
        r.startswith(("torch", "nixl")) for r in directory)
    assert {"torch", "nixl-cu12", "boto3", "fastapi"} <= {re.split(r"[<>=\[]", r)[0] for r in everything}
    pinned = dict(line.split("==") for line in (root / "constraints.txt").read_text().splitlines()
                  if line and not line.startswith("#"))
    normal = {re.sub(r"[-_.]+", "-", k).lower() for k in pinned}
    for req in everything:  # every dependency has a tested version (torch: each image's own build)
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=\[]", req)[0]).lower()
        assert name == "torch" or name in normal, name
    services = compose()["services"]
    assert services["directory"]["build"]["target"] == "directory" == services["migrate"]["build"]["target"]
