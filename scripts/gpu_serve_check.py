#!/usr/bin/env python3
"""`calla serve --device cuda` end to end, over real HTTP on loopback (run on the GPU machine by
scripts/gpu_run.sh; the standard library only: the GPU machine reaches no package registry).

Starts the server on a model folder with the CUDA backend, then checks what an OpenAI client
sees: /health names the cuda backend; a greedy chat completion and the same request streamed
give the same text, finish reason and token count, the second from the prefix cache; a seeded sampled request gives the same text
twice; a `top_k` beyond the device sampler's limit and a prompt beyond the context limit get
HTTP 400 naming the field or the limit; and a long greedy completion gives the decode speed a
client sees (completion tokens over the time after the first streamed token).

  scripts/gpu_serve_check.py CALLA_BINARY MODEL_DIR [--ctx N] [--long-tokens N] [--device cuda|cpu]

(`--device cpu` runs the same checks on the CPU backend, less the device sampler's limit: a
check of this script on a machine without a GPU.)

Exit status 0 when every check passed. Prints one `JSON {...}` line with the numbers.
"""
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def post(base, path, body, stream=False):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        r = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as e:
        err = json.loads(e.read() or b"{}")
        return e.code, (([], None) if stream else err)
    if not stream:
        return r.status, json.loads(r.read())
    events, t_first = [], None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        ev = json.loads(data)
        if t_first is None and any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
            t_first = time.perf_counter()
        events.append(ev)
    return r.status, (events, t_first)


