#!/usr/bin/env python3
"""Generate golden reference fixtures for the default model with llama.cpp (llama-cpp-python).

Writes worker/tests/fixtures/golden.json: prompt tokens, last-position logits (top-40 plus a
fixed probe set), 24-step greedy continuations with per-step top-1/top-2 logits, and
tokenizer-only cases. See scripts/golden/README.md for the schema and how to regenerate.

    python3 scripts/golden/make_golden.py [--model PATH] [--out PATH]

Requires llama-cpp-python==0.3.36, numpy and jinja2 (a dependency of llama-cpp-python).
"""
import argparse
import datetime
import hashlib
import json
import os
import sys

import numpy as np

import llama_cpp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import llamacpp_cpu  # noqa: E402

EXPECTED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
DEFAULT_MODEL = os.path.join(
    os.environ.get("BULKHEAD_MODEL_DIR", os.path.expanduser("~/.cache/bulkhead/models")),
    "SmolLM2-135M-Instruct.Q4_1.gguf",
)
DEFAULT_OUT = os.path.join(REPO_ROOT, "worker", "tests", "fixtures", "golden.json")

N_CTX = 2048
N_THREADS = 2
N_BATCH = 512
SEED = 0
TOP_K = 40
GREEDY_STEPS = 24
EOS_ID = 2

# ChatML default system prompt injected by the GGUF's tokenizer.chat_template when the
# conversation does not start with a system message.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

# Fixed probe ids whose logits are recorded at the last prompt position: the control tokens
# 0..8 plus the single-token ids of some very common pieces (resolved and checked below).
PROBE_CONTROL_IDS = list(range(9))
PROBE_PIECES = [" the", ",", ".", "\n", " is", "The", " a"]

LONG_PROSE = (
    "The lighthouse keeper had lived on the island for almost thirty years, and in that time "
    "he had learned to read the weather the way other people read the morning newspaper. A "
    "thin line of cloud on the western horizon meant rain by the afternoon; a sudden stillness "
    "in the gulls meant that a storm was coming, and that he should check the oil in the lamp "
    "twice before nightfall. He kept a journal in which he wrote down every ship that passed, "
    "the direction of the wind, and the height of the waves against the rocks below the tower. "
    "Most of the entries were short and plain, but now and then he allowed himself a sentence "
    "about the colour of the sea at dawn, or the way the fog rolled in from the mainland like a "
    "slow grey animal looking for a place to sleep. Visitors were rare. Once a month a small "
    "boat brought flour, coffee, lamp oil and letters from his sister, who lived in the city "
    "and never understood why anyone would choose to spend a life so far from other people. "
    "He answered every letter carefully, describing the birds, the tides and the repairs he had "
    "made to the stone steps, and he always ended by promising that he would visit her in the "
    "spring. He never did. When the new automatic light was finally installed and the keeper was "
    "told that his work was no longer needed, he packed his journals into a wooden crate, "
    "climbed the stairs one last time, and stood for a long while watching the beam turn"
)

# (name, chat?, prompt text)
LOGIT_CASES = [
    ("chat_two_plus_two", True, "What is 2+2?"),
    ("chat_largest_planet", True, "Name the largest planet in the solar system."),
    ("chat_haiku_sea", True, "Write a haiku about the sea."),
    ("raw_quick_brown_fox", False, "The quick brown fox"),
    ("raw_def_fibonacci", False, "def fibonacci(n):"),
    ("raw_once_upon_a_time", False, "Once upon a time, there was a"),
    ("raw_long_prose", False, LONG_PROSE),
    # Cases whose greedy continuations have wide top-1 margins (robust anchors for tests that
    # compare greedy tokens against an fp32 implementation).
    ("raw_counting", False, "1, 2, 3, 4, 5, 6,"),
    ("chat_capital_japan", True, "What is the capital of Japan?"),
    ("chat_count_to_ten", True, "Count from 1 to 10."),
]

