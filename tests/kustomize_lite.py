"""The subset of kustomize that deploy/k8s uses, for machines without kubectl.

Supported: `resources` (files and directories with a kustomization.yaml), `labels` (pairs added to
metadata.labels only), and `patches` holding JSON6902 `add` operations with a name/kind target. The deploy
tests check that this renders exactly what `kubectl kustomize` renders wherever kubectl exists.
"""

from __future__ import annotations

from pathlib import Path

import yaml


def render(directory: Path) -> list[dict]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects.extend(render(path))
        else:
            objects.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    for label_set in spec.get("labels", []):
        if label_set.get("includeSelectors") or label_set.get("includeTemplates"):
            raise NotImplementedError("only metadata labels are supported")
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(label_set["pairs"])
    for patch in spec.get("patches", []):
        target = patch["target"]
        for obj in objects:
            if obj["kind"] == target["kind"] and obj["metadata"]["name"] == target["name"]:
                for op in yaml.safe_load(patch["patch"]):
                    _apply_add(obj, op)
    return objects


def _apply_add(obj: dict, op: dict) -> None:
    if op["op"] != "add":
        raise NotImplementedError(op["op"])
    *parents, last = op["path"].strip("/").split("/")
    node = obj
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if last == "-":
        node.append(op["value"])
    elif isinstance(node, list):
        node.insert(int(last), op["value"])
    else:
        node[last] = op["value"]
