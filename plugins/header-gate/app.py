"""header-gate: a policy in Python (componentize-py), written from wit/policy.wit alone.

Requests of the listed tenants must carry a header (e.g. `x-project`); without it they are
refused with the configured 4xx. With it, the request is tagged with its value (and may be
limited to a set of allowed values). The binding must select the header (`headers = [...]`).
Configuration (checked against schema.json beside this file):

    {"header": "x-project", "tenants": ["tenant-b"], "status": 400, "tag": "project",
     "allowed": ["alpha", "beta"]}
"""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import types

_config = {}


def _allow(tags):
    return types.Verdict_Allow(types.Mutations(tags=tags, clamp_max_tokens=None, add_headers=[]))


def _deny(status, message):
    return types.Verdict_Deny(types.Denial(status=status, message=message))


class Policy(exports.Policy):
    def configure(self, config: str) -> types.Hooks:
        global _config
        try:
            parsed = json.loads(config)
            _config = {
                "header": parsed["header"].lower(),
                "tenants": set(parsed.get("tenants", [])),
                "status": int(parsed.get("status", 400)),
                "tag": parsed.get("tag"),
                "allowed": set(parsed["allowed"]) if "allowed" in parsed else None,
            }
        except (ValueError, KeyError, TypeError) as e:
            raise Err(f"bad configuration: {e}")
        return types.Hooks.ON_REQUEST

    def on_request(self, request: types.RequestView) -> types.Verdict:
        header = _config["header"]
        values = [h.value for h in request.headers if h.name == header]
        if not values:
            if request.tenant in _config["tenants"]:
                return _deny(_config["status"], f"requests of {request.tenant} must send {header}")
            return _allow([])
        value = values[0]
        allowed = _config["allowed"]
        if allowed is not None and value not in allowed:
            return _deny(_config["status"], f"{header} {value!r} is not one of {sorted(allowed)}")
        tag = _config["tag"]
        return _allow([types.Tag(key=tag, value=value)] if tag else [])

    def on_disconnect(self, event: types.Disconnect) -> types.Directive:
        return types.Directive.ABORT_NOW

    def on_response_end(self, event: types.ResponseEnd) -> None:
        return None
