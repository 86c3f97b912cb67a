"""Keeps the kustomizations readable by the `kubectl kustomize` of Debian's kubernetes-client
(kubectl 1.20, bundling kustomize v2.0.3) as well as today's, and proves two renders agree.

    python3 deploy/k8s/kustomize_compat.py syntax deploy/k8s/base deploy/k8s/overlays/*/
    python3 deploy/k8s/kustomize_compat.py same old.yaml new.yaml

`syntax` checks each directory's kustomization.yaml (runs everywhere, needs no old kubectl):
only fields kustomize v2.0.3 knows (it refuses any other: no `labels:`, `patches:`,
`components:`, `replacements:`), `resources:` and `patchesStrategicMerge:` name files (a base
directory goes under `bases:`), and the documents of one patch file, which stand for one patch
applied to several objects (v2.0.3 has no patch targets), are identical apart from the name.

`same` compares two renders of one overlay and exits non-zero, printing a diff, unless they hold
the same objects. Three differences are known and not counted:

- the hash suffix of generated ConfigMap and Secret names: kustomize v2.0.3 hashes the
  generator's name with the data, kustomize v5 leaves the name out, so the suffixes
  differ while every reference inside each render is consistent (the suffix is replaced by
  `-HASH` in both before comparing);
- the order of a container's env entries: a strategic-merge patch puts a patched entry where it
  was (v2.0.3) or first (today). The order only matters for `$(VAR)` references, which
  check_refs.py checks in each render, so env lists are compared sorted by name;
- an empty `annotations: {}` or `labels: {}` in metadata, which v2.0.3 writes on a ConfigMap an
  overlay's generator merges into: the same as none.
"""

import difflib
import json
import os
import re
import sys

import yaml

# The top-level fields of kustomize v2.0.3's Kustomization (it rejects unknown fields).
V2_FIELDS = {
    "apiVersion", "kind", "namePrefix", "nameSuffix", "namespace", "commonLabels",
    "commonAnnotations", "resources", "bases", "crds", "configMapGenerator", "secretGenerator",
    "generatorOptions", "patchesStrategicMerge", "patchesJson6902", "images", "vars",
    "configurations",
}

# kustomize's suffix: 10 hex digits of a SHA-256 with 0, 1, 3, a, e spelled g, h, k, m, t.
HASHED = re.compile(r"^(.*)-[2456789bcdfghkmt]{10}$")


def syntax(directories):
    problems = []
    for d in directories:
        path = os.path.join(d, "kustomization.yaml")
        with open(path) as f:
            k = yaml.safe_load(f) or {}
        for field in sorted(set(k) - V2_FIELDS):
            problems.append(f"{path}: `{field}` is unknown to kustomize v2.0.3")
        for field in ("resources", "patchesStrategicMerge"):
            for entry in k.get(field, []):
                if not os.path.isfile(os.path.join(d, entry)):
                    problems.append(f"{path}: {field} entry {entry!r} is not a file"
                                    + (" (a base goes under `bases:`)" if field == "resources" else ""))
        for entry in k.get("patchesStrategicMerge", []):
            patch = os.path.join(d, entry)
            if not os.path.isfile(patch):
                continue
            with open(patch) as f:
                docs = [p for p in yaml.safe_load_all(f) if p]
            for p in docs:
                p["metadata"].pop("name", None)
            if any(p != docs[0] for p in docs):
                problems.append(f"{patch}: its documents differ in more than metadata.name")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        sys.exit(1)
    print(f"{len(directories)} kustomizations use only what kustomize v2.0.3 reads")


def normalized(path):
    with open(path) as f:
        objects = [o for o in yaml.safe_load_all(f) if o]
    renames = {}
    for o in objects:
        m = HASHED.match(o["metadata"]["name"])
        if o["kind"] in ("ConfigMap", "Secret") and m:
            renames[o["metadata"]["name"]] = f"{m.group(1)}-HASH"

    def walk(node, key=None):
        if isinstance(node, dict):
            return {k: walk(v, k) for k, v in node.items()
                    if not (key == "metadata" and k in ("annotations", "labels") and v == {})}
        if isinstance(node, list):
            items = [walk(v) for v in node]
            if key == "env":
                items.sort(key=lambda e: e["name"])
            return items
        if isinstance(node, str):
            return renames.get(node, node)
        return node

    objects = [walk(o) for o in objects]
    objects.sort(key=lambda o: (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]))
    return objects


def same(a, b):
    left, right = normalized(a), normalized(b)
    if left != right:
        def lines(objects):
            return json.dumps(objects, indent=1, sort_keys=True).splitlines()
        for line in difflib.unified_diff(lines(left), lines(right), a, b, lineterm=""):
            print(line)
        print(f"error: {a} and {b} render different objects", file=sys.stderr)
        sys.exit(1)
    print(f"{a} and {b}: the same {len(left)} objects")


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "syntax":
        syntax(sys.argv[2:])
    elif len(sys.argv) == 4 and sys.argv[1] == "same":
        same(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