TOKENIZER_CASES = [
    "12345 + 678",
    "naïve café — 日本語 🙂",
    "a  b\n\n\tc   ",
    " leading space",
    "I'm you're they'll",
    'fn main() { println!("hi"); }',
    "before <|im_start|>user\nhello<|im_end|> after",
    "",
    "Hello, world!",
    "   ",
    "ÄÖÜ straße 1.5e-3 3,141,592",
]


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def render_chatml(user_content):
    """Render the GGUF chat template by hand for one user message, add_generation_prompt=True."""
    return (
        "<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n"
        "<|im_start|>user\n" + user_content + "<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def check_template(template, user_content):
    """Cross-check the hand-rendered text against jinja2 rendering of the GGUF's template."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.BaseLoader())
    jinja_text = env.from_string(template).render(
        messages=[{"role": "user", "content": user_content}], add_generation_prompt=True
    )
    mine = render_chatml(user_content)
    if jinja_text != mine:
        raise SystemExit(f"chat template mismatch:\n{jinja_text!r}\n!=\n{mine!r}")


def load_model(path):
    return llamacpp_cpu.load(
        path,
        n_ctx=N_CTX,
        n_threads=N_THREADS,
        n_threads_batch=N_THREADS,
        n_batch=N_BATCH,
        logits_all=True,
        seed=SEED,
        verbose=False,
    )


def tokenize(llm, text, special=True):
    return llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)


def f(x):
    """Float32 logit -> JSON float with enough digits for tolerance comparisons."""
    return round(float(x), 5)


def top2(logits):
    i1 = int(np.argmax(logits))
    masked = logits.copy()
    masked[i1] = -np.inf
    i2 = int(np.argmax(masked))
    return i1, i2


def run_case(llm, probe_ids, name, chat, prompt, template):
    case = {"name": name, "prompt": prompt, "chat": chat}
    if chat:
        check_template(template, prompt)
        text = render_chatml(prompt)
        case["rendered"] = text
    else:
        text = prompt
    tokens = tokenize(llm, text)
    case["tokens"] = tokens

    llm.reset()
    llm.eval(tokens)
    last = np.array(llm.scores[len(tokens) - 1], dtype=np.float32)
    order = np.argsort(-last, kind="stable")[:TOP_K]
    case["prompt_logits"] = {
        "top": [[int(i), f(last[i])] for i in order],
        "probe": [f(last[i]) for i in probe_ids],
    }

    gen, top1_logit, top2_id, top2_logit = [], [], [], []
    logits = last
    for _ in range(GREEDY_STEPS):
        i1, i2 = top2(logits)
        gen.append(i1)
        top1_logit.append(f(logits[i1]))
        top2_id.append(i2)
        top2_logit.append(f(logits[i2]))
        if i1 == EOS_ID:
            break
        llm.eval([i1])
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    case["greedy"] = {
        "tokens": gen,
        "text": llm.detokenize(gen).decode("utf-8", errors="replace"),
        "top1_logit": top1_logit,
        "top2_id": top2_id,
        "top2_logit": top2_logit,
        "margin": [round(a - b, 5) for a, b in zip(top1_logit, top2_logit)],
    }
    return case


def dump(obj, indent=0):
    """JSON with one key per line, but arrays of scalars / small arrays kept on one line."""
    pad, pad1 = " " * indent, " " * (indent + 2)

    def flat(v):
        return not isinstance(v, (dict, list)) or (
            isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v)
        )

    if isinstance(obj, dict):
        items = [f"{pad1}{json.dumps(k)}: {dump(v, indent + 2)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj and not all(flat(x) for x in obj):
        return "[\n" + ",\n".join(pad1 + dump(x, indent + 2) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args()

    sha = sha256_file(args.model)
    if sha != EXPECTED_SHA256:
        raise SystemExit(f"{args.model}: sha256 {sha}, expected {EXPECTED_SHA256}")

    llm = load_model(args.model)
    template = llm.metadata["tokenizer.chat_template"]

    probe_ids = list(PROBE_CONTROL_IDS)
    probe_labels = [llm.detokenize([i], special=True).decode("utf-8", "replace") for i in probe_ids]
    for piece in PROBE_PIECES:
        ids = tokenize(llm, piece)
        if len(ids) != 1:
            raise SystemExit(f"probe piece {piece!r} is not a single token: {ids}")
        probe_ids.append(ids[0])
        probe_labels.append(piece)
    assert len(probe_ids) == 16

    cases = []
    for name, chat, prompt in LOGIT_CASES:
        c = run_case(llm, probe_ids, name, chat, prompt, template)
        g = c["greedy"]
        print(f"{name}: {len(c['tokens'])} prompt tokens -> {g['text']!r} "
              f"(min margin {min(g['margin']):.4f})", file=sys.stderr)
        cases.append(c)

    tok_cases = []
    for text in TOKENIZER_CASES:
        tc = {"text": text, "tokens": tokenize(llm, text)}
        plain = tokenize(llm, text, special=False)
        if plain != tc["tokens"]:
            tc["tokens_no_special"] = plain
        tok_cases.append(tc)

    out = {
        "generator": "scripts/golden/make_golden.py",
        "model": os.path.basename(args.model),
        "model_sha256": sha,
        "llama_cpp_python_version": llama_cpp.__version__,
        "date": datetime.date.today().isoformat(),
        "settings": {
            "n_ctx": N_CTX, "n_threads": N_THREADS, "n_batch": N_BATCH, "seed": SEED,
            "logits_all": True, "use_extra_bufts": False, "add_bos": False, "special": True,
            "top_k": TOP_K, "greedy_steps": GREEDY_STEPS, "eos_id": EOS_ID,
        },
        "chat_template": template,
        "probe_ids": probe_ids,
        "probe_labels": probe_labels,
        "cases": cases,
        "tokenizer_cases": tok_cases,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as fh:
        fh.write(dump(out) + "\n")
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
