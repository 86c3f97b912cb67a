"""llama.cpp's side of `scripts/bench-prefix-vs-llamacpp`: time to first token of the very
prompts `bulkhead bench prefix --prompts-out FILE` measured (token ids), in the same order,
with prefix reuse off and on. Prints one JSON object on stdout.

"On" is llama-cpp-python's own reuse: `Llama.generate` keeps the KV of the longest prefix the
new prompt shares with the tokens already in its context (one sequence: the previous prompt)
and evaluates only the rest. "Off" resets the context before each prompt. Each side has its
own `Llama`, as ours has its own engine; greedy sampling of one token, as ours.

Uses llama-cpp-python 0.3.36, loaded by scripts/llamacpp_cpu.py.
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import llamacpp_cpu  # noqa: E402


def first_token_seconds(llm, prompt, reuse):
    """Seconds from the prompt to its first sampled token."""
    if not reuse:
        llm.reset()
    start = time.perf_counter()
    tokens = llm.generate(prompt, temp=0.0, reset=True)
    next(tokens)
    elapsed = time.perf_counter() - start
    tokens.close()
    return elapsed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="the JSON `bench prefix --prompts-out` wrote")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    prompts = json.load(open(args.prompts))["prompts"]
    n_ctx = max(len(p) for p in prompts) + 64
    load = lambda: llamacpp_cpu.load(
        args.model,
        n_ctx=n_ctx,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=512,
        verbose=False,
    )
    sides = {"off": load(), "on": load()}
    ttft = {"off": [], "on": []}
    # The sides alternate prompt by prompt, as ours do.
    for prompt in prompts:
        for side, llm in sides.items():
            ttft[side].append(first_token_seconds(llm, prompt, reuse=side == "on"))
    ms = lambda v: statistics.median(v) * 1e3
    print(json.dumps({
        "engine": "llama.cpp",
        "prompts": len(prompts),
        "ttft_ms_cache_off": ms(ttft["off"]),
        "ttft_ms_cache_on": ms(ttft["on"]),
        "ttft_off_over_on": statistics.median(o / n for o, n in zip(ttft["off"], ttft["on"])),
    }))


if __name__ == "__main__":
    main()
