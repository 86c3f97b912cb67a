"""llama.cpp's figures for `scripts/bench-vs-llamacpp`, measured the way `bulkhead bench engine`
measures ours: prefill tokens/s of one prompt until its logits, and decode tokens/s of greedy
generation at batch 1. Prints one JSON object on stdout.

Uses llama-cpp-python 0.3.36, loaded by scripts/llamacpp_cpu.py (llama.cpp's AMX repacked
matmul off: it crashes on CPUs that report AMX, see scripts/golden/README.md).
"""

import argparse
import json
import os
import resource
import sys
import time

import llama_cpp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import llamacpp_cpu  # noqa: E402

# Must stay the prose of `src/bench/engine.rs` (TEXT).
TEXT = (
    "The harbour woke before the town did. Fishing boats slid out past the breakwater "
    "while the lamps along the quay were still lit, and the gulls followed them, crying over the "
    "grey water. In the market hall, traders stacked crates of apples and pears, argued about the "
    "price of salt, and drank coffee from chipped enamel mugs. "
)


def load(path, threads, n_ctx):
    return llamacpp_cpu.load(
        path,
        n_ctx=n_ctx,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=6144)
    args = ap.parse_args()

    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    llm = load(args.model, args.threads, args.n_ctx)
    text = TEXT * (1 + args.prefill_tokens * 6 // len(TEXT))
    tokens = llm.tokenize(text.encode(), add_bos=False, special=False)
    assert len(tokens) >= args.prefill_tokens, "benchmark text too short"

    llm.reset()
    start = time.perf_counter()
    llm.eval(tokens[: args.prefill_tokens])
    prefill = args.prefill_tokens / (time.perf_counter() - start)

    llm.reset()
    llm.eval(tokens[:32])
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    start = time.perf_counter()
    for _ in range(args.decode_tokens):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    decode = args.decode_tokens / (time.perf_counter() - start)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({
        "engine": "llama.cpp",
        "version": llama_cpp.__version__,
        "prefill_tok_s": prefill,
        "decode_b1_tok_s": decode,
        "peak_rss_bytes": peak,
        "interpreter_rss_bytes": base_rss,
    }))


if __name__ == "__main__":
    main()
