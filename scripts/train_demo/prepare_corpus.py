#!/usr/bin/env python3
"""Build the training corpus and the compact vocabulary of calla's demo model.

Corpus: the Python standard library of the Python that runs this script (PSF License v2; the
licence text is `LICENSE.txt` in the same folder), in three kinds of documents:

  code  every stdlib `.py` file (sorted by path; site-packages and obvious data tables skipped),
  docs  the language-reference topics that ship in `pydoc_data/topics.py`,
  chat  question/answer pairs made from the stdlib's own docstrings and function sources,
        rendered in the exact prompt form `calla run` uses:
        <|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{answer}<|im_end|>\n

Documents are tokenised with the full Qwen3.6 tokenizer (tokenizers library, tokenizer.json), shuffled
with a fixed seed and joined with <|endoftext|>.  The compact vocabulary (method
"calla-compact-vocab-v1") is then: row 0 = unknown, rows 1.. = the K most frequent BPE ids of the
training split plus all 33 added ids 248044..248076, sorted by tokenizer id.  Every tokenizer id not
kept maps to row 0.  K is chosen so that 1 + K + 33 == --vocab (a multiple of 64: no padding rows).

Outputs (in --out):
  corpus.npz          train (uint16 compact ids), val (uint16 compact ids)
  calla_vocab.json    {"method": "calla-compact-vocab-v1", "unk_row": 0, "tokenizer_ids": [-1, ...]}
  corpus_manifest.json  counts, coverage, hashes, versions, licence

Run with the fixtures venv (it has `tokenizers`):
  .venv-fixtures/bin/python scripts/train_demo/prepare_corpus.py --out assets/demo-src
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import platform
import random
import sys
import sysconfig
import textwrap
import time

import numpy as np
import tokenizers

FIRST_ADDED = 248044
LAST_ADDED = 248076
ADDED_IDS = list(range(FIRST_ADDED, LAST_ADDED + 1))  # 33 ids
EOT = 248044       # <|endoftext|>
IM_START = 248045  # <|im_start|>
IM_END = 248046    # <|im_end|>
THINK = 248068
END_THINK = 248069

# Prompt form of `calla run` (chat template, add_generation_prompt, thinking disabled)
CHAT_PREFIX = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CHAT_SUFFIX = "<|im_end|>\n"

SKIP_DIRS = {"site-packages", "__pycache__", "idlelib/Icons"}
# Mechanically generated tables / data blobs: they teach nothing and waste vocabulary.
SKIP_FILES = {
    "encodings/", "unicodedata", "test/test_unicodedata.py", "pydoc_data/topics.py",
    "test/test_codecmaps", "test/test_normalization.py", "_pydecimal.py.tables",
    "lib2to3/tests/data/", "test/cjkencodings", "test/decimaltestdata",
}


def sha256_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def stdlib_files(root: str):
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames
                             if d not in SKIP_DIRS and not (rel_dir == "." and d in ("site-packages", "config-3.11-x86_64-linux-gnu")))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            rel = os.path.normpath(os.path.join(rel_dir, fn))
            if any(s in rel for s in SKIP_FILES):
                continue
            out.append(rel)
    return sorted(out)


def keep_code(text: str) -> bool:
    if not text.strip():
        return False
    if len(text) > 400_000:
        return False
    lines = text.splitlines()
    if max((len(l) for l in lines), default=0) > 2000:
        return False
    non_ascii = sum(1 for c in text if ord(c) > 127)
    return non_ascii <= 0.02 * len(text)


def clean_doc(doc: str, limit: int) -> str:
    doc = textwrap.dedent(doc).strip()
    if len(doc) > limit:
        cut = doc.rfind("\n\n", 0, limit)
        doc = doc[:cut] if cut > 200 else doc[:limit].rsplit(" ", 1)[0]
    return doc.strip()


def module_name(rel: str) -> str:
    m = rel[:-3].replace(os.sep, ".")
    if m.endswith(".__init__"):
        m = m[: -len(".__init__")]
    return m


def chat_pairs(rel: str, text: str, rng: random.Random):
    """(question, answer) pairs from one non-test stdlib module."""
    mod = module_name(rel)
    if mod.startswith(("test", "idlelib.idle_test", "lib2to3.tests", "tkinter.test", "ctypes.test",
                       "unittest.test", "distutils.tests")) or ".test" in mod:
        return []
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    pairs = []
    mdoc = ast.get_docstring(tree)
    if mdoc and len(mdoc) > 40:
        q = rng.choice([f"What is the {mod} module for?", f"Tell me about the Python module {mod}.",
                        f"What does the {mod} module do?", f"Explain the {mod} module."])
        pairs.append((q, clean_doc(mdoc, 1200)))
    lines = text.splitlines()

    def visit(node, prefix):
        for ch in node.body:
            if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if ch.name.startswith("_"):
                    continue
                qual = f"{prefix}{ch.name}"
                doc = ast.get_docstring(ch)
                kind = "class" if isinstance(ch, ast.ClassDef) else "function"
                if doc and len(doc) > 30:
                    q = rng.choice([f"What does {mod}.{qual} do?", f"Explain {mod}.{qual}.",
                                    f"What is {qual} in the {mod} module?",
                                    f"How do I use {mod}.{qual}?", f"Describe the {kind} {mod}.{qual}."])
                    pairs.append((q, clean_doc(doc, 900)))
                if kind == "function" and ch.end_lineno is not None:
                    n = ch.end_lineno - ch.lineno + 1
                    if 3 <= n <= 30 and rng.random() < 0.5:
                        start = ch.lineno - 1 - len(ch.decorator_list)
                        src = textwrap.dedent("\n".join(lines[start: ch.end_lineno]))
                        q = rng.choice([f"Write the function {ch.name} from {mod}.",
                                        f"Show me how {mod}.{qual} is implemented.",
                                        f"Write a Python function {ch.name}.",
                                        f"Implement {qual} in Python."])
                        pairs.append((q, f"Here is the implementation:\n\n```python\n{src}\n```"))
                if isinstance(ch, ast.ClassDef):
                    visit(ch, f"{qual}.")

    visit(tree, "")
    return pairs


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="assets/demo-src")
    ap.add_argument("--tokenizer", default="assets/tokenizer/tokenizer.json")
    ap.add_argument("--vocab", type=int, default=16384, help="compact vocab rows (multiple of 64)")
    ap.add_argument("--seed", type=int, default=0, help="corpus shuffle / question-template seed")
    ap.add_argument("--val-every", type=int, default=100, help="every Nth document (after shuffle) is validation")
    args = ap.parse_args(argv)
    assert args.vocab % 64 == 0
    t0 = time.time()
    root = sysconfig.get_paths()["stdlib"]
    rng = random.Random(args.seed)

    docs = []  # (kind, name, text)
    n_code_skipped = 0
    for rel in stdlib_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            n_code_skipped += 1
            continue
        if not keep_code(text):
            n_code_skipped += 1
            continue
        text = text.replace("\r\n", "\n")
        docs.append(("code", rel, text))
        for i, (q, a) in enumerate(chat_pairs(rel, text, rng)):
            docs.append(("chat", f"{rel}#{i}", CHAT_PREFIX.format(q=q) + a + CHAT_SUFFIX))
    ns = {}
    with open(os.path.join(root, "pydoc_data", "topics.py"), encoding="utf-8") as f:
        exec(f.read(), ns)
    for k in sorted(ns["topics"]):
        docs.append(("docs", f"pydoc_data/topics.py:{k}", ns["topics"][k].strip() + "\n"))
        title = k.replace("-", " ")
        body = clean_doc(ns["topics"][k], 1500)
        docs.append(("chat", f"topic:{k}",
                     CHAT_PREFIX.format(q=rng.choice([f"Explain {title} in Python.",
                                                      f"Tell me about {title} in Python."])) + body + CHAT_SUFFIX))

    rng.shuffle(docs)
    print(f"{len(docs)} documents ({n_code_skipped} files skipped) in {time.time() - t0:.1f}s", flush=True)

    tok = tokenizers.Tokenizer.from_file(args.tokenizer)
    enc = tok.encode_batch([d[2] for d in docs], add_special_tokens=False)
    ids = [np.asarray(e.ids, dtype=np.int64) for e in enc]
    print(f"tokenised in {time.time() - t0:.1f}s", flush=True)

    is_val = [(i % args.val_every) == args.val_every - 1 for i in range(len(docs))]
    # Special ids inside plain documents (a literal '<|endoftext|>' in a source file) would be
    # indistinguishable from our separators: count them and drop such documents.
    dropped = []
    for i, (kind, name, _) in enumerate(docs):
        if kind != "chat" and (ids[i] >= FIRST_ADDED).any():
            dropped.append(name)
    drop = set(dropped)

    counts = np.zeros(LAST_ADDED + 1, dtype=np.int64)
    for i in range(len(docs)):
        if not is_val[i] and docs[i][1] not in drop:
            counts += np.bincount(ids[i], minlength=LAST_ADDED + 1)
    regular = counts[:FIRST_ADDED].copy()
    k = args.vocab - 1 - len(ADDED_IDS)
    order = np.lexsort((np.arange(FIRST_ADDED), -regular))  # by count desc, then id asc (deterministic)
    kept = order[:k]
    kept = kept[regular[kept] > 0]
    keep_ids = sorted(int(x) for x in kept) + ADDED_IDS
    table = [-1] + keep_ids
    table += [-1] * (args.vocab - len(table))  # padding rows (only if the corpus has < k distinct ids)
    lut = np.zeros(LAST_ADDED + 1, dtype=np.int64)  # tokenizer id -> compact row; 0 = unknown
    for row, tid in enumerate(table):
        if tid >= 0:
            lut[tid] = row
    assert lut[EOT] and lut[IM_START] and lut[IM_END] and lut[THINK] and lut[END_THINK]

    train_parts, val_parts = [], []
    stats = {"code": 0, "docs": 0, "chat": 0}
    n_tok_train = n_tok_val = n_unk_train = n_unk_val = 0
    for i, (kind, name, _) in enumerate(docs):
        if name in drop:
            continue
        c = lut[ids[i]]
        part = np.concatenate([c, [lut[EOT]]])
        if is_val[i]:
            val_parts.append(part)
            n_tok_val += len(c)
            n_unk_val += int((c == 0).sum())
        else:
            train_parts.append(part)
            n_tok_train += len(c)
            n_unk_train += int((c == 0).sum())
            stats[kind] += len(c)
    train = np.concatenate(train_parts).astype(np.uint16)
    val = np.concatenate(val_parts).astype(np.uint16)
    os.makedirs(args.out, exist_ok=True)
    npz = os.path.join(args.out, "corpus.npz")
    np.savez_compressed(npz, train=train, val=val)
    vocab = {"method": "calla-compact-vocab-v1", "unk_row": 0, "tokenizer_ids": table}
    with open(os.path.join(args.out, "calla_vocab.json"), "w") as f:
        json.dump(vocab, f, separators=(",", ":"))
        f.write("\n")

    total_regular = int(regular.sum())
    manifest = {
        "corpus": "Python standard library source + pydoc_data topics + chat Q/A made from stdlib docstrings",
        "licence": "Python Software Foundation License Version 2 (PSF-2.0); the text ships as LICENSE.txt "
                   "in the stdlib folder below",
        "python": platform.python_version(), "stdlib": root,
        "tokenizer": args.tokenizer,
        "tokenizer_sha256": sha256_bytes(open(args.tokenizer, "rb").read()),
        "tokenizers_version": tokenizers.__version__,
        "seed": args.seed, "val_every": args.val_every,
        "documents": {kind: sum(1 for d in docs if d[0] == kind and d[1] not in drop) for kind in stats},
        "documents_dropped_special_ids_in_text": dropped,
        "code_files_skipped_by_filter": n_code_skipped,
        "train_tokens": n_tok_train, "val_tokens": n_tok_val,
        "train_tokens_by_kind": stats,
        "separator": "<|endoftext|> after every document (compact row %d)" % int(lut[EOT]),
        "compact_vocab": {"rows": args.vocab, "kept_regular_ids": len(keep_ids) - len(ADDED_IDS),
                          "added_ids": [FIRST_ADDED, LAST_ADDED],
                          "distinct_regular_ids_in_train": int((regular > 0).sum()),
                          "train_unk_rate": n_unk_train / max(1, n_tok_train),
                          "val_unk_rate": n_unk_val / max(1, n_tok_val),
                          "coverage_train_regular": float(regular[kept].sum() / max(1, total_regular))},
        "special_rows": {name: int(lut[t]) for name, t in
                         [("<|endoftext|>", EOT), ("<|im_start|>", IM_START), ("<|im_end|>", IM_END),
                          ("<think>", THINK), ("</think>", END_THINK)]},
        "corpus_npz_sha256": sha256_bytes(open(npz, "rb").read()),
        "train_sha256": sha256_bytes(train.tobytes()), "val_sha256": sha256_bytes(val.tobytes()),
        "calla_vocab_sha256": sha256_bytes(open(os.path.join(args.out, "calla_vocab.json"), "rb").read()),
    }
    with open(os.path.join(args.out, "corpus_manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
    print(json.dumps({k: v for k, v in manifest.items() if k != "documents_dropped_special_ids_in_text"},
                     indent=1))
    print(f"done in {time.time() - t0:.1f}s; corpus.npz {os.path.getsize(npz) / 1e6:.1f} MB")


if __name__ == "__main__":
    sys.exit(main())
