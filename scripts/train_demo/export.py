#!/usr/bin/env python3
"""Turn train.py's checkpoint (ckpt-*.safetensors: bf16, transformers' in-memory names) into the
shipped Hugging Face folder, written by transformers' own `save_pretrained` (flat
`qwen3_5_moe_text` config, `architectures: ["Qwen3_5MoeForCausalLM"]`, one tensor per expert as in
the tiny-a fixture), plus generation_config.json with COMPACT ids, calla_vocab.json, and copies of
tokenizer.json and chat_template.jinja.  Then reloads the folder and checks that the logits match
the checkpoint exactly (float32 compute).

    .venv-fixtures/bin/python scripts/train_demo/export.py --ckpt RUN_DIR --out assets/demo-src
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import shutil
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train as T  # noqa: E402


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True, help="folder with ckpt-*.safetensors (train.py --out)")
    ap.add_argument("--out", default="assets/demo-src")
    ap.add_argument("--vocab", default="assets/demo-src/calla_vocab.json")
    ap.add_argument("--tokenizer-dir", default="assets/tokenizer")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)

    import transformers
    from transformers import GenerationConfig, Qwen3_5MoeForCausalLM
    vocab = json.load(open(args.vocab))
    sd = {}
    for p in sorted(glob.glob(os.path.join(args.ckpt, "ckpt-*.safetensors"))):
        sd.update(load_file(p))
    model, cfg = T.build_model(transformers, vocab, args.seed, attn="eager")
    model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
    model.eval()
    T.set_experts(model, "eager")

    table = vocab["tokenizer_ids"]
    row = {t: i for i, t in enumerate(table) if t >= 0}
    eot, im_end = row[248044], row[248046]
    # the exported config: inference settings only
    model.config.architectures = ["Qwen3_5MoeForCausalLM"]
    model.config.output_router_logits = False
    model.config.use_cache = True
    model.config.bos_token_id = eot
    model.config.eos_token_id = eot
    model.config.pad_token_id = eot
    os.makedirs(args.out, exist_ok=True)
    # reference logits before the bf16 cast (which would also round the rotary inv_freq buffer)
    x = torch.tensor([[row.get(t, 0) for t in [750, 75698, 1700, 1699, 982]] + [im_end, eot]])
    with torch.no_grad():
        a = model(input_ids=x, use_cache=False).logits
    model.to(torch.bfloat16).save_pretrained(args.out)
    # generation_config.json: the released Qwen3.6 one, with ids mapped to compact rows
    gen = GenerationConfig(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot, do_sample=True,
                           temperature=1.0, top_k=20, top_p=0.95)
    gen.save_pretrained(args.out)
    if os.path.abspath(args.vocab) != os.path.abspath(os.path.join(args.out, "calla_vocab.json")):
        shutil.copy(args.vocab, os.path.join(args.out, "calla_vocab.json"))
    for fn in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(os.path.join(args.tokenizer_dir, fn), os.path.join(args.out, fn))

    # check: names and exact reload
    st = os.path.join(args.out, "model.safetensors")
    with safe_open(st, "pt") as f:
        names = sorted(f.keys())
        dtypes = {str(f.get_slice(n).get_dtype()) for n in names}
    print(f"model.safetensors: {len(names)} tensors, dtypes {dtypes}, {os.path.getsize(st):,} bytes")
    print("  e.g.", [n for n in names if "layers.0.mlp" in n][:4])
    m2 = Qwen3_5MoeForCausalLM.from_pretrained(args.out, dtype=torch.float32, attn_implementation="eager",
                                               experts_implementation="eager")
    m2.eval()
    with torch.no_grad():
        b = m2(input_ids=x, use_cache=False).logits
    d = (a - b).abs().max().item()
    print(f"reload check: max |dlogit| {d:.3g}")
    assert d == 0.0, d
    info = {
        "files": {fn: {"bytes": os.path.getsize(os.path.join(args.out, fn)), "sha256": sha256(os.path.join(args.out, fn))}
                  for fn in ("config.json", "generation_config.json", "model.safetensors", "calla_vocab.json",
                             "tokenizer.json", "chat_template.jinja")},
        "tensors": len(names), "params": sum(p.numel() for p in m2.parameters()),
        "exported_with": {"transformers": transformers.__version__, "torch": torch.__version__},
    }
    json.dump(info, open(os.path.join(args.out, "export_manifest.json"), "w"), indent=1)
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    sys.exit(main())
