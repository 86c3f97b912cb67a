"""Cross-reference checks over one rendered overlay (`kubectl kustomize` output): what the
schemas cannot see. Every name a pod refers to exists (ConfigMaps, Secrets, claims, volumes,
probe ports), every Service selects a workload that exposes its target port, the HPA and PDBs
target real workloads, and the addresses the gateway configuration and the decode workers dial
are Services with those ports, every `$(VAR)` in an env value names a variable defined above it
(Kubernetes expands only those), every object but the Namespace is in that Namespace (names
resolve only within one), and every object carries the `app.kubernetes.io/part-of` label
(written per object in the base, see deploy/k8s/base/kustomization.yaml). Exits non-zero
listing every problem.

    python3 deploy/k8s/check_refs.py rendered.yaml
"""

import re
import sys
import tomllib

import yaml

PART_OF = ("app.kubernetes.io/part-of", "bulkhead")
VAR_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def main(path):
    with open(path) as f:
        objects = [o for o in yaml.safe_load_all(f) if o]
    problems = []
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
        if (o["metadata"].get("labels") or {}).get(PART_OF[0]) != PART_OF[1]:
            problems.append(f"{o['kind']} {o['metadata']['name']}: no label {PART_OF[0]}: {PART_OF[1]}")
    namespaces = list(by_kind.get("Namespace", {}))
    if len(namespaces) != 1:
        problems.append(f"{len(namespaces)} Namespaces, expected one")
    for o in objects:
        if o["kind"] != "Namespace" and namespaces and o["metadata"].get("namespace") != namespaces[0]:
            problems.append(f"{o['kind']} {o['metadata']['name']}: not in Namespace {namespaces[0]}")
    workloads = {**by_kind.get("Deployment", {}), **by_kind.get("StatefulSet", {})}

    def exists(kind, name, where):
        if name not in by_kind.get(kind, {}):
            problems.append(f"{where}: {kind} {name!r} is not defined")

    def matching(selector):
        return [
            w for w in workloads.values()
            if selector and all(
                w["spec"]["template"]["metadata"].get("labels", {}).get(k) == v
                for k, v in selector.items())
        ]

    def port_names(workload):
        spec = workload["spec"]["template"]["spec"]
        return {p.get("name") for c in spec["containers"] for p in c.get("ports", [])} | {
            p["containerPort"] for c in spec["containers"] for p in c.get("ports", [])}

    for name, w in workloads.items():
        spec = w["spec"]["template"]["spec"]
        where = f"{w['kind']} {name}"
        selector = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"].get("labels", {})
        if any(labels.get(k) != v for k, v in selector.items()):
            problems.append(f"{where}: its selector does not match its pod labels")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for v in volumes.values():
            if "configMap" in v:
                exists("ConfigMap", v["configMap"]["name"], where)
            if "secret" in v:
                exists("Secret", v["secret"]["secretName"], where)
            if "persistentVolumeClaim" in v:
                exists("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"], where)
        for c in spec.get("initContainers", []) + spec["containers"]:
            cwhere = f"{where}/{c['name']}"
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    problems.append(f"{cwhere}: mounts undefined volume {m['name']!r}")
            defined = set()
            for e in c.get("env", []):
                for var in VAR_REF.findall(e.get("value", "")):
                    if var not in defined:
                        problems.append(f"{cwhere}: env {e['name']} refers to $({var}), not defined above it")
                defined.add(e["name"])
                ref = e.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    exists("Secret", ref["secretKeyRef"]["name"], cwhere)
                if "configMapKeyRef" in ref:
                    exists("ConfigMap", ref["configMapKeyRef"]["name"], cwhere)
            ports = {p.get("name") for p in c.get("ports", [])} | {
                p["containerPort"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                action = c.get(probe, {})
                for kind in ("httpGet", "tcpSocket", "grpc"):
                    if kind in action and action[kind]["port"] not in ports:
                        problems.append(f"{cwhere}: {probe} port {action[kind]['port']!r} is not a container port")
            if c in spec["containers"] and "requests" not in c.get("resources", {}):
                problems.append(f"{cwhere}: no resource requests")

    services = by_kind.get("Service", {})
    for name, s in services.items():
        targets = matching(s["spec"].get("selector", {}))
        if not targets:
            problems.append(f"Service {name}: selects no workload")
        for p in s["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            for w in targets:
                if target not in port_names(w):
                    problems.append(f"Service {name}: target port {target!r} is not a port of {w['metadata']['name']}")

    for name, h in by_kind.get("HorizontalPodAutoscaler", {}).items():
        ref = h["spec"]["scaleTargetRef"]
        exists(ref["kind"], ref["name"], f"HorizontalPodAutoscaler {name}")
    for name, p in by_kind.get("PodDisruptionBudget", {}).items():
        if not matching(p["spec"]["selector"]["matchLabels"]):
            problems.append(f"PodDisruptionBudget {name}: selects no workload")

    def service_port(where, host, port):
        svc = services.get(host.split(".")[0])
        if svc is None:
            problems.append(f"{where}: {host} is not a Service")
        elif int(port) not in {p["port"] for p in svc["spec"]["ports"]}:
            problems.append(f"{where}: Service {host} has no port {port}")
        return svc

    # What the gateway and the decode workers dial.
    for cm in by_kind.get("ConfigMap", {}).values():
        text = (cm.get("data") or {}).get("gateway.toml")
        if text is None:
            continue
        config = tomllib.loads(text)
        for g in config.get("worker_groups", []):
            host, port = g["dns"].rsplit(":", 1)
            svc = service_port(f"gateway.toml worker group {g['name']}", host, port)
            if svc is not None and svc["spec"].get("clusterIP") != "None":
                problems.append(f"worker group {g['name']}: Service {host} is not headless (one record per pod)")
    for name, w in workloads.items():
        for c in w["spec"]["template"]["spec"]["containers"]:
            for e in c.get("env", []):
                if e["name"] == "BULKHEAD_PREFILL":
                    host, port = e["value"].removeprefix("http://").rsplit(":", 1)
                    service_port(f"{name} BULKHEAD_PREFILL", host, port)

    for p in problems:
        print(f"{path}: {p}", file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"{path}: {len(objects)} objects, every reference resolves")


if __name__ == "__main__":
    main(sys.argv[1])
