"""Medians and ratios of `scripts/bench-prefix-vs-llamacpp`'s interleaved runs."""

import json
import sys

import interleaved


def main():
    out, runs = sys.argv[1], int(sys.argv[2])
    ours, llama = interleaved.load(out, runs)
    med = interleaved.median
    paired = lambda key: interleaved.paired(ours, llama, key)
    rows = [
        ("time to first token, reuse off (ms)", "ttft_ms_cache_off"),
        ("time to first token, reuse on (ms)", "ttft_ms_cache_on"),
        ("off / on", "ttft_off_over_on"),
    ]
    print(f"{runs} interleaved runs, {ours[0]['threads']} threads, "
          f"{ours[0]['shared_tokens']} shared + {ours[0]['question_tokens']} own tokens per prompt")
    print("ratio = ours / llama.cpp (for times, under 1 is ours faster)")
    print(f"{'':38} {'ours':>9} {'llama.cpp':>10} {'ratio':>7} {'paired':>7}")
    ratios = {}
    for label, key in rows:
        o, l = med(ours, key), med(llama, key)
        ratios[key] = o / l
        ratios[key + "_paired"] = paired(key)
        print(f"{label:38} {o:9.1f} {l:10.1f} {o / l:6.2f}x {paired(key):6.2f}x")
    print(json.dumps({
        "runs": runs,
        "ours": {key: med(ours, key) for _, key in rows},
        "llamacpp": {key: med(llama, key) for _, key in rows},
        "ours_over_llamacpp": ratios,
        "ours_prompt_tokens_read_from_cache_pct": med(ours, "prompt_tokens_read_from_cache_pct"),
    }))


if __name__ == "__main__":
    main()
