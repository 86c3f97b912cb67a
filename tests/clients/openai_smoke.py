"""The official `openai` Python client against a Bulkhead gateway.

    python tests/clients/openai_smoke.py BASE_URL KEY

BASE_URL is the gateway's root (http://127.0.0.1:8080). Runs each check, prints one line per
check, and exits non-zero on the first failure. Called by tests/all/gateway.rs.
"""

import sys

import openai

TIMEOUT = 120


def check(name, ok, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        sys.exit(1)


def main():
    base, key = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, timeout=TIMEOUT, max_retries=0)

    models = client.models.list()
    model = models.data[0].id if models.data else None
    check("models.list names the served model", model is not None, repr(model))
    retrieved = client.models.retrieve(model)
    check("models.retrieve finds it", retrieved.id == model, repr(retrieved))
    try:
        client.models.retrieve("no-such-model")
        check("models.retrieve of an unknown model fails", False)
    except openai.NotFoundError as e:
        check("models.retrieve of an unknown model: 404 model_not_found", e.code == "model_not_found", repr(e.body))

    question = [{"role": "user", "content": "What is 2+2?"}]
    r = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=32)
    text = r.choices[0].message.content
    u = r.usage
    check("chat, greedy: the answer contains 4", "4" in text, repr(text))
    check(
        "chat: usage counts add up",
        u.prompt_tokens > 0 and u.completion_tokens > 0
        and u.total_tokens == u.prompt_tokens + u.completion_tokens,
        repr(u),
    )
    check("chat: finish_reason", r.choices[0].finish_reason in ("stop", "length"), r.choices[0].finish_reason)

    stream = client.chat.completions.create(
        model=model, messages=question, temperature=0, max_tokens=32, stream=True,
        stream_options={"include_usage": True},
    )
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.content:
                pieces.append(c.delta.content)
            if c.finish_reason:
                finish = c.finish_reason
    streamed = "".join(pieces)
    check("chat, streaming: same text as non-streaming", streamed == text, repr(streamed))
    check("chat, streaming: a finish_reason", finish in ("stop", "length"), repr(finish))
    check("chat, streaming: a usage chunk", usage is not None and usage.completion_tokens > 0, repr(usage))

    c = client.completions.create(model=model, prompt="The capital of", max_tokens=5, temperature=0)
    check("completions: text and usage", c.usage.completion_tokens > 0 and isinstance(c.choices[0].text, str),
          repr(c.choices[0].text))
    story = client.completions.create(model=model, prompt="Once upon a time", temperature=0)
    check("completions without max_tokens: OpenAI's default, 16",
          story.usage.completion_tokens == 16 and story.choices[0].finish_reason == "length",
          repr(story.usage))
    pieces = [ch.choices[0].text for ch in client.completions.create(
        model=model, prompt="The capital of", max_tokens=5, temperature=0, stream=True) if ch.choices]
    check("completions, streaming: same text", "".join(pieces) == c.choices[0].text, repr(pieces))

    try:
        client.chat.completions.create(model=model, messages=question, logprobs=True)
        check("logprobs: true is refused", False)
    except openai.BadRequestError as e:
        check("logprobs: true is refused by name", "logprobs" in str(e), str(e))

    try:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello " * 9000}], max_tokens=16)
        check("over the limit: refused", False)
    except openai.BadRequestError as e:
        check("over the limit: 400 context_length_exceeded", e.code == "context_length_exceeded", str(e))
        check("over the limit: the error names messages", e.param == "messages", str(e))
    try:
        client.completions.create(model=model, prompt="hello " * 9000, max_tokens=16)
        check("completions over the limit: refused", False)
    except openai.BadRequestError as e:
        check("completions over the limit: the error names prompt",
              e.code == "context_length_exceeded" and e.param == "prompt", str(e))

    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", timeout=TIMEOUT, max_retries=0)
    try:
        bad.chat.completions.create(model=model, messages=question)
        check("a wrong key: refused", False)
    except openai.AuthenticationError as e:
        check("a wrong key: 401 invalid_api_key", e.status_code == 401 and e.code == "invalid_api_key", str(e))


if __name__ == "__main__":
    main()
