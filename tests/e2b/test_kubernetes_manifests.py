"""The Kubernetes manifests in deploy/kubernetes/: every object valid against the API's own schemas
(strictly: an unknown field is an error, as `kubectl apply --validate=strict` makes it), and the
links between the objects that no schema checks: labels that select, ports that match, the etcd
members that cordon and etcd itself name, the flags and environment `cordon serve` needs.

Needs no cluster, server, root or network: kubernetes-validate ships the schemas of each
Kubernetes release. The `sandbox` fixtures of conftest.py are never requested here."""

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"

# The oldest release the manifests are for (the containers' appArmorProfile field is 1.30's), and
# the newest the validator knows, which catches a field a later release removed.
PINNED = "1.30"
VERSIONS = list(dict.fromkeys([PINNED, ".".join(kubernetes_validate.latest_version().split(".")[:2])]))

KUSTOMIZE_API = "kustomize.config.k8s.io/"


def load():
    """(file name, document) for every YAML document under deploy/kubernetes/, in file order."""
    docs = []
    for path in sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((str(path.relative_to(DEPLOY)), doc))
    return docs


DOCS = load()
OBJECTS = [(f, d) for f, d in DOCS if not d.get("apiVersion", "").startswith(KUSTOMIZE_API)]


def one(kind, name=None):
    found = [d for _, d in OBJECTS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def daemonset():
    return one("DaemonSet", "cordon")


def container(workload, name):
    found = [c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    assert len(found) == 1, f"{workload['kind']}/{workload['metadata']['name']} has no container {name}"
    return found[0]


def env_of(c):
    return {e["name"]: e for e in c.get("env", [])}


def flag(argv, name):
    """The value of `--name VALUE` or `--name=VALUE` in argv (None when absent)."""
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a[len(name) + 1 :]
    return None


def port_number(c, port):
    """A probe's or Service's port (a number, or the name of one of the container's ports)."""
    if isinstance(port, int):
        assert any(p["containerPort"] == port for p in c.get("ports", [])), f"no container port {port}"
        return port
    named = [p["containerPort"] for p in c.get("ports", []) if p.get("name") == port]
    assert named, f"container {c['name']} has no port named {port!r}"
    return named[0]


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_labels(workload):
    return workload["spec"]["template"]["metadata"]["labels"]


def test_manifests_are_found():
    kinds = {d["kind"] for _, d in OBJECTS}
    assert {"Namespace", "Secret", "DaemonSet", "Service", "StatefulSet"} <= kinds, kinds


@pytest.mark.parametrize("path", sorted({f for f, _ in DOCS}))
def test_each_file_opens_with_a_comment(path):
    assert (DEPLOY / path).read_text().startswith("#"), f"{path}: say what it is and why in a comment header"


def test_pinned_schemas_are_bundled():
    assert any(v.startswith(PINNED + ".") for v in all_versions()), (
        f"kubernetes-validate {kubernetes_validate.__version__} no longer ships Kubernetes {PINNED}'s schemas: "
        f"pin an older release in requirements.txt or move PINNED to one of {all_versions()}"
    )


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("doc", [d for _, d in OBJECTS], ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in OBJECTS])
def test_schema(doc, version):
    try:
        used, error = kubernetes_validate.validate(doc, version, strict=True), None
    except kubernetes_validate.ValidationError as e:
        where = ".".join(str(p) for p in e.path)
        used, error = None, f"{doc['kind']}/{doc['metadata']['name']} against Kubernetes {e.version}: {where}: {e.message}"
    except kubernetes_validate.SchemaNotFoundError as e:
        used, error = None, e.message
    if error:
        pytest.fail(error, pytrace=False)
    assert used == version, f"validated against {used}, not {version}"


# The validator fails where it should: a check that cannot fail proves nothing.


def test_validator_rejects_an_unknown_field():
    broken = copy.deepcopy(daemonset())
    container(broken, "cordon")["securityContext"]["privilegd"] = True
    with pytest.raises(kubernetes_validate.ValidationError) as e:
        kubernetes_validate.validate(broken, PINNED, strict=True)
    assert "privilegd" in e.value.message
    # ...which only strict validation does: the strictness is what catches a misspelt field.
    kubernetes_validate.validate(broken, PINNED, strict=False)


def test_validator_rejects_a_wrong_type():
    broken = copy.deepcopy(daemonset())
    container(broken, "cordon")["ports"][0]["containerPort"] = "3000"
    with pytest.raises(kubernetes_validate.ValidationError) as e:
        kubernetes_validate.validate(broken, PINNED, strict=True)
    assert list(e.value.path)[-1] == "containerPort"


def test_validator_rejects_a_missing_required_field():
    broken = copy.deepcopy(daemonset())
    del broken["spec"]["selector"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, PINNED, strict=True)


# What the schemas cannot say.


def test_every_object_is_in_the_namespace_the_manifests_make():
    ns = one("Namespace")
    name = ns["metadata"]["name"]
    for f, d in OBJECTS:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == name, f"{f}: {d['kind']}/{d['metadata']['name']} outside {name}"
    # The pods are privileged: a namespace under `baseline` or `restricted` would refuse them.
    assert ns["metadata"]["labels"].get("pod-security.kubernetes.io/enforce") == "privileged"


def test_kustomization_lists_every_manifest():
    kust = [(f, d) for f, d in DOCS if d.get("apiVersion", "").startswith(KUSTOMIZE_API)]
    if not kust:
        pytest.skip("no kustomization.yaml")
    assert len(kust) == 1
    listed = kust[0][1]["resources"]
    present = sorted({f for f, _ in OBJECTS})
    assert sorted(listed) == present, f"kustomization.yaml lists {sorted(listed)}; the directory has {present}"


def test_daemonset_container_has_what_cordon_needs():
    ds = daemonset()
    pod = ds["spec"]["template"]["spec"]
    c = container(ds, "cordon")
    env = env_of(c)
    sc = c["securityContext"]
    assert sc["privileged"] is True
    assert sc["seccompProfile"]["type"] == "Unconfined"
    assert not pod.get("hostPID"), "sandboxes need their own PID namespaces, not the node's"
    # The pod's PID namespace must outlive the server, or a restart kills every sandbox.
    assert pod.get("shareProcessNamespace") is True
    assert pod.get("enableServiceLinks") is False, "a Service named cordon would add CORDON_* variables"
    assert pod.get("terminationGracePeriodSeconds", 30) >= 60

    # The state dir: CORDON_HOME names the path, a hostPath volume is mounted there.
    home = env["CORDON_HOME"]["value"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert home in mounts, f"nothing mounted at CORDON_HOME={home}"
    state = volumes[mounts[home]]["hostPath"]
    assert state["path"] == home and state["type"] == "DirectoryOrCreate"
    for host_path in ("/sys/fs/cgroup", "/dev", "/run/cordon"):
        assert host_path in mounts, f"{host_path} is not mounted"
        assert volumes[mounts[host_path]]["hostPath"]["path"] == host_path

    key = env["CORDON_API_KEY"]["valueFrom"]["secretKeyRef"]
    secret = one("Secret", key["name"])
    assert key["key"] in {**secret.get("data", {}), **secret.get("stringData", {})}
    assert env["CORDON_SHUTDOWN"]["value"] == "keep"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"

    argv = c["command"] + c["args"]
    assert "exec cordon serve --node-name" in c["command"][2]
    assert flag(argv, "--cluster").startswith("etcd=http://")
    port = port_number(c, "http")
    assert flag(argv, "--listen") == f"0.0.0.0:{port}"
    assert flag(argv, "--advertise") == f"http://$(POD_IP):{port}"

    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert port_number(c, get["port"]) == port, probe


@pytest.mark.parametrize("kind", ["DaemonSet", "StatefulSet"])
def test_variable_references_are_defined(kind):
    """The kubelet leaves a `$(NAME)` with no such variable as it is: a typo would reach etcd or
    cordon as a literal host name."""
    for _, w in OBJECTS:
        if w["kind"] != kind:
            continue
        for c in w["spec"]["template"]["spec"]["containers"]:
            defined = set(env_of(c))
            for arg in c.get("command", []) + c.get("args", []):
                for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert ref in defined, f"{kind}/{w['metadata']['name']}: $({ref}) is not in {c['name']}'s env"


def test_service_reaches_the_daemonset():
    ds = daemonset()
    svc = one("Service", "cordon")
    assert svc["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert svc["spec"]["selector"] == ds["spec"]["selector"]["matchLabels"]
    assert selects(svc["spec"]["selector"], pod_labels(ds))
    c = container(ds, "cordon")
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 3000
    assert port_number(c, port["targetPort"]) == 3000


def etcd_members():
    """The etcd StatefulSet, its headless Service, and --initial-cluster as {name: peer URL}."""
    sts = one("StatefulSet", "etcd")
    c = container(sts, "etcd")
    members = dict(m.split("=", 1) for m in flag(c["args"], "--initial-cluster").split(","))
    return sts, one("Service", sts["spec"]["serviceName"]), c, members


def test_etcd_initial_cluster_matches_the_statefulset():
    sts, svc, c, members = etcd_members()
    name, replicas = sts["metadata"]["name"], sts["spec"]["replicas"]
    assert len(members) == replicas
    assert sorted(members) == [f"{name}-{i}" for i in range(replicas)]
    peer = port_number(c, "peer")
    for member, url in members.items():
        # <pod>.<headless service>.<namespace>.svc: the pod's stable DNS name.
        assert url == f"http://{member}.{svc['metadata']['name']}.$(POD_NAMESPACE).svc:{peer}", url
    # Each member calls itself by the same name and URL that --initial-cluster gives it.
    env = env_of(c)
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert flag(c["args"], "--name") == "$(POD_NAME)"
    assert flag(c["args"], "--initial-advertise-peer-urls") == f"http://$(POD_NAME).{svc['metadata']['name']}.$(POD_NAMESPACE).svc:{peer}"
    assert sts["spec"].get("podManagementPolicy") == "Parallel", "OrderedReady waits for a quorum that cannot form"


def test_etcd_service_is_headless_and_selects_the_members():
    sts, svc, c, _ = etcd_members()
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"].get("publishNotReadyAddresses") is True, "members must resolve each other before a quorum"
    assert selects(svc["spec"]["selector"], pod_labels(sts))
    assert selects(sts["spec"]["selector"]["matchLabels"], pod_labels(sts))
    for p in svc["spec"]["ports"]:
        port_number(c, p["targetPort"])
    assert sts["spec"]["volumeClaimTemplates"], "members need persistent storage"


def test_cordon_names_every_etcd_member():
    sts, svc, c, members = etcd_members()
    client = port_number(c, "client")
    argv = container(daemonset(), "cordon")["args"]
    urls = flag(argv, "--cluster").removeprefix("etcd=").split(",")
    assert sorted(urls) == sorted(f"http://{m}.{svc['metadata']['name']}.$(POD_NAMESPACE).svc:{client}" for m in members)


def test_etcd_is_open_only_to_cordon_and_its_peers():
    sts, _, _, _ = etcd_members()
    policy = one("NetworkPolicy", "etcd")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels(sts))
    sources = [s["podSelector"]["matchLabels"] for rule in policy["spec"]["ingress"] for s in rule["from"]]
    assert any(selects(s, pod_labels(daemonset())) for s in sources)
    assert any(selects(s, pod_labels(sts)) for s in sources)
    assert selects(one("PodDisruptionBudget", "etcd")["spec"]["selector"]["matchLabels"], pod_labels(sts))


# The DaemonSet's wrapper script, run as the container would run it, with a stand-in for cordon.


def run_wrapper(tmp_path, node_name, api_key="k"):
    c = container(daemonset(), "cordon")
    fake = tmp_path / "cordon"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "NODE_NAME": node_name, "CORDON_API_KEY": api_key}
    return subprocess.run(c["command"] + c["args"], env=env, capture_output=True, text=True, timeout=30), c["args"]


NODE_NAMES = [
    "worker1",
    "node-1",
    "node1",
    "ip-10-0-1-23.ec2.internal",
    "gke-prod-default-pool-1a2b3c4d-x9z8",
    "gke-prod-default-pool-1a2b3c4d-x9z9",
    "a" * 63,
]


def test_wrapper_gives_cordon_a_valid_distinct_stable_node_name(tmp_path):
    names = {}
    for node in NODE_NAMES:
        out, args = run_wrapper(tmp_path, node)
        assert out.returncode == 0, out.stderr
        argv = json.loads(out.stdout)
        assert argv[:2] == ["serve", "--node-name"] and argv[3:] == args, argv
        names[node] = argv[2]
        assert re.fullmatch(r"[a-z0-9]{1,20}", names[node]), names[node]
    assert names["worker1"] == "worker1", "a name that fits is kept as it is"
    assert len(set(names.values())) == len(NODE_NAMES), names
    again, _ = run_wrapper(tmp_path, NODE_NAMES[3])
    assert json.loads(again.stdout)[2] == names[NODE_NAMES[3]], "the name must survive a restart"


def test_wrapper_refuses_the_placeholder_key(tmp_path):
    placeholder = one("Secret", "cordon-api-key")["stringData"]["api-key"]
    out, _ = run_wrapper(tmp_path, "worker1", api_key=placeholder)
    assert out.returncode != 0 and out.stdout == ""
    assert "placeholder" in out.stderr


def test_dockerfile_copies_the_release_binary():
    text = (DEPLOY / "Dockerfile").read_text()
    assert "COPY target/x86_64-unknown-linux-gnu/release/cordon /usr/bin/cordon" in text
    for pkg in ("mmdebstrap", "gpgv", "debian-archive-keyring", "e2fsprogs", "runsc", "qemu-system-x86", "qemu-system-common"):
        assert re.search(rf"\b{re.escape(pkg)}\b", text), pkg
    assert container(daemonset(), "cordon")["image"].split(":")[0] == "cordon"
    assert os.access(DEPLOY / "Dockerfile.dockerignore", os.R_OK)
