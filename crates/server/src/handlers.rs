//! HTTP handlers: the OpenAI endpoints, health, metrics, admin.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use engine::worker::{Event, Job, SubmitError};
use engine::GenerateParams;
use futures_util::StreamExt;
use router::policy::{self, Route, CATEGORY_HEADER};
use serde_json::{json, Map, Value};
use telemetry::names;
use text::{ChatRequest, TextError};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::app::App;
use crate::error::ApiError;
use crate::params::{parse_chat, parse_common, GenParams, ToolChoice};
use crate::parse::{OutputParser, Part, StopMatcher, Utf8Assembler};

type Shared = State<Arc<App>>;

/// Reads the body up to the limit (413 above it).
pub async fn read_body(app: &App, body: Body) -> Result<Bytes, ApiError> {
    let limit = app.cfg.limits.max_body_bytes;
    axum::body::to_bytes(body, limit).await.map_err(|_| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("the request body exceeds the limit of {limit} bytes"),
        )
    })
}

/// Parses JSON (400 naming the position on error).
pub fn parse_json(b: &[u8]) -> Result<Value, ApiError> {
    let v: Value = serde_json::from_slice(b)
        .map_err(|e| ApiError::bad_request("invalid_json", format!("the request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad_request("invalid_request", "the request body must be a JSON object"));
    }
    Ok(v)
}

fn text_error(e: TextError) -> ApiError {
    match e {
        TextError::Request { field, reason } => ApiError::field(field, reason),
        other => ApiError::bad_request("invalid_request", other.to_string()),
    }
}

fn header_categories(h: &HeaderMap) -> Option<String> {
    h.get(CATEGORY_HEADER).and_then(|v| v.to_str().ok()).map(str::to_string)
}

/// Validates the explicit category field's type.
fn check_category_field(v: &Value) -> Result<(), ApiError> {
    match v.get(policy::CATEGORY_FIELD) {
        None | Some(Value::Null) | Some(Value::String(_)) => Ok(()),
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => Ok(()),
        Some(_) => Err(ApiError::field(policy::CATEGORY_FIELD, "must be a string or an array of strings")),
    }
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

impl Kind {
    fn path(self) -> &'static str {
        match self {
            Kind::Chat => "chat/completions",
            Kind::Completion => "completions",
        }
    }
}

/// A request ready to route.
struct Prepared {
    kind: Kind,
    body: Value,
    params: GenParams,
    prompt: Vec<u32>,
    thinking: bool,
    parse_tools: bool,
    cats: BTreeSet<String>,
    pinned: bool,
    prefers_cloud: bool,
}

/// `POST /v1/chat/completions`.
pub async fn chat(State(app): Shared, headers: HeaderMap, body: Body) -> Response {
    match prepare(&app, Kind::Chat, &headers, body).await {
        Ok(p) => dispatch(app, p).await,
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/completions`.
pub async fn completions(State(app): Shared, headers: HeaderMap, body: Body) -> Response {
    match prepare(&app, Kind::Completion, &headers, body).await {
        Ok(p) => dispatch(app, p).await,
        Err(e) => e.into_response(),
    }
}

async fn prepare(app: &App, kind: Kind, headers: &HeaderMap, body: Body) -> Result<Prepared, ApiError> {
    let bytes = read_body(app, body).await?;
    let body = parse_json(&bytes)?;
    check_category_field(&body)?;
    let lim = &app.cfg.limits;
    let (params, prompt_text, thinking, parse_tools) = match kind {
        Kind::Chat => {
            let params = parse_chat(&body, &app.defaults, lim.default_max_tokens)?;
            let mut req = ChatRequest::from_openai_json(&body).map_err(text_error)?;
            if !req.kwargs.contains_key("enable_thinking") {
                if let Some(d) = app.cfg.enable_thinking {
                    req.kwargs.insert("enable_thinking".into(), Value::Bool(d));
                }
            }
            let thinking = match req.kwargs.get("enable_thinking") {
                None | Some(Value::Null) => true,
                Some(Value::Bool(b)) => *b,
                Some(_) => return Err(ApiError::field("chat_template_kwargs.enable_thinking", "must be a boolean")),
            };
            let thinking = thinking && req.add_generation_prompt;
            let text = app.template.render(&req).map_err(|e| match e {
                TextError::Request { .. } => text_error(e),
                other => {
                    ApiError::bad_request("invalid_request", format!("the chat template refused the request: {other}"))
                }
            })?;
            let parse_tools = !params.tool_schemas.is_empty() && params.tool_choice != ToolChoice::None;
            (params, text, thinking, parse_tools)
        }
        Kind::Completion => {
            let o = body.as_object().expect("checked object");
            let params = parse_common(o, &app.defaults, 16)?;
            let text = match o.get("prompt") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => a[0].as_str().unwrap_or("").to_string(),
                Some(Value::Array(a)) if !a.is_empty() && a.iter().all(|x| x.as_u64().is_some()) => {
                    let ids: Vec<u32> = a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect();
                    app.tokenizer.decode(&ids, false).map_err(|e| ApiError::field("prompt", e.to_string()))?
                }
                Some(Value::Array(_)) => {
                    return Err(ApiError::field(
                        "prompt",
                        "must be a string, one string in an array, or an array of token ids",
                    ))
                }
                None => return Err(ApiError::field("prompt", "is required")),
                Some(_) => return Err(ApiError::field("prompt", "must be a string or an array")),
            };
            (params, text, false, false)
        }
    };
    let prompt =
        app.tokenizer.encode(&prompt_text).map_err(|e| ApiError::bad_request("invalid_request", e.to_string()))?;
    if prompt.is_empty() {
        return Err(ApiError::field("prompt", "is empty"));
    }
    if prompt.len() > lim.max_prompt_tokens {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "context_length_exceeded",
            format!("the prompt has {} tokens; the limit is {} tokens", prompt.len(), lim.max_prompt_tokens),
        ));
    }
    let hr = &app.cfg.hybrid_routing;
    let cats = policy::categories(hr, &body, header_categories(headers).as_deref());
    let pinned = policy::pinned_local(hr, &cats);
    let prefers_cloud = policy::prefers_cloud(hr, &cats);
    Ok(Prepared { kind, body, params, prompt, thinking, parse_tools, cats, pinned, prefers_cloud })
}

fn cats_str(c: &BTreeSet<String>) -> String {
    c.iter().cloned().collect::<Vec<_>>().join(",")
}

async fn dispatch(app: Arc<App>, p: Prepared) -> Response {
    let route = app.decide(p.pinned, p.prefers_cloud);
    let cats = cats_str(&p.cats);
    let catv: Vec<String> = p.cats.iter().cloned().collect();
    match route {
        Route::Refuse { status, reason } => {
            app.record_route("refused", reason, &cats);
            app.audit(p.kind.path(), "refused", reason, &catv, &p.body);
            refuse(&app, status, reason, &p).into_response()
        }
        Route::Cloud { reason } => {
            app.record_route("cloud", reason, &cats);
            app.audit(p.kind.path(), "cloud", reason, &catv, &p.body);
            match cloud(&app, &p).await {
                Ok(r) => r,
                Err(e) => {
                    // Upstream down: serve locally if the engine can (never reached for pinned requests).
                    if app.local_availability() == router::LocalAvailability::Ready {
                        app.record_route("local", "cloud_unreachable_fallback", &cats);
                        local(app, p, false, "cloud_unreachable_fallback").await
                    } else {
                        ApiError::new(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "upstream_unavailable",
                            format!("the cloud upstream failed ({e}) and the local engine cannot serve now"),
                        )
                        .into_response()
                    }
                }
            }
        }
        Route::Local { probe, reason } => {
            app.record_route("local", reason, &cats);
            app.audit(p.kind.path(), "local", reason, &catv, &p.body);
            local(app, p, probe, reason).await
        }
    }
}

fn refuse(app: &App, status: u16, reason: &str, p: &Prepared) -> ApiError {
    let why_local = || {
        app.local_off_reason
            .clone()
            .or_else(|| app.load_error.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .unwrap_or_else(|| format!("engine state {}", app.sm.state().as_str()))
    };
    match (status, p.pinned) {
        (429, true) => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "queue_full",
            format!(
                "the local engine queue is full; this request touches local-only data ({}) and is never sent upstream: retry later",
                cats_str(&p.cats)
            ),
        ),
        (429, false) => ApiError::new(StatusCode::TOO_MANY_REQUESTS, "queue_full", "the local engine queue is full: retry later"),
        (_, true) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "local_unavailable",
            format!(
                "this request touches local-only data ({}) and is never sent upstream, but the local engine cannot serve it ({})",
                cats_str(&p.cats),
                why_local()
            ),
        ),
        _ => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "local_unavailable",
            format!("the local engine cannot serve ({}; {reason}) and no cloud upstream is usable", why_local()),
        ),
    }
}

/// Decrements the cloud in-flight count when the response body ends or is dropped.
struct CloudGuard(Arc<App>);
impl Drop for CloudGuard {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
        self.0.sm.update(|i| i.cloud_inflight = i.cloud_inflight.saturating_sub(1));
    }
}

async fn cloud(app: &Arc<App>, p: &Prepared) -> Result<Response, String> {
    let Some(up) = &app.cloud else { return Err("no cloud upstream configured".into()) };
    debug_assert!(!p.pinned, "pinned requests never reach the upstream");
    if p.pinned {
        return Err("pinned local".into());
    }
    app.inflight.fetch_add(1, Ordering::SeqCst);
    app.sm.update(|i| i.cloud_inflight += 1);
    let guard = CloudGuard(app.clone());
    let t0 = Instant::now();
    let resp = match up.post(p.kind.path(), p.body.clone()).await {
        Ok(r) => r,
        Err(e) => {
            app.cloud_result(Some(e.to_string()));
            return Err(e.to_string());
        }
    };
    app.cloud_result(None);
    metrics::histogram!(names::CLOUD_TTFB_SECONDS).record(t0.elapsed().as_secs_f64());
    let status = StatusCode::from_u16(resp.status().as_u16()).unwrap_or(StatusCode::BAD_GATEWAY);
    let ctype =
        resp.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("application/json").to_string();
    let stream = resp.bytes_stream().map(move |r| {
        let _keep = &guard;
        r.map_err(std::io::Error::other)
    });
    let mut out = Response::new(Body::from_stream(stream));
    *out.status_mut() = status;
    let h = out.headers_mut();
    h.insert("content-type", HeaderValue::from_str(&ctype).unwrap_or(HeaderValue::from_static("application/json")));
    h.insert("x-calla-route", HeaderValue::from_static("cloud"));
    metrics::counter!(names::HTTP_REQUESTS, "status" => status.as_u16().to_string()).increment(1);
    Ok(out)
}

/// Sets the cancel flag when dropped (client gone, response finished).
struct CancelOnDrop(Arc<AtomicBool>);
impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Reports the half-open probe's outcome exactly once (failure when dropped unreported).
struct ProbeGuard {
    app: Option<Arc<App>>,
}
impl ProbeGuard {
    fn finish(&mut self, ok: bool) {
        if let Some(a) = self.app.take() {
            a.probe_finished(ok);
        }
    }
}
impl Drop for ProbeGuard {
    fn drop(&mut self) {
        self.finish(false);
    }
}

/// Turns engine events into message parts; shared by streaming and non-streaming answers.
struct Gen {
    app: Arc<App>,
    rx: UnboundedReceiver<Event>,
    cancel: Arc<AtomicBool>,
    _cancel_guard: CancelOnDrop,
    probe: ProbeGuard,
    utf8: Utf8Assembler,
    stop: StopMatcher,
    parser: Option<OutputParser>,
    submitted: Instant,
    last_token: Option<Instant>,
    ttft: Option<Duration>,
    tokens: usize,
    stop_hit: bool,
    calls: usize,
    keep_ids: [u32; 4],
    done: Option<(engine::GenerationStats, usize)>,
    // A first event already received (the one that decided the status code).
    pending: Option<Event>,
    // Text of a whole completion (completions endpoint: no parser).
    raw: bool,
}

/// One step of a generation.
enum Step {
    Parts(Vec<Part>),
    Finished { finish: &'static str },
    Failed(String),
}

impl Gen {
    async fn next(&mut self) -> Step {
        if self.done.is_some() {
            return Step::Finished { finish: self.finish_reason() };
        }
        let ev = match self.pending.take() {
            Some(e) => Some(e),
            None => self.rx.recv().await,
        };
        match ev {
            None => Step::Failed("the engine thread stopped".into()),
            Some(Event::Started { .. }) => Step::Parts(Vec::new()),
            Some(Event::Token(id)) => {
                if self.stop_hit {
                    return Step::Parts(Vec::new());
                }
                let now = Instant::now();
                match self.last_token {
                    None => {
                        let t = now - self.submitted;
                        self.ttft = Some(t);
                        metrics::histogram!(names::TTFT_SECONDS).record(t.as_secs_f64());
                    }
                    Some(prev) => self.app.inter_token(now - prev),
                }
                self.last_token = Some(now);
                self.tokens += 1;
                let tok = &self.app.tokenizer;
                let text = if tok.is_special(id) && !self.keep_ids.contains(&id) {
                    String::new()
                } else {
                    self.utf8.push(&tok.id_to_bytes(id).unwrap_or_default())
                };
                let (text, hit) = self.stop.push(&text);
                if hit {
                    self.stop_hit = true;
                    self.cancel.store(true, Ordering::SeqCst);
                }
                Step::Parts(self.parse(&text, false))
            }
            Some(Event::Done { stats, cached_tokens }) => {
                let mut parts = Vec::new();
                if !self.stop_hit {
                    let tail = self.utf8.finish();
                    let (mut t, hit) = self.stop.push(&tail);
                    if hit {
                        self.stop_hit = true;
                    } else {
                        t.push_str(&self.stop.finish());
                    }
                    parts = self.parse(&t, true);
                } else {
                    parts.extend(self.parse("", true));
                }
                metrics::counter!(names::GENERATED_TOKENS).increment(stats.generated_tokens as u64);
                metrics::counter!(names::PROMPT_TOKENS, "cached" => "true").increment(cached_tokens as u64);
                metrics::counter!(names::PROMPT_TOKENS, "cached" => "false")
                    .increment((stats.prompt_tokens - cached_tokens) as u64);
                let decode = (stats.generated_tokens >= 3).then(|| stats.decode_tokens_per_s());
                let new_prompt = stats.prompt_tokens - cached_tokens;
                let prefill = (new_prompt > 0 && !stats.ttft.is_zero())
                    .then(|| new_prompt as f64 / stats.ttft.as_secs_f64().max(1e-9));
                self.app.local_finished(self.ttft.or(Some(stats.ttft)), decode, prefill);
                let thr = self.app.cfg.breaker.ttft_p95_ms;
                let ok = self.ttft.or(Some(stats.ttft)).is_some_and(|t| t.as_secs_f64() * 1e3 <= thr);
                self.probe.finish(ok);
                self.done = Some((stats, cached_tokens));
                if parts.is_empty() {
                    Step::Finished { finish: self.finish_reason() }
                } else {
                    Step::Parts(parts)
                }
            }
            Some(Event::Error { message, .. }) => {
                self.app.local_error();
                self.probe.finish(false);
                Step::Failed(message)
            }
        }
    }

    fn parse(&mut self, text: &str, last: bool) -> Vec<Part> {
        if self.raw {
            return if text.is_empty() { Vec::new() } else { vec![Part::Content(text.to_string())] };
        }
        let Some(p) = self.parser.as_mut() else { return Vec::new() };
        let mut parts = if text.is_empty() { Vec::new() } else { p.push(text) };
        if last {
            parts.extend(p.finish());
        }
        self.calls += parts.iter().filter(|x| matches!(x, Part::Call(_))).count();
        parts
    }

    fn finish_reason(&self) -> &'static str {
        let base = match &self.done {
            _ if self.stop_hit => "stop",
            Some((s, _)) => match s.finish {
                engine::FinishReason::Length => "length",
                _ => "stop",
            },
            None => "stop",
        };
        if self.calls > 0 && base == "stop" {
            "tool_calls"
        } else {
            base
        }
    }

    fn usage(&self) -> Value {
        let (prompt, cached, gen) = match &self.done {
            Some((s, c)) => (s.prompt_tokens, *c, self.tokens.max(s.generated_tokens.min(self.tokens))),
            None => (0, 0, self.tokens),
        };
        json!({"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen,
               "prompt_tokens_details": {"cached_tokens": cached}})
    }
}

fn call_json(c: &crate::parse::ToolCall, id: &str, index: usize) -> Value {
    json!({"index": index, "id": id, "type": "function",
           "function": {"name": c.name, "arguments": Value::Object(c.arguments.clone()).to_string()}})
}

async fn local(app: Arc<App>, p: Prepared, probe: bool, reason: &'static str) -> Response {
    let Some(worker) = app.worker.clone() else {
        return refuse(&app, 503, "local_unavailable", &p).into_response();
    };
    let (tx, rx) = unbounded_channel::<Event>();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        prompt: p.prompt.clone(),
        params: GenerateParams {
            sampling: p.params.sampling.clone(),
            max_tokens: p.params.max_tokens,
            stop_on_eos: !p.params.ignore_eos,
        },
        cancel: cancel.clone(),
        sink: Box::new(move |ev| tx.send(ev).is_ok()),
    };
    let mut probe_guard = ProbeGuard { app: probe.then(|| app.clone()) };
    if let Err(e) = worker.submit(job) {
        probe_guard.finish(false);
        return match e {
            SubmitError::QueueFull(_) if !p.pinned && app.cloud_usable() => {
                app.record_route("cloud", "queue_full_overflow", &cats_str(&p.cats));
                match cloud(&app, &p).await {
                    Ok(r) => r,
                    Err(e) => ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "upstream_unavailable", e).into_response(),
                }
            }
            SubmitError::QueueFull(_) => refuse(&app, 429, "queue_full", &p).into_response(),
            SubmitError::Stopped => refuse(&app, 503, "local_unavailable", &p).into_response(),
        };
    }
    app.update_queue_gauge();
    app.inflight.fetch_add(1, Ordering::SeqCst);
    struct Inflight(Arc<App>);
    impl Drop for Inflight {
        fn drop(&mut self) {
            self.0.inflight.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let inflight = Inflight(app.clone());
    let tok = &app.tokenizer;
    let keep_ids =
        ["<think>", "</think>", "<tool_call>", "</tool_call>"].map(|s| tok.token_to_id(s).unwrap_or(u32::MAX));
    let mut g = Gen {
        app: app.clone(),
        rx,
        cancel: cancel.clone(),
        _cancel_guard: CancelOnDrop(cancel),
        probe: probe_guard,
        utf8: Utf8Assembler::default(),
        stop: StopMatcher::new(p.params.stop.clone()),
        parser: Some(OutputParser::new(p.thinking, p.parse_tools, p.params.tool_schemas.clone())),
        submitted: Instant::now(),
        last_token: None,
        ttft: None,
        tokens: 0,
        stop_hit: false,
        calls: 0,
        keep_ids,
        done: None,
        pending: None,
        raw: p.kind == Kind::Completion,
    };
    // The first event decides the status code: an engine error before any token is a 4xx/5xx.
    let first = g.rx.recv().await;
    match first {
        Some(Event::Error { message, client_error }) => {
            if client_error {
                g.probe.finish(true);
                return ApiError::bad_request("invalid_request", message).into_response();
            }
            app.local_error();
            g.probe.finish(false);
            if !p.pinned && app.cloud_usable() {
                app.record_route("cloud", "local_error_fallback", &cats_str(&p.cats));
                if let Ok(r) = cloud(&app, &p).await {
                    return r;
                }
            }
            let msg = if p.pinned {
                format!("the local engine failed ({message}); this request touches local-only data ({}) and is never sent upstream", cats_str(&p.cats))
            } else {
                format!("the local engine failed: {message}")
            };
            return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "engine_error", msg).into_response();
        }
        None => {
            return ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "engine_error", "the engine thread stopped")
                .into_response()
        }
        Some(ev) => g.pending = Some(ev),
    }
    let id = format!(
        "{}-{:x}",
        if p.kind == Kind::Chat { "chatcmpl" } else { "cmpl" },
        app.seq.fetch_add(1, Ordering::SeqCst)
    );
    let created = app.unix();
    let model = p.body.get("model").and_then(Value::as_str).unwrap_or(&app.model_name).to_string();
    if p.params.stream {
        stream_response(g, p, id, created, model, reason, inflight)
    } else {
        let _inflight = inflight;
        whole_response(g, p, id, created, model, reason).await
    }
}

async fn whole_response(mut g: Gen, p: Prepared, id: String, created: u64, model: String, reason: &str) -> Response {
    let mut parts = Vec::new();
    let finish = loop {
        match g.next().await {
            Step::Parts(x) => parts.extend(x),
            Step::Finished { finish } => break finish,
            Step::Failed(m) => {
                return ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "engine_error", m).into_response()
            }
        }
    };
    let agg = crate::parse::aggregate(parts);
    let body = match p.kind {
        Kind::Chat => {
            let calls: Vec<Value> =
                agg.calls.iter().enumerate().map(|(i, c)| call_json(c, &format!("call_{id}_{i}"), i)).collect();
            let mut msg = Map::new();
            msg.insert("role".into(), json!("assistant"));
            msg.insert("content".into(), agg.content.map(Value::String).unwrap_or(Value::Null));
            if let Some(r) = agg.reasoning {
                msg.insert("reasoning_content".into(), Value::String(r));
            }
            if !calls.is_empty() {
                // Non-streaming calls carry no `index`.
                let calls: Vec<Value> = calls
                    .into_iter()
                    .map(|mut c| {
                        if let Some(o) = c.as_object_mut() {
                            o.remove("index");
                        }
                        c
                    })
                    .collect();
                msg.insert("tool_calls".into(), Value::Array(calls));
            }
            json!({"id": id, "object": "chat.completion", "created": created, "model": model,
                   "choices": [{"index": 0, "message": msg, "logprobs": null, "finish_reason": finish}],
                   "usage": g.usage()})
        }
        Kind::Completion => json!({"id": id, "object": "text_completion", "created": created, "model": model,
                   "choices": [{"index": 0, "text": agg.content.unwrap_or_default(), "logprobs": null, "finish_reason": finish}],
                   "usage": g.usage()}),
    };
    metrics::counter!(names::HTTP_REQUESTS, "status" => "200").increment(1);
    let mut r = axum::Json(body).into_response();
    r.headers_mut().insert("x-calla-route", HeaderValue::from_static("local"));
    if let Ok(v) = HeaderValue::from_str(reason) {
        r.headers_mut().insert("x-calla-route-reason", v);
    }
    r
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

fn stream_response<T: Send + 'static>(
    g: Gen,
    p: Prepared,
    id: String,
    created: u64,
    model: String,
    reason: &str,
    inflight: T,
) -> Response {
    let kind = p.kind;
    let include_usage = p.params.include_usage;
    struct St<T> {
        g: Gen,
        started: bool,
        ended: bool,
        call_index: usize,
        _inflight: T,
    }
    let chunk = {
        let (id, model) = (id.clone(), model.clone());
        move |delta: Value, finish: Option<&str>| -> Value {
            match kind {
                Kind::Chat => json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]}),
                Kind::Completion => json!({"id": id, "object": "text_completion", "created": created, "model": model,
                    "choices": [{"index": 0, "text": delta.get("content").and_then(Value::as_str).unwrap_or(""),
                                 "logprobs": null, "finish_reason": finish}]}),
            }
        }
    };
    let (id2, model2) = (id.clone(), model.clone());
    let st = St { g, started: false, ended: false, call_index: 0, _inflight: inflight };
    let stream = futures_util::stream::unfold(st, move |mut st| {
        let chunk = chunk.clone();
        let (id, model) = (id2.clone(), model2.clone());
        async move {
            if st.ended {
                return None;
            }
            let mut out = Vec::new();
            if !st.started {
                st.started = true;
                if kind == Kind::Chat {
                    out.push(sse(&chunk(json!({"role": "assistant", "content": ""}), None)));
                }
            }
            loop {
                match st.g.next().await {
                    Step::Parts(parts) => {
                        for part in parts {
                            let delta = match part {
                                Part::Reasoning(t) => json!({"reasoning_content": t}),
                                Part::Content(t) => json!({"content": t}),
                                Part::Call(c) => {
                                    let i = st.call_index;
                                    st.call_index += 1;
                                    json!({"tool_calls": [call_json(&c, &format!("call_{id}_{i}"), i)]})
                                }
                            };
                            out.push(sse(&chunk(delta, None)));
                        }
                        if !out.is_empty() {
                            break;
                        }
                    }
                    Step::Finished { finish } => {
                        out.push(sse(&chunk(json!({}), Some(finish))));
                        if include_usage {
                            let v = match kind {
                                Kind::Chat => json!({"id": id, "object": "chat.completion.chunk", "created": created,
                                    "model": model, "choices": [], "usage": st.g.usage()}),
                                Kind::Completion => json!({"id": id, "object": "text_completion", "created": created,
                                    "model": model, "choices": [], "usage": st.g.usage()}),
                            };
                            out.push(sse(&v));
                        }
                        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                        st.ended = true;
                        break;
                    }
                    Step::Failed(m) => {
                        let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "engine_error", m);
                        out.push(sse(&e.body()));
                        out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                        st.ended = true;
                        break;
                    }
                }
            }
            let bytes: Vec<u8> = out.concat();
            Some((Ok::<_, std::io::Error>(Bytes::from(bytes)), st))
        }
    });
    metrics::counter!(names::HTTP_REQUESTS, "status" => "200").increment(1);
    let mut r = Response::new(Body::from_stream(stream));
    let h = r.headers_mut();
    h.insert("content-type", HeaderValue::from_static("text/event-stream"));
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    h.insert("x-calla-route", HeaderValue::from_static("local"));
    if let Ok(v) = HeaderValue::from_str(reason) {
        h.insert("x-calla-route-reason", v);
    }
    r
}

/// `GET /v1/models`.
pub async fn models(State(app): Shared) -> Response {
    axum::Json(json!({"object": "list", "data": [{"id": app.model_name, "object": "model", "created": 0, "owned_by": "calla"}]}))
        .into_response()
}

/// `GET /health`.
pub async fn health(State(app): Shared) -> Response {
    let h = app.health();
    let code = if h["status"] == "failed" { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::OK };
    (code, axum::Json(h)).into_response()
}

/// `GET /metrics`.
pub async fn metrics_text(State(app): Shared) -> Response {
    let mut r = app.prom.render().into_response();
    r.headers_mut().insert("content-type", HeaderValue::from_static("text/plain; version=0.0.4"));
    r
}

/// `POST /admin/faults`: fault injection (admin only). Fields (all optional):
/// `prefill_delay_ms`, `token_delay_ms`, `fail_next`, `fail_all`, `mem_available_bytes`,
/// `psi_some_avg10` (null clears an override), `cloud_down` (mark the upstream down).
pub async fn admin_faults(State(app): Shared, body: Body) -> Response {
    if !app.admin {
        return ApiError::new(StatusCode::NOT_FOUND, "not_found", "admin endpoints are disabled (--admin)")
            .into_response();
    }
    let v = match read_body(&app, body).await.and_then(|b| parse_json(&b)) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    if let Some(w) = &app.worker {
        let f = &w.shared.faults;
        if let Some(x) = v.get("prefill_delay_ms").and_then(Value::as_u64) {
            f.prefill_delay_ms.store(x, Ordering::SeqCst);
        }
        if let Some(x) = v.get("token_delay_ms").and_then(Value::as_u64) {
            f.token_delay_ms.store(x, Ordering::SeqCst);
        }
        if let Some(x) = v.get("fail_next").and_then(Value::as_u64) {
            f.fail_next.store(x, Ordering::SeqCst);
        }
        if let Some(x) = v.get("fail_all").and_then(Value::as_bool) {
            f.fail_all.store(x, Ordering::SeqCst);
        }
    }
    {
        let mut o = app.memory_override.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(x) = v.get("mem_available_bytes") {
            o.available_bytes = x.as_u64();
        }
        if let Some(x) = v.get("psi_some_avg10") {
            o.psi_some_avg10 = x.as_f64();
        }
    }
    tracing::warn!(target: "calla::admin", faults = %v, "fault injection");
    let f = app.worker.as_ref().map(|w| {
        let f = &w.shared.faults;
        json!({"prefill_delay_ms": f.prefill_delay_ms.load(Ordering::SeqCst), "token_delay_ms": f.token_delay_ms.load(Ordering::SeqCst),
               "fail_next": f.fail_next.load(Ordering::SeqCst), "fail_all": f.fail_all.load(Ordering::SeqCst)})
    });
    let o = *app.memory_override.lock().unwrap_or_else(|e| e.into_inner());
    axum::Json(json!({"engine": f, "mem_available_bytes": o.available_bytes, "psi_some_avg10": o.psi_some_avg10}))
        .into_response()
}

/// `POST /admin/breaker` `{"action": "open" | "reset"}` (admin only).
pub async fn admin_breaker(State(app): Shared, body: Body) -> Response {
    if !app.admin {
        return ApiError::new(StatusCode::NOT_FOUND, "not_found", "admin endpoints are disabled (--admin)")
            .into_response();
    }
    let v = match read_body(&app, body).await.and_then(|b| parse_json(&b)) {
        Ok(v) => v,
        Err(e) => return e.into_response(),
    };
    let now = app.now_s();
    let (before, after) = {
        let mut b = app.breaker.lock().unwrap_or_else(|e| e.into_inner());
        let before = b.state();
        match v.get("action").and_then(Value::as_str) {
            Some("open") => b.force_open(now),
            Some("reset") => b.reset(),
            _ => return ApiError::field("action", "must be \"open\" or \"reset\"").into_response(),
        }
        (before, b.state())
    };
    if before != after {
        app.breaker_changed(before, after);
    }
    axum::Json(app.health()["breaker"].clone()).into_response()
}

/// Fallback: 404 in OpenAI's shape.
pub async fn not_found() -> Response {
    ApiError::new(StatusCode::NOT_FOUND, "not_found", "no such endpoint").into_response()
}
