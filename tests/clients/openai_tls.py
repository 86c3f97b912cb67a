"""The official `openai` Python client against a Bulkhead gateway whose listeners take TLS.

    python tests/clients/openai_tls.py API ADMIN CA KEY ADMIN_TOKEN

API and ADMIN are the listeners' host:port, CA the PEM file of the CA that issued their
certificate. Waits (bounded) until the gateway routes, then runs each check, prints one line
per check, and exits non-zero on the first failure. Called by tests/all/gateway.rs.
"""

import http.client
import ssl
import sys
import time

import openai

TIMEOUT = 120


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        sys.exit(1)


def get_over_tls(addr, path, token, context):
    """(status, body) of GET `path` at `addr` over TLS."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPSConnection(host, int(port), context=context, timeout=10)
    conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
    response = conn.getresponse()
    return response.status, response.read().decode()


def status_over_tls(addr, path, token, context):
    return get_over_tls(addr, path, token, context)[0]


def handshakes(metrics):
    """The TLS handshake counts in a /metrics text, by result."""
    counts = {}
    for line in metrics.splitlines():
        if line.startswith("bulkhead_gateway_tls_handshakes_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels.split('"')[1]] = int(value)
    return counts


def plain_http_answer(addr):
    """What a plain-HTTP request to `addr` gets: (status, body), or the error raised."""
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/v1/models")
        response = conn.getresponse()
        return response.status, response.read().decode()
    except (http.client.HTTPException, OSError) as e:
        return type(e).__name__


def main():
    api, admin, ca, key, admin_token = sys.argv[1:6]
    trusting = ssl.create_default_context(cafile=ca)

    deadline = time.monotonic() + 60
    while status_over_tls(admin, "/healthz", admin_token, trusting) != 200:
        if time.monotonic() > deadline:
            check("the gateway becomes healthy (admin over TLS)", False)
        time.sleep(0.2)
    check("admin /healthz over TLS", True)
    check("admin /metrics over TLS", status_over_tls(admin, "/metrics", admin_token, trusting) == 200)

    client = openai.OpenAI(
        base_url=f"https://{api}/v1", api_key=key, timeout=TIMEOUT, max_retries=0,
        http_client=openai.DefaultHttpx2Client(verify=trusting),
    )
    model = client.models.list().data[0].id
    check("models.list over TLS", bool(model), repr(model))
    question = [{"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=32)
    check("chat over TLS: the answer contains 4", "4" in r.choices[0].message.content, repr(r.choices[0].message.content))
    stream = client.chat.completions.create(
        model=model, messages=question, temperature=0, max_tokens=32, stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage = [], None
    for chunk in stream:
        usage = chunk.usage or usage
        pieces.extend(c.delta.content for c in chunk.choices if c.delta.content)
    check("streamed chat over TLS", "4" in "".join(pieces) and usage is not None, repr("".join(pieces)))

    # A client that does not trust the CA gets no connection (the system's roots do not have it).
    untrusting = openai.OpenAI(base_url=f"https://{api}/v1", api_key=key, timeout=30, max_retries=0)
    try:
        untrusting.models.list()
        check("a client not trusting the CA is refused", False)
    except openai.APIConnectionError as e:
        check("a client not trusting the CA is refused", "CERTIFICATE_VERIFY_FAILED" in repr(e.__cause__), repr(e.__cause__))

    for name, addr in (("API", api), ("admin", admin)):
        answer = plain_http_answer(addr)
        check(
            f"plain HTTP to the {name} port is told to use HTTPS",
            isinstance(answer, tuple) and answer[0] == 400 and '"code":"https_required"' in answer[1],
            repr(answer),
        )

    # The refusals are counted: the untrusting client's alert and the two plain requests.
    _, metrics = get_over_tls(admin, "/metrics", admin_token, trusting)
    counts = handshakes(metrics)
    check(
        "the handshakes are counted by how they ended",
        counts.get("completed", 0) >= 3 and counts.get("refused", 0) >= 3,
        repr(counts),
    )


main()
