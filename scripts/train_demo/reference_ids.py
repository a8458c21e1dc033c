#!/usr/bin/env python3
"""Golden greedy ids for calla's demo model, computed by transformers on CPU in float32.

Given a model folder in the shipped layout (bf16 HF checkpoint, flat `qwen3_5_moe_text` config,
calla_vocab.json, tokenizer.json) and prompts, this:

  1. tokenises each prompt with the full Qwen3.6 tokenizer (`tokenizers`, tokenizer.json, no added
     BOS), maps tokenizer ids to compact rows through calla_vocab.json (ids not kept -> row 0);
  2. runs Qwen3_5MoeForCausalLM (eager attention, eager experts, float32 weights upcast exactly
     from bf16, 2 threads) as a cached greedy loop: one prefill, then one-token cached decode steps;
  3. at every step masks the rows that have no tokenizer id (row 0 "unknown" and any padding rows)
     to -inf and takes the argmax (the first index on ties);
  4. stops after the first <|im_end|> or <|endoftext|> (included in the output) or after
     --max-new tokens (--ignore-eos: always --max-new tokens);
  5. maps the generated rows back to tokenizer ids and writes them, with the prompt ids, to JSON.

It also re-checks every decision with one no-cache forward pass over prompt + generated tokens and
records the smallest top-1 minus top-2 logit margin, so a CI test can see how robust each id is.

    .venv-fixtures/bin/python scripts/train_demo/reference_ids.py --model assets/demo-src \
        --out testdata/demo_reference_ids.json                      # default prompts
    ... --prompt 'def fibonacci(n):' --chat 'What does the json module do?'
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import warnings

import numpy as np

warnings.filterwarnings("ignore")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import tokenizers  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM  # noqa: E402

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_PROMPTS = [
    ("text", "def fibonacci(n):"),
    ("text", "import os\nimport sys\n\n\ndef main():"),
    ("text", "class Stack:\n    \"\"\"A simple stack.\"\"\"\n"),
    ("text", "The json module"),
    ("chat", "What does the json module do?"),
    ("chat", "Write a Python function that reverses a string."),
    ("chat", "Explain the with statement in Python."),
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def argmax_first(row: np.ndarray) -> int:
    return int(np.argmax(row))  # numpy: first index on ties


def margin(row: np.ndarray) -> float:
    s = np.sort(row[np.isfinite(row)].astype(np.float64))
    return float(s[-1] - s[-2])


@torch.no_grad()
def cached_greedy(model, ids, max_new, mask, stop, ignore_eos):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    gen, margins, rows = [], [], []
    row = out.logits[0, -1].float().numpy().copy()
    while True:
        row[mask] = -np.inf
        t = argmax_first(row)
        gen.append(t)
        margins.append(margin(row))
        rows.append(row)
        if len(gen) >= max_new or (not ignore_eos and t in stop):
            break
        out = model(input_ids=torch.tensor([[t]], dtype=torch.long), cache=cache, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        row = out.logits[0, -1].float().numpy().copy()
    return gen, margins, np.stack(rows)


@torch.no_grad()
def nocache_check(model, ids, gen, mask, cached_rows):
    seq = list(ids) + list(gen)
    logits = model(input_ids=torch.tensor([seq], dtype=torch.long), use_cache=False).logits[0].float().numpy()
    rows = logits[len(ids) - 1: len(ids) - 1 + len(gen)].copy()
    rows[:, mask] = -np.inf
    same = [argmax_first(r) for r in rows] == list(gen)
    fin = np.isfinite(cached_rows)
    diff = float(np.abs(rows[fin] - cached_rows[fin]).max())
    return same, diff


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="assets/demo-src")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompt", action="append", default=[], help="plain-text prompt (repeatable)")
    ap.add_argument("--chat", action="append", default=[],
                    help="user message, rendered as calla run's chat prompt (repeatable)")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    vocab = json.load(open(os.path.join(args.model, "calla_vocab.json")))
    assert vocab["method"] == "calla-compact-vocab-v1" and vocab["unk_row"] == 0
    table = vocab["tokenizer_ids"]
    row_of = {t: i for i, t in enumerate(table) if t >= 0}
    mask = [i for i, t in enumerate(table) if t < 0]
    stop = {row_of[248046], row_of[248044]}  # <|im_end|>, <|endoftext|>
    tok = tokenizers.Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))

    model = Qwen3_5MoeForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager",
                                                  experts_implementation="eager")
    model.eval()
    assert model.config.vocab_size == len(table)

    prompts = [("text", p) for p in args.prompt] + [("chat", q) for q in args.chat]
    if not prompts:
        prompts = DEFAULT_PROMPTS
    records = []
    for kind, p in prompts:
        text = CHAT.format(q=p) if kind == "chat" else p
        tids = tok.encode(text, add_special_tokens=False).ids
        cids = [row_of.get(t, 0) for t in tids]
        gen, margins, rows = cached_greedy(model, cids, args.max_new, mask, stop, args.ignore_eos)
        same, diff = nocache_check(model, cids, gen, mask, rows)
        gen_t = [table[c] for c in gen]
        rec = {
            "kind": kind, "input": p, "prompt": text,
            "prompt_ids": tids, "prompt_compact_ids": cids,
            "prompt_unknown_positions": [i for i, c in enumerate(cids) if c == 0],
            "gen_ids": gen_t, "gen_compact_ids": gen,
            "stopped_on_eos": (not args.ignore_eos) and gen[-1] in stop,
            "completion": tok.decode(gen_t, skip_special_tokens=False),
            "min_top2_margin": min(margins), "top2_margins": [round(m, 6) for m in margins],
            "nocache_same_ids": same, "nocache_max_abs_logit_diff": diff,
        }
        records.append(rec)
        print(f"[{kind}] {p!r} -> {len(gen)} ids, min margin {min(margins):.4f}, no-cache same {same} "
              f"(max |d| {diff:.2e})\n{rec['completion']!r}", flush=True)

    res = {
        "model": os.path.abspath(args.model),
        "weights_sha256": sha256(os.path.join(args.model, "model.safetensors")),
        "calla_vocab_sha256": sha256(os.path.join(args.model, "calla_vocab.json")),
        "decode": ("greedy; rows whose calla_vocab tokenizer id is -1 are masked to -inf; argmax takes the first "
                   "index on ties; cached prefill then one-token cached decode; "
                   + ("always max_new tokens" if args.ignore_eos else
                      "stops after the first <|im_end|> or <|endoftext|>, which is included")),
        "ids": "prompt_ids and gen_ids are tokenizer ids (tokenizer.json); *_compact_ids are model rows",
        "max_new": args.max_new, "ignore_eos": args.ignore_eos,
        "oracle": {"class": "Qwen3_5MoeForCausalLM", "dtype": "float32 (weights stored bf16, upcast exactly)",
                   "attn_implementation": "eager", "experts_implementation": "eager",
                   "gated_delta_rule": "transformers' torch fallbacks (chunked prefill, recurrent decode)",
                   "threads": args.threads, "python": platform.python_version(), "torch": torch.__version__,
                   "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "prompts": records,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
