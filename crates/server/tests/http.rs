//! The HTTP app in-process on loopback with the tiny random-weight model: OpenAI endpoints,
//! SSE, usage and cached tokens, limits and error shapes, queueing, disconnects.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use router::Config;
use serde_json::{json, Value};
use server::{App, ServeOptions};

fn tiny_model() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("server-http-tiny-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        model::synth::write_checkpoint(&dir, &model::synth::default_model_config(), 11, true, usize::MAX).unwrap();
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/tokenizer");
        for f in ["tokenizer.json", "chat_template.jinja"] {
            std::fs::copy(format!("{root}/{f}"), dir.join(f)).unwrap();
        }
        std::fs::write(
            dir.join("generation_config.json"),
            r#"{"do_sample": true, "temperature": 1.0, "top_k": 20, "top_p": 0.95, "eos_token_id": [248046, 248044]}"#,
        )
        .unwrap();
        dir
    })
    .clone()
}

struct Srv {
    base: String,
    app: Arc<App>,
    http: reqwest::Client,
}

async fn start(cfg: Config) -> Srv {
    let app = App::start(ServeOptions {
        model_dir: tiny_model(),
        config: cfg,
        admin: true,
        local: true,
        local_off_reason: None,
        accelerator: None,
    })
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let r = server::router(app.clone());
    tokio::spawn(async move { axum::serve(listener, r).await.unwrap() });
    let http = reqwest::Client::new();
    for _ in 0..300 {
        let h: Value = http.get(format!("{base}/health")).send().await.unwrap().json().await.unwrap();
        if h["state"] != "AllocatingWeights" {
            assert_eq!(h["state"], "Idle", "{h}");
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Srv { base, app, http }
}

impl Srv {
    async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self.http.post(format!("{}{path}", self.base)).json(body).send().await.unwrap();
        let s = r.status().as_u16();
        let t = r.text().await.unwrap();
        (s, serde_json::from_str(&t).unwrap_or(Value::String(t)))
    }
    async fn raw(&self, path: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let s = r.status().as_u16();
        (s, r.json().await.unwrap_or(Value::Null))
    }
    async fn health(&self) -> Value {
        self.http.get(format!("{}/health", self.base)).send().await.unwrap().json().await.unwrap()
    }
}

fn chat(content: &str, extra: Value) -> Value {
    let mut b = json!({"model": "calla", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn assert_openai_error(v: &Value, status: u16, param: Option<&str>, needle: &str) {
    let e = &v["error"];
    assert!(e["message"].as_str().unwrap().contains(needle), "{v}");
    assert!(e["type"].is_string() && e["code"].is_string(), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
    let _ = status;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_whole_stream_and_usage() {
    let s = start(Config::default()).await;
    // Whole response.
    let (st, v) = s.post("/v1/chat/completions", &chat("Hello there", json!({}))).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let u = &v["usage"];
    assert_eq!(
        u["completion_tokens"].as_u64().unwrap() + u["prompt_tokens"].as_u64().unwrap(),
        u["total_tokens"].as_u64().unwrap()
    );
    assert!(u["completion_tokens"].as_u64().unwrap() <= 4);
    assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 0);
    // Thinking on (template default): the output starts inside the reasoning, and with 4 tokens
    // it ends there; finish_reason length.
    let m = &v["choices"][0]["message"];
    if v["choices"][0]["finish_reason"] == "length" {
        assert!(m["content"].is_null(), "max_tokens inside the reasoning leaves content empty: {v}");
    }
    // Same prompt again: the whole prompt comes from the prefix cache, same greedy output.
    let (_, v2) = s.post("/v1/chat/completions", &chat("Hello there", json!({}))).await;
    assert_eq!(v2["usage"]["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"]);
    assert_eq!(v2["choices"][0]["message"], v["choices"][0]["message"]);
    // Thinking off: no reasoning_content.
    let (_, v3) =
        s.post("/v1/chat/completions", &chat("Hi", json!({"chat_template_kwargs": {"enable_thinking": false}}))).await;
    assert!(v3["choices"][0]["message"].get("reasoning_content").is_none(), "{v3}");

    // Streaming: chunks, a finish_reason, usage chunk, [DONE]; same text as the whole answer.
    let body = chat("Hello there", json!({"stream": true, "stream_options": {"include_usage": true}}));
    let r = s.http.post(format!("{}/v1/chat/completions", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    let text = r.text().await.unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(*events.last().unwrap(), "data: [DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (mut reasoning, mut content) = (String::new(), String::new());
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(d) = c["choices"].get(0).map(|x| &x["delta"]) {
            reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(d["content"].as_str().unwrap_or(""));
        }
    }
    let finish = chunks.iter().filter_map(|c| c["choices"].get(0)).filter_map(|c| c["finish_reason"].as_str()).next_back();
    assert_eq!(finish, v["choices"][0]["finish_reason"].as_str());
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["completion_tokens"], u["completion_tokens"]);
    assert_eq!(reasoning, m["reasoning_content"].as_str().unwrap_or(""));
    assert_eq!(content, m["content"].as_str().unwrap_or(""));

    // Completions endpoint, whole and streamed.
    let (st, c) = s.post("/v1/completions", &json!({"prompt": "The sea is", "max_tokens": 3, "temperature": 0})).await;
    assert_eq!(st, 200, "{c}");
    assert_eq!(c["object"], "text_completion");
    assert!(c["choices"][0]["text"].is_string());
    let r = s
        .http
        .post(format!("{}/v1/completions", s.base))
        .json(&json!({"prompt": "The sea is", "max_tokens": 3, "temperature": 0, "stream": true}))
        .send()
        .await
        .unwrap();
    let t = r.text().await.unwrap();
    assert!(t.trim_end().ends_with("data: [DONE]"), "{t}");
    let streamed: String = t
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<Value>(e).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(streamed, c["choices"][0]["text"].as_str().unwrap());

    // Models, metrics, dashboard.
    let m: Value = s.http.get(format!("{}/v1/models", s.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(m["data"][0]["id"], "Qwen3.6-35B-A3B");
    let metrics = s.http.get(format!("{}/metrics", s.base)).send().await.unwrap().text().await.unwrap();
    for name in [
        "calla_engine_ttft_seconds_bucket",
        "calla_engine_state",
        "calla_router_decisions_total",
        "calla_engine_generated_tokens_total",
    ] {
        assert!(metrics.contains(name), "metrics lack {name}:\n{metrics}");
    }
    let page = s.http.get(format!("{}/dashboard", s.base)).send().await.unwrap().text().await.unwrap();
    assert!(page.contains("uPlot"));
    let d: Value = s.http.get(format!("{}/dashboard/data", s.base)).send().await.unwrap().json().await.unwrap();
    assert!(d["ttft"].as_array().unwrap().len() >= 3, "{d}");
    assert!(
        d["experts"].as_array().unwrap().iter().any(|row| row
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c.as_u64().unwrap() > 0)),
        "{d}"
    );
    let h = s.health().await;
    assert!(h["recent_transitions"].as_array().unwrap().iter().any(|t| t == "Prefill->Decoding"), "{h}");
    // ignore_eos (vLLM's extension): exactly max_tokens, past any end-of-turn id
    let (st, ie) = s.post("/v1/chat/completions", &chat("Hi", json!({"max_tokens": 24, "ignore_eos": true}))).await;
    assert_eq!(st, 200, "{ie}");
    assert_eq!(ie["usage"]["completion_tokens"], 24, "{ie}");
    assert_eq!(ie["choices"][0]["finish_reason"], "length", "{ie}");
    assert!(s.health().await["local"]["backend"].as_str().unwrap().starts_with("cpu"));
    drop(s.app);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors_and_the_server_keeps_serving() {
    let mut cfg = Config::default();
    cfg.limits.max_body_bytes = 4096;
    cfg.limits.max_prompt_tokens = 64;
    let s = start(cfg).await;
    let (st, v) = s.raw("/v1/chat/completions", "{\"messages\": [").await;
    assert_eq!(st, 400);
    assert_openai_error(&v, 400, None, "not valid JSON");
    let (st, v) = s.raw("/v1/chat/completions", "[1,2]").await;
    assert_eq!(st, 400, "{v}");
    let cases = [
        (json!({"messages": "hi"}), "messages"),
        (json!({"messages": [{"role": 3, "content": "x"}]}), "messages[0].role"),
        (chat("x", json!({"temperature": "warm"})), "temperature"),
        (chat("x", json!({"max_tokens": "many"})), "max_tokens"),
        (chat("x", json!({"n": 2})), "n"),
        (chat("x", json!({"stop": 7})), "stop"),
        (chat("x", json!({"tools": "none"})), "tools"),
        (chat("x", json!({"data_categories": 5})), "data_categories"),
    ];
    for (body, field) in cases {
        let (st, v) = s.post("/v1/chat/completions", &body).await;
        assert_eq!(st, 400, "{body}: {v}");
        assert_openai_error(&v, 400, Some(field), field);
    }
    // Unknown fields are ignored.
    let (st, v) = s.post("/v1/chat/completions", &chat("x", json!({"frobnicate": {"a": 1}, "logit_bias": {}}))).await;
    assert_eq!(st, 200, "{v}");
    // Oversized body: 413.
    let big = chat(&"word ".repeat(2000), json!({}));
    let (st, v) = s.post("/v1/chat/completions", &big).await;
    assert_eq!(st, 413, "{v}");
    assert_openai_error(&v, 413, None, "4096 bytes");
    // Prompt over the token limit: 400 naming the limit.
    let long = chat(&"a b c d e f g h ".repeat(10), json!({}));
    let (st, v) = s.post("/v1/chat/completions", &long).await;
    assert_eq!(st, 400, "{v}");
    assert_openai_error(&v, 400, None, "the limit is 64 tokens");
    // Unknown endpoint: 404 in the same shape.
    let (st, v) = s.post("/v1/nothing", &json!({})).await;
    assert_eq!(st, 404);
    assert!(v["error"]["message"].is_string());
    // Still serving.
    let (st, _) = s.post("/v1/chat/completions", &chat("still there?", json!({}))).await;
    assert_eq!(st, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_is_429_and_disconnect_cancels() {
    let mut cfg = Config::default();
    cfg.limits.queue_depth = 1;
    let s = start(cfg).await;
    let w = s.app.worker.as_ref().unwrap();
    w.shared.faults.token_delay_ms.store(150, std::sync::atomic::Ordering::SeqCst);
    // One running, one queued, the rest refused.
    let mut handles = Vec::new();
    for i in 0..5 {
        let (http, base) = (s.http.clone(), s.base.clone());
        handles.push(tokio::spawn(async move {
            let r = http
                .post(format!("{base}/v1/chat/completions"))
                .json(&chat(&format!("q{i}"), json!({"max_tokens": 6})))
                .send()
                .await
                .unwrap();
            let st = r.status().as_u16();
            (st, r.json::<Value>().await.unwrap())
        }));
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let mut codes = Vec::new();
    for h in handles {
        let (st, v) = h.await.unwrap();
        if st == 429 {
            assert_eq!(v["error"]["type"], "rate_limit_error", "{v}");
            assert!(v["error"]["message"].as_str().unwrap().contains("queue is full"));
        }
        codes.push(st);
    }
    assert!(codes.iter().filter(|&&c| c == 200).count() >= 2, "{codes:?}");
    assert!(codes.contains(&429), "{codes:?}");

    // A streaming client that disconnects after the first chunk: generation is cancelled (the
    // engine is free again long before 200 tokens x 150 ms).
    let body = chat("tell me a long story", json!({"stream": true, "max_tokens": 200}));
    let mut r = s.http.post(format!("{}/v1/chat/completions", s.base)).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).starts_with("data: "));
    drop(r);
    let t0 = std::time::Instant::now();
    loop {
        let h = s.health().await;
        if h["state"] == "Idle" && h["inflight"] == 0 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "generation not cancelled: {h}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    w.shared.faults.token_delay_ms.store(0, std::sync::atomic::Ordering::SeqCst);
    let (st, _) = s.post("/v1/chat/completions", &chat("after disconnect", json!({}))).await;
    assert_eq!(st, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_seed_and_pinned_without_cloud() {
    let mut cfg = Config::default();
    cfg.hybrid_routing.route_local = vec!["file_system".into()];
    let s = start(cfg).await;
    // Seeded sampling is reproducible.
    let b = chat(
        "seeded",
        json!({"temperature": 1.0, "seed": 42, "max_tokens": 6, "chat_template_kwargs": {"enable_thinking": false}}),
    );
    let (_, a1) = s.post("/v1/chat/completions", &b).await;
    let (_, a2) = s.post("/v1/chat/completions", &b).await;
    assert_eq!(a1["choices"][0]["message"], a2["choices"][0]["message"]);
    // A stop string taken from the greedy output cuts it there.
    let b = json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0});
    let (_, full) = s.post("/v1/completions", &b).await;
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    if chars.len() >= 4 {
        let stop: String = chars[2..4].iter().collect();
        let mut b2 = b.clone();
        b2["stop"] = json!([stop]);
        let (_, cut) = s.post("/v1/completions", &b2).await;
        let want = &text[..text.find(&stop).unwrap()];
        assert_eq!(cut["choices"][0]["text"], want, "full {text:?} stop {stop:?}");
        assert_eq!(cut["choices"][0]["finish_reason"], "stop");
    }
    // A pinned request with no cloud configured is served locally.
    let b = chat(
        "read my files",
        json!({"tools": [{"type": "function", "function": {"name": "file_system", "parameters": {}}}]}),
    );
    let r = s.http.post(format!("{}/v1/chat/completions", s.base)).json(&b).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-calla-route-reason"], "pinned_local");
}
