"""Medians and ratios of `scripts/bench-vs-llamacpp`'s interleaved runs."""

import json
import sys

import interleaved


def main():
    out, runs = sys.argv[1], int(sys.argv[2])
    ours, llama = interleaved.load(out, runs)
    med = interleaved.median
    paired = lambda key: interleaved.paired(ours, llama, key)
    rows = []
    for key, label in [("prefill_tok_s", "prefill tok/s (512-token prompt)"),
                       ("decode_b1_tok_s", "decode tok/s, batch 1")]:
        o, l = med(ours, key), med(llama, key)
        rows.append((label, o, l, o / l, paired(key)))
    b1, b8 = med(ours, "decode_b1_tok_s"), med(ours, "decode_b8_tok_s")
    rss_o, rss_l = med(ours, "peak_rss_bytes"), med(llama, "peak_rss_bytes")
    # llama.cpp runs in Python here: its process holds the interpreter and its imports too,
    # which a native llama.cpp does not. The interpreter's part is measured after importing
    # llama_cpp, so taking it away also takes libllama's resident pages: the ratio against
    # the rest is an upper bound.
    interp = med(llama, "interpreter_rss_bytes")
    rss_native = rss_l - interp
    print(f"{runs} interleaved runs, {ours[0]['threads']} threads, ours on {ours[0]['simd']}")
    print(f"{'':34} {'ours':>10} {'llama.cpp':>10} {'ratio':>7} {'paired':>7}")
    for label, o, l, r, p in rows:
        print(f"{label:34} {o:10.1f} {l:10.1f} {r:6.2f}x {p:6.2f}x")
    print(f"{'decode tok/s, batch 8 (aggregate)':34} {b8:10.1f} {'':10} {b8 / b1:6.2f}x of our batch 1")
    print(f"{'peak RSS MB':34} {rss_o / 1e6:10.1f} {rss_l / 1e6:10.1f} {rss_o / rss_l:6.2f}x"
          f"   (llama.cpp's includes {interp / 1e6:.0f} MB of Python)")
    print(f"{'peak RSS MB, llama.cpp less Python':34} {rss_o / 1e6:10.1f} {rss_native / 1e6:10.1f}"
          f" {rss_o / rss_native:6.2f}x")
    print(json.dumps({
        "runs": runs,
        "ours": {k: med(ours, k) for k in ("prefill_tok_s", "decode_b1_tok_s", "decode_b8_tok_s",
                                           "peak_rss_bytes")},
        "llamacpp": {k: med(llama, k) for k in ("prefill_tok_s", "decode_b1_tok_s",
                                                "peak_rss_bytes", "interpreter_rss_bytes")},
        "ratios": {"prefill": rows[0][3], "decode_b1": rows[1][3],
                   "prefill_paired": rows[0][4], "decode_b1_paired": rows[1][4],
                   "decode_b8_over_b1": b8 / b1, "peak_rss": rss_o / rss_l,
                   "peak_rss_native": rss_o / rss_native},
    }))


if __name__ == "__main__":
    main()
