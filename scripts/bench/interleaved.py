"""The runs an interleaved comparison script left in a directory (`ours.N.json`,
`llamacpp.N.json`, N = 1..runs), and the two statistics every summary takes of them."""

import json
import statistics


def load(out, runs):
    """(ours, llama.cpp): each run's JSON object, in run order."""
    rows = lambda name: [json.load(open(f"{out}/{name}.{i}.json")) for i in range(1, runs + 1)]
    return rows("ours"), rows("llamacpp")


def median(rows, key):
    return statistics.median(r[key] for r in rows)


def paired(ours, llama, key):
    """The median of the per-run ratios ours / llama.cpp: each pair ran back to back, so it
    shrugs off a shared machine's slow phases."""
    return statistics.median(o[key] / l[key] for o, l in zip(ours, llama))