def main():
    args = sys.argv[1:]
    if len(args) < 2:
        print(__doc__)
        return 2
    binary, model = args[0], args[1]
    ctx = int(args[args.index("--ctx") + 1]) if "--ctx" in args else 4096
    long_tokens = int(args[args.index("--long-tokens") + 1]) if "--long-tokens" in args else 256
    device = args[args.index("--device") + 1] if "--device" in args else "cuda"
    cfg = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"maxContextTokens": ctx}, cfg)
    cfg.close()
    t0 = time.time()
    # the server's logs go to a file (a pipe nobody reads would fill and block the server)
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    srv = subprocess.Popen([binary, "serve", "--model", model, "--device", device, "--port", "0", "--config", cfg.name],
                           stdout=subprocess.DEVNULL, stderr=log, text=True)
    base = None
    while base is None and srv.poll() is None and time.time() - t0 < 120:
        with open(log.name) as f:
            for line in f:
                if "listening on http://" in line:
                    base = line.strip().split("listening on ")[1]
        time.sleep(0.2)
    if base is None:
        print(f"FAIL: the server did not start listening (log {log.name}):")
        print(open(log.name).read()[-3000:])
        srv.kill()
        return 1
    failures, out = [], {}

    def check(ok, what):
        print(("ok   " if ok else "FAIL ") + what, flush=True)
        if not ok:
            failures.append(what)

    try:
        # wait for the engine thread: model load, GPU upload, kernel compile
        health = {}
        while time.time() - t0 < 180:
            try:
                with urllib.request.urlopen(base + "/health", timeout=10) as r:
                    health = json.loads(r.read())
            except urllib.error.HTTPError as e:  # 503 once the engine failed to load
                health = json.loads(e.read() or b"{}")
            if health.get("local", {}).get("phase") in ("Idle", "Failed"):
                break
            time.sleep(0.5)
        out["ready_s"] = round(time.time() - t0, 1)
        local = health.get("local", {})
        backend = local.get("backend") or ""
        check(local.get("phase") == "Idle" and backend.startswith(device),
              f"engine ready in {out['ready_s']} s on backend {backend!r} (phase {local.get('phase')}, error {local.get('load_error')})")
        if failures:
            return 1
        msgs = [{"role": "user", "content": "Write a haiku about the GPU's memory bandwidth."}]
        kw = {"enable_thinking": False}
        greedy = {"messages": msgs, "max_tokens": 40, "temperature": 0, "chat_template_kwargs": kw}
        code, r = post(base, "/v1/chat/completions", greedy)
        check(code == 200, f"greedy chat completion: HTTP {code} {'' if code == 200 else json.dumps(r)[:200]}")
        if code != 200:
            return 1
        text = r["choices"][0]["message"].get("content") or ""
        usage = r.get("usage", {})
        code, (events, _) = post(base, "/v1/chat/completions", dict(greedy, stream=True, stream_options={"include_usage": True}), stream=True)
        streamed = "".join(c.get("delta", {}).get("content") or "" for e in events for c in e.get("choices", []))
        finish = [c.get("finish_reason") for e in events for c in e.get("choices", []) if c.get("finish_reason")]
        s_usage = next((e["usage"] for e in events if e.get("usage")), {})
        check(code == 200 and streamed == text and finish == [r["choices"][0]["finish_reason"]]
              and s_usage.get("completion_tokens") == usage.get("completion_tokens"),
              f"streamed greedy = non-streamed ({usage.get('completion_tokens')} tokens, finish {finish}, {len(text)} chars)")
        cached = s_usage.get("prompt_tokens_details", {}).get("cached_tokens")
        check(cached == usage.get("prompt_tokens"),
              f"the same prompt again comes from the prefix cache: cached_tokens {cached} of {usage.get('prompt_tokens')}")
        sampled = {"messages": msgs, "max_tokens": 40, "temperature": 0.8, "top_p": 0.95, "top_k": 40, "seed": 1234,
                   "chat_template_kwargs": kw}
        (ca, a), (cb, b) = post(base, "/v1/chat/completions", sampled), post(base, "/v1/chat/completions", sampled)
        same = ca == cb == 200 and a["choices"][0]["message"] == b["choices"][0]["message"] and a.get("usage") == b.get("usage")
        check(same, f"seeded sampling gives the same completion twice ({a.get('usage', {}).get('completion_tokens')} tokens)")
        if device == "cuda":
            code, r = post(base, "/v1/chat/completions", dict(sampled, top_k=5000))
            msg = json.dumps(r)
            check(code == 400 and "top_k" in msg, f"top_k 5000 (device sampler limit): HTTP {code} {msg[:160]}")
        code, r = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * (ctx + 100)}], "max_tokens": 4})
        msg = json.dumps(r)
        check(code == 400 and str(ctx) in msg, f"prompt beyond the context of {ctx}: HTTP {code} {msg[:160]}")
        # a long prompt twice: the second is served from the prefix cache (TTFT as a client sees it)
        words = " ".join(f"w{i % 997}" for i in range(ctx // 5))
        longp = {"messages": [{"role": "user", "content": words}], "max_tokens": 1, "temperature": 0, "chat_template_kwargs": kw}
        times = []
        for _ in range(2):
            t_req = time.perf_counter()
            code, r = post(base, "/v1/chat/completions", longp)
            times.append(round((time.perf_counter() - t_req) * 1e3, 1))
        pt = r.get("usage", {}).get("prompt_tokens")
        hit = r.get("usage", {}).get("prompt_tokens_details", {}).get("cached_tokens")
        out["long_prompt_tokens"], out["long_prompt_ms_cold"], out["long_prompt_ms_cached"] = pt, times[0], times[1]
        check(code == 200 and hit == pt, f"a {pt}-token prompt: {times[0]} ms, again {times[1]} ms from the prefix cache ({hit} cached)"
                                         + ("" if code == 200 else f": HTTP {code} {json.dumps(r)[:200]}"))
        # decode speed as a client sees it: greedy, long, streamed
        body = {"messages": [{"role": "user", "content": "Count from one to one thousand in words."}], "max_tokens": long_tokens,
                "temperature": 0, "chat_template_kwargs": kw, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True}
        t_req = time.perf_counter()
        code, (events, t_first) = post(base, "/v1/chat/completions", body, stream=True)
        t_end = time.perf_counter()
        n = next((e["usage"]["completion_tokens"] for e in events if e.get("usage")), 0)
        if t_first and n > 1:
            out["client_decode_tok_s"] = round((n - 1) / (t_end - t_first), 1)
            out["client_ttft_ms"] = round((t_first - t_req) * 1e3, 1)
            out["completion_tokens"] = n
        check(code == 200 and n > 1, f"long streamed completion: {n} tokens, TTFT {out.get('client_ttft_ms')} ms, "
                                     f"decode {out.get('client_decode_tok_s')} tok/s as the client sees it")
        # expert-load telemetry from the engine (on the GPU: the device's counts): every layer
        # counted the same token slots, more than zero (the metrics sampler runs periodically)
        vals = {}
        for _ in range(20):
            time.sleep(0.5)
            with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
                metrics = r.read().decode()
            vals = {}
            for line in metrics.splitlines():
                m = re.match(r'calla_engine_expert_assignments_total\{layer="(\d+)"\} (\S+)', line)
                if m:
                    vals[int(m.group(1))] = float(m.group(2))
            if vals:
                break
        per_layer = sorted(set(vals.values()))
        out["expert_assignments_per_layer"] = per_layer
        check(len(vals) > 0 and len(per_layer) == 1 and per_layer[0] > 0,
              f"/metrics expert assignments: {len(vals)} layers, per layer {per_layer[:3]}")
    finally:
        srv.terminate()
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
    out["failures"] = len(failures)
    print("JSON " + json.dumps(out))
    print("SERVE CHECK OK" if not failures else f"SERVE CHECK FAILED: {failures}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
