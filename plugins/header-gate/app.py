"""header-gate: a policy in Python (componentize-py), written from wit/policy.wit alone.

Requests of the listed tenants must carry a header (e.g. `x-project`); without it (or with
it empty) they are refused with the configured 4xx. With it, the request is tagged with its
value (and may be limited to a set of allowed values). The binding must select the header
(`headers = [...]`). Configuration (checked against schema.json beside this file):

    {"header": "x-project", "tenants": ["tenant-b"], "status": 403, "tag": "project",
     "allowed": ["alpha", "beta"]}

The value is the client's: a value over 256 bytes, one with a character Python does not
call printable (controls, format and separator characters: every character the gateway
refuses in a tag, and some it takes), or the header sent twice with different values, is
refused with the configured status here, whatever the tenant. Passed on, it would make this plugin's answer invalid, which
fails the request as a plugin fault, or lets it through unchecked where the binding is
fail-open. Refusals quote at most the first 64 characters of the value.
"""

import json

from componentize_py_types import Err
from wit_world import exports
from wit_world.imports import types

_config = {}

# What the gateway takes as a tag's value (wit/policy.wit): at most 256 bytes, no control
# characters.
_MAX_TAG_VALUE = 256
_QUOTED = 64


def _allow(tags):
    return types.Verdict_Allow(types.Mutations(tags=tags, clamp_max_tokens=None, add_headers=[]))


def _deny(status, message):
    return types.Verdict_Deny(types.Denial(status=status, message=message))


def _taggable(value):
    """Whether the gateway would take `value` as a tag's value."""
    return len(value.encode()) <= _MAX_TAG_VALUE and value.isprintable()


def _quoted(value):
    """At most the first `_QUOTED` characters of a client's value, escaped."""
    shown = value[:_QUOTED]
    return ascii(shown) + ("..." if len(value) > _QUOTED else "")


class Policy(exports.Policy):
    def configure(self, config: str) -> types.Hooks:
        global _config
        try:
            parsed = json.loads(config)
            _config = {
                "header": parsed["header"].lower(),
                "tenants": set(parsed.get("tenants", [])),
                "status": int(parsed.get("status", 403)),
                "tag": parsed.get("tag"),
                "allowed": set(parsed["allowed"]) if "allowed" in parsed else None,
            }
        except (ValueError, KeyError, TypeError) as e:
            raise Err(f"bad configuration: {e}")
        return types.Hooks.ON_REQUEST

    def on_request(self, request: types.RequestView) -> types.Verdict:
        header = _config["header"]
        status = _config["status"]
        values = {h.value for h in request.headers if h.name == header}
        values.discard("")
        if not values:
            if request.tenant in _config["tenants"]:
                return _deny(status, f"requests of {request.tenant} must send {header}")
            return _allow([])
        # A proxy on the way may have appended its own: every value counts, so all must agree.
        if len(values) > 1:
            return _deny(status, f"{header} was sent with {len(values)} different values")
        (value,) = values
        if not _taggable(value):
            return _deny(
                status,
                f"{header} {_quoted(value)} is over {_MAX_TAG_VALUE} bytes or holds control characters",
            )
        allowed = _config["allowed"]
        if allowed is not None and value not in allowed:
            return _deny(status, f"{header} {_quoted(value)} is not an allowed value")
        tag = _config["tag"]
        return _allow([types.Tag(key=tag, value=value)] if tag else [])

    def on_disconnect(self, event: types.Disconnect) -> types.Directive:
        return types.Directive.ABORT_NOW

    def on_response_end(self, event: types.ResponseEnd) -> None:
        return None
