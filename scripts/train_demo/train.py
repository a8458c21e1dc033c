#!/usr/bin/env python3
"""Train calla's built-in demo model: a small Qwen3_5MoeForCausalLM (HF `qwen3_5_moe_text`) with
the real model's layer pattern (3 Gated DeltaNet layers, then 1 gated attention layer, x2),
routed experts + a sigmoid-gated shared expert, shrunk widths and a compact vocabulary
(see README.md beside this file and prepare_corpus.py).

    python scripts/train_demo/train.py --data assets/demo-src/corpus.npz --out OUT \
        --seed 1234 --steps 0 --time-budget 470           # steps 0 = pick from measured speed
    python scripts/train_demo/train.py ... --steps N     # exact replay of a recorded run

The LR schedule is linear warm-up for --warmup steps, then cosine to 10 % at the last step.  With
--steps 0 the step count is fixed from the time of steps 5..15 (inside the warm-up, so the run is
the same run as one started with --steps N for the N it prints and records).

Writes to OUT: ckpt-K.safetensors (bf16, transformers' in-memory parameter names, shards of at most
--shard-mb MiB; written every --ckpt-every seconds and at the end), train_log.csv, run.json (config,
timings, versions, samples), loss.png, and prints a log.  scripts/train_demo/export.py turns the
checkpoint into the shipped HF folder.

MTP: transformers' Qwen3_5Moe classes have no MTP head (they drop `mtp.*` on load), so no MTP head
is trained here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------------------------
# The demo model's configuration (flat Qwen3_5MoeTextConfig kwargs).  Token ids are COMPACT rows.
# ---------------------------------------------------------------------------------------------
VOCAB_ROWS = 16384
N_LAYERS = 8
DEMO_CONFIG = dict(
    vocab_size=VOCAB_ROWS,
    hidden_size=320,
    num_hidden_layers=N_LAYERS,
    layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(N_LAYERS)],
    # gated attention: 4 q heads (each with its output gate), 2 kv heads, head_dim 128, rotary 32 dims
    num_attention_heads=4, num_key_value_heads=2, head_dim=128,
    # Gated DeltaNet: 4 q/k heads, 8 v heads, head dims 64, conv kernel 4
    linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
    # MoE in every layer: 16 routed experts, top-4, plus one shared expert with a sigmoid gate
    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=256,
    hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False, attention_dropout=0.0,
    max_position_embeddings=262144, initializer_range=0.02, tie_word_embeddings=False,
    rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                         mrope_section=[6, 5, 5], mrope_interleaved=True),
    router_aux_loss_coef=0.01,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,  # set from calla_vocab.json
)


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def import_transformers():
    import transformers
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: F401
    return transformers


def build_model(transformers, vocab, seed, attn="sdpa"):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    kw = dict(DEMO_CONFIG)
    table = vocab["tokenizer_ids"]
    assert len(table) == kw["vocab_size"], (len(table), kw["vocab_size"])
    row = {t: i for i, t in enumerate(table) if t >= 0}
    kw["bos_token_id"] = row[248044]
    kw["eos_token_id"] = row[248044]
    kw["pad_token_id"] = row[248044]
    cfg = Qwen3_5MoeTextConfig(**kw)
    cfg._attn_implementation = attn
    torch.manual_seed(seed)
    model = Qwen3_5MoeForCausalLM(cfg)
    return model, cfg


def set_experts(model, impl):
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    else:
        model.config._experts_implementation = impl


def param_groups(model, wd):
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if p.ndim >= 2 and "embed_tokens" not in n:
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def lr_at(step, total, warmup, peak, floor=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def save_shards(model, out, shard_mb):
    """bf16 copy of the state dict (in-memory names), split into files of at most shard_mb MiB."""
    from safetensors.torch import save_file
    sd = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    limit = shard_mb * 1024 * 1024 - 65536
    shards, cur, size = [], {}, 0
    for k in sorted(sd):
        nb = sd[k].numel() * 2
        if cur and size + nb > limit:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = sd[k]
        size += nb
    shards.append(cur)
    for i, sh in enumerate(shards):
        tmp = os.path.join(out, f".tmp-ckpt-{i}")
        save_file(sh, tmp, metadata={"format": "pt", "shard": f"{i}/{len(shards)}"})
        os.replace(tmp, os.path.join(out, f"ckpt-{i}.safetensors"))
    return len(shards)


def masked_rows(vocab):
    return [i for i, t in enumerate(vocab["tokenizer_ids"]) if t < 0]


@torch.no_grad()
def greedy(model, ids, n, mask_rows, stop_rows):
    """No-cache greedy loop: argmax (first index on ties) over rows that map to a tokenizer id."""
    dev = next(model.parameters()).device
    seq = list(ids)
    out = []
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq], device=dev), use_cache=False).logits[0, -1].float()
        logits[mask_rows] = float("-inf")
        t = int(torch.argmax(logits))
        out.append(t)
        seq.append(t)
        if t in stop_rows:
            break
    return out


SAMPLE_PROMPTS = [
    ("code", "def fibonacci(n):"),
    ("code", "import os\nimport sys\n\n\ndef main():"),
    ("code", "class Stack:\n    \"\"\"A simple stack.\"\"\"\n"),
    ("text", "The json module"),
    ("chat", "What does the json module do?"),
    ("chat", "Write a Python function that reverses a string."),
    ("chat", "Explain the with statement in Python."),
]
CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def make_samples(model, vocab, tokenizer_path, n_new):
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(tokenizer_path)
    table = vocab["tokenizer_ids"]
    row = {t: i for i, t in enumerate(table) if t >= 0}
    mask = masked_rows(vocab)
    stop = {row[248046], row[248044]}
    res = []
    for kind, p in SAMPLE_PROMPTS:
        text = CHAT.format(q=p) if kind == "chat" else p
        tids = tok.encode(text, add_special_tokens=False).ids
        cids = [row.get(t, 0) for t in tids]
        gen = greedy(model, cids, n_new, mask, stop)
        gen_t = [table[c] for c in gen]
        res.append({"kind": kind, "prompt": text, "prompt_tokenizer_ids": tids, "prompt_compact_ids": cids,
                    "unk_in_prompt": sum(1 for c in cids if c == 0),
                    "gen_compact_ids": gen, "gen_tokenizer_ids": gen_t,
                    "completion": tok.decode(gen_t, skip_special_tokens=False)})
        log(f"--- sample [{kind}] {p!r}\n{res[-1]['completion']}")
    return res


def plot(csv_path, png_path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [l.rstrip("\n").split(",") for l in open(csv_path)]
    head, rows = rows[0], rows[1:]
    ix = {h: i for i, h in enumerate(head)}
    tok = [float(r[ix["tokens_seen"]]) / 1e6 for r in rows]
    tr = [float(r[ix["train_loss"]]) for r in rows]
    vv = [(float(r[ix["tokens_seen"]]) / 1e6, float(r[ix["val_loss"]])) for r in rows if r[ix["val_loss"]]]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    ax.plot(tok, tr, lw=0.8, label="train (per step)")
    if vv:
        ax.plot([a for a, _ in vv], [b for _, b in vv], "o-", ms=3, label="validation")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(top=min(10.0, max(tr) + 0.2), bottom=max(0.0, min(tr + [b for _, b in vv]) - 0.3))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(png_path)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="assets/demo-src/corpus.npz")
    ap.add_argument("--vocab", default="assets/demo-src/calla_vocab.json")
    ap.add_argument("--tokenizer", default="assets/tokenizer/tokenizer.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=0, help="0 = choose from measured speed and --time-budget")
    ap.add_argument("--time-budget", type=float, default=470.0, help="seconds of training (with --steps 0)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-batches", type=int, default=8)
    ap.add_argument("--ckpt-every", type=float, default=150.0, help="seconds")
    ap.add_argument("--shard-mb", type=int, default=15)
    ap.add_argument("--sample-tokens", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--experts", default="auto", help="auto | grouped_mm | batched_mm | eager")
    ap.add_argument("--max-steps-cap", type=int, default=100000)
    args = ap.parse_args(argv)
    t_start = time.time()
    os.makedirs(args.out, exist_ok=True)

    transformers = import_transformers()
    log(f"transformers {transformers.__version__} ({transformers.__file__}), torch {torch.__version__}, "
        f"python {platform.python_version()}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else ""))
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    vocab = json.load(open(args.vocab))
    assert vocab["method"] == "calla-compact-vocab-v1"
    data = np.load(args.data)
    train = torch.from_numpy(data["train"].astype(np.int64))
    val = torch.from_numpy(data["val"].astype(np.int64))
    log(f"data: {len(train):,} train tokens, {len(val):,} val tokens")

    model, cfg = build_model(transformers, vocab, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    log(f"params: {n_params:,} (embedding + lm_head {n_embed:,}); layer_types {cfg.layer_types}")
    model.to(dev)
    model.train()

    amp = dict(device_type="cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda")
    g = torch.Generator().manual_seed(args.seed)
    seq, B = args.seq, args.batch

    def batch_from(stream, gen, n):
        starts = torch.randint(0, len(stream) - seq - 1, (n,), generator=gen)
        w = torch.stack([stream[s: s + seq + 1] for s in starts.tolist()])
        return w[:, :-1].to(dev, non_blocking=True), w[:, 1:].to(dev, non_blocking=True)

    def loss_fn(x, y, router=True):
        with torch.autocast(**amp):
            out = model(input_ids=x, output_router_logits=router, use_cache=False)
        logits = out.logits.float()
        # targets that are the unknown row (0) are not trained: the row is never sampled
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=0)
        aux = out.aux_loss.float() if (router and out.aux_loss is not None) else torch.zeros((), device=dev)
        return ce, aux

    # fixed validation windows (independent of the training stream's generator)
    vg = torch.Generator().manual_seed(10_000 + args.seed)
    val_batches = [batch_from(val, vg, min(B, 16)) for _ in range(args.eval_batches)]

    @torch.no_grad()
    def evaluate():
        model.eval()
        tot = 0.0
        for x, y in val_batches:
            ce, _ = loss_fn(x, y, router=False)
            tot += float(ce)
        model.train()
        return tot / len(val_batches)

    # experts implementation: smoke-test forward + backward, keep the first that works
    choices = ["grouped_mm", "eager"] if args.experts == "auto" else [args.experts]
    if dev.type == "cpu" and args.experts == "auto":
        choices = ["eager"]
    experts_impl = None
    sg = torch.Generator().manual_seed(999)
    for impl in choices:
        try:
            set_experts(model, impl)
            x, y = batch_from(train, sg, 2)
            ce, aux = loss_fn(x, y)
            (ce + cfg.router_aux_loss_coef * aux).backward()
            model.zero_grad(set_to_none=True)
            experts_impl = impl
            break
        except Exception as e:  # noqa: BLE001
            log(f"experts implementation {impl} failed: {type(e).__name__}: {str(e)[:300]}")
            model.zero_grad(set_to_none=True)
    assert experts_impl, "no experts implementation works"
    log(f"experts implementation: {experts_impl}; attention: {cfg._attn_implementation}")

    opt = torch.optim.AdamW(param_groups(model, args.wd), lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=dev.type == "cuda")
    total = args.steps if args.steps > 0 else None
    csv_path = os.path.join(args.out, "train_log.csv")
    csv = open(csv_path, "w")
    csv.write("step,tokens_seen,elapsed_s,lr,train_loss,aux_loss,grad_norm,val_loss\n")
    history = []
    t_train0 = time.time()
    last_ckpt = t_train0
    t5 = None
    step = 0
    tokens = 0
    val_loss = None
    n_shards = None
    while True:
        if total is not None and step >= total:
            break
        lr = lr_at(step, total or 10 ** 9, args.warmup, args.lr)
        for gr in opt.param_groups:
            gr["lr"] = lr
        x, y = batch_from(train, g, B)
        ce, aux = loss_fn(x, y)
        loss = ce + cfg.router_aux_loss_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        step += 1
        tokens += B * seq
        if step == 5:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t5 = time.time()
        if step == 15 and total is None:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            per = (time.time() - t5) / 10
            left = args.time_budget - (time.time() - t_train0)
            # reserve time for the evaluations (about eval_batches forward passes each)
            n_eval = 1 + (left / per) / args.eval_every
            eval_cost = n_eval * args.eval_batches * per * 0.3
            total = max(step + 1, min(args.max_steps_cap, step + int((left - eval_cost) / per)))
            log(f"measured {per * 1000:.1f} ms/step ({B * seq / per / 1e3:.0f}k tok/s) -> total steps {total}")
        do_eval = step % args.eval_every == 0 or (total is not None and step == total)
        if do_eval:
            val_loss = evaluate()
        ce_f, aux_f, gn_f = float(ce), float(aux), float(gn)
        el = time.time() - t_train0
        csv.write(f"{step},{tokens},{el:.2f},{lr:.6g},{ce_f:.5f},{aux_f:.5f},{gn_f:.4f},"
                  f"{'' if not do_eval else f'{val_loss:.5f}'}\n")
        csv.flush()
        history.append((step, ce_f))
        if step % 50 == 0 or step <= 3 or do_eval:
            log(f"step {step}/{total} tok {tokens / 1e6:.1f}M lr {lr:.2e} loss {ce_f:.4f} aux {aux_f:.3f} "
                f"gn {gn_f:.2f}" + (f" val {val_loss:.4f}" if do_eval else "") + f" [{el:.0f}s]")
        if not math.isfinite(ce_f):
            log("non-finite loss: stopping")
            break
        if time.time() - last_ckpt > args.ckpt_every:
            n_shards = save_shards(model, args.out, args.shard_mb)
            last_ckpt = time.time()
            log(f"checkpoint at step {step} ({n_shards} shards)")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    train_time = time.time() - t_train0
    csv.close()
    n_shards = save_shards(model, args.out, args.shard_mb)
    log(f"trained {step} steps, {tokens:,} tokens in {train_time:.1f}s; final val {val_loss}")

    run = {
        "seed": args.seed, "steps": step, "steps_arg": args.steps, "replay_command":
            f"python scripts/train_demo/train.py --data {args.data} --vocab {args.vocab} --out OUT "
            f"--seed {args.seed} --steps {step} --batch {B} --seq {seq} --lr {args.lr} --warmup {args.warmup} "
            f"--experts {experts_impl}",
        "batch": B, "seq": seq, "tokens_per_step": B * seq, "tokens_seen": tokens,
        "lr": args.lr, "warmup": args.warmup, "schedule": "linear warm-up then cosine to 10% of peak",
        "optimizer": {"name": "AdamW", "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": args.wd,
                      "no_decay": "1-D params and embed_tokens"},
        "grad_clip": args.clip, "precision": "fp32 master weights, bf16 autocast on CUDA",
        "loss": "cross-entropy over compact rows, targets == row 0 (unknown) ignored, + "
                f"router_aux_loss_coef {cfg.router_aux_loss_coef} x load-balancing loss",
        "data": {"sampling": f"uniform random windows of {seq + 1} tokens from the training stream, "
                             "torch.Generator seeded with --seed", "train_tokens": len(train),
                 "val_tokens": len(val)},
        "experts_implementation": experts_impl, "attn_implementation": cfg._attn_implementation,
        "train_time_s": train_time, "wall_total_s": time.time() - t_start,
        "final_train_loss_last50_mean": float(np.mean([h[1] for h in history[-50:]])) if history else None,
        "final_val_loss": val_loss,
        "params": n_params, "params_embedding_plus_lm_head": n_embed,
        "config_kwargs": DEMO_CONFIG | {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
                                        "pad_token_id": cfg.pad_token_id},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__,
                     "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"},
        "ckpt_shards": n_shards,
    }
    json.dump(run, open(os.path.join(args.out, "run.json"), "w"), indent=1)

    # greedy samples with the weights rounded to bf16 (what ships), computed in float32, eager paths
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        model.eval()
        set_experts(model, "eager")
        model.config._attn_implementation = "eager"
        run["samples"] = make_samples(model, vocab, args.tokenizer, args.sample_tokens)
        run["samples_note"] = ("transformers, float32 compute on the bf16-rounded weights, eager attention and "
                               "experts, no-cache greedy, rows without a tokenizer id masked, stops at "
                               "<|im_end|>/<|endoftext|>")
    except Exception as e:  # noqa: BLE001
        log(f"samples failed: {type(e).__name__}: {e}")
    json.dump(run, open(os.path.join(args.out, "run.json"), "w"), indent=1)
    try:
        plot(csv_path, os.path.join(args.out, "loss.png"),
             f"calla demo model ({n_params / 1e6:.1f}M params, seed {args.seed}): {step} steps, "
             f"{tokens / 1e6:.0f}M tokens, {train_time:.0f}s on {run['versions']['device']}")
    except Exception as e:  # noqa: BLE001
        log(f"plot failed: {type(e).__name__}: {e}")
    log(f"done in {time.time() - t_start:.1f}s")


if __name__ == "__main__":
    sys.exit(main())
