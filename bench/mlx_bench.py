#!/usr/bin/env python3
"""Time MLX-LM prefill and decode on a local MLX-layout folder (run with the venv that has mlx + mlx-lm).

    mlx_bench.py --model DIR --prompt-tokens 128[,2048,...] --gen-tokens 16 [--trials 2] [--json FILE]

With several prompt lengths the model is loaded once and each length is timed in turn; the JSON's
top-level figures are those of the first length and `runs` holds one entry per length.

Same procedure as `mlx_lm.benchmark` (random prompt ids, EOS disabled, one warm-up, then timed trials
through `mlx_lm.stream_generate`), with a smaller warm-up and a JSON result. MLX-LM's own figures are
reported: prompt_tps = prompt tokens / (time from the call until the first generated token is
evaluated), which is our TTFT; generation_tps = generated tokens / decode time; peak_memory from
mx.get_peak_memory(). Peak RSS of this process is added (resource.getrusage).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-tokens", default="128", help="comma-separated prompt lengths")
    p.add_argument("--gen-tokens", type=int, default=16)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--warmup-prompt", type=int, default=16)
    p.add_argument("--warmup-gen", type=int, default=4)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    lengths = [int(v) for v in str(a.prompt_tokens).split(",") if v.strip()]
    if not lengths:
        sys.exit("--prompt-tokens: give at least one prompt length")

    import mlx.core as mx
    import mlx_lm
    from mlx_lm import load, stream_generate

    mx.random.seed(a.seed)
    t0 = time.perf_counter()
    model, tokenizer, config = load(a.model, return_config=True)
    load_s = time.perf_counter() - t0
    tokenizer._eos_token_ids = set()  # never stop early (as mlx_lm.benchmark does)
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    # ids below the special tokens, so the prompt is ordinary text-like tokens
    hi = min(vocab, 248044)

    def run(n_prompt, n_gen):
        prompt = mx.random.randint(0, hi, (n_prompt,)).tolist()
        last = None
        tic = time.perf_counter()
        for last in stream_generate(model, tokenizer, prompt, max_tokens=n_gen,
                                    prefill_step_size=a.prefill_step_size):
            pass
        wall = time.perf_counter() - tic
        return last, wall

    print(f"mlx-lm {mlx_lm.__version__} mlx {mx.__version__} device {mx.default_device()}; "
          f"loaded in {load_s:.1f}s; warm-up p={a.warmup_prompt} g={a.warmup_gen}", file=sys.stderr, flush=True)
    run(a.warmup_prompt, a.warmup_gen)
    runs = [measure(run, n, a) for n in lengths]
    out = {
        "engine": "mlx-lm", "mlx_lm_version": mlx_lm.__version__, "mlx_version": mx.__version__,
        "device": str(mx.default_device()), "model": os.path.abspath(a.model),
        "gen_tokens": a.gen_tokens, **runs[0], "runs": runs,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "load_s": load_s,
    }
    s = json.dumps(out, indent=2)
    if a.json:
        with open(a.json, "w") as f:
            f.write(s + "\n")
    print(s)


def measure(run, n_prompt, a):
    """`a.trials` timed runs of one prompt length; medians of MLX-LM's own figures."""
    trials = []
    for i in range(a.trials):
        r, wall = run(n_prompt, a.gen_tokens)
        t = {
            "prompt_tokens": r.prompt_tokens, "generation_tokens": r.generation_tokens,
            "prompt_tps": r.prompt_tps, "generation_tps": r.generation_tps,
            "ttft_s": r.prompt_tokens / r.prompt_tps if r.prompt_tps else None,
            "peak_memory_gb": r.peak_memory, "wall_s": wall,
        }
        trials.append(t)
        print(f"prompt {n_prompt} trial {i + 1}: prefill {t['prompt_tps']:.2f} tok/s, decode {t['generation_tps']:.2f} tok/s, "
              f"ttft {t['ttft_s']:.2f}s, wall {wall:.1f}s", file=sys.stderr, flush=True)

    def med(k):
        return statistics.median(t[k] for t in trials)

    return {
        "prompt_tokens": n_prompt, "trials": trials,
        "prefill_tps": med("prompt_tps"), "decode_tps": med("generation_tps"), "ttft_s": med("ttft_s"),
        "peak_memory_gb": max(t["peak_memory_gb"] for t in trials),
    }


if __name__ == "__main__":
    main()
