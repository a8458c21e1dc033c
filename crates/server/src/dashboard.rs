//! `/dashboard`: a self-contained page (uPlot embedded) charting live data from `/dashboard/data`.

use std::sync::Arc;

use axum::extract::State;
use axum::http::HeaderValue;
use axum::response::{Html, IntoResponse, Response};
use serde_json::json;

use crate::app::App;

const UPLOT_JS: &str = include_str!("../assets/uPlot.iife.min.js");
const UPLOT_CSS: &str = include_str!("../assets/uPlot.min.css");

const PAGE: &str = include_str!("../assets/dashboard.html");

/// `GET /dashboard`.
pub async fn page() -> Html<&'static str> {
    Html(PAGE)
}

/// `GET /dashboard/uPlot.iife.min.js`.
pub async fn uplot_js() -> Response {
    let mut r = UPLOT_JS.into_response();
    r.headers_mut().insert("content-type", HeaderValue::from_static("application/javascript"));
    r
}

/// `GET /dashboard/uPlot.min.css`.
pub async fn uplot_css() -> Response {
    let mut r = UPLOT_CSS.into_response();
    r.headers_mut().insert("content-type", HeaderValue::from_static("text/css"));
    r
}

fn quantile(xs: &[f64], q: f64) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// `GET /dashboard/data`.
pub async fn data(State(app): State<Arc<App>>) -> Response {
    let h = app.health();
    let l = app.live.lock().unwrap_or_else(|e| e.into_inner());
    let ttft: Vec<f64> = l.ttft_ms.iter().map(|x| x.1).collect();
    let experts = app
        .worker
        .as_ref()
        .map(|w| w.shared.expert_counts.lock().unwrap_or_else(|e| e.into_inner()).clone())
        .unwrap_or_default();
    let experts: Vec<Vec<u64>> = experts.into_iter().filter(|r| !r.is_empty()).collect();
    let pairs = |q: &std::collections::VecDeque<(f64, f64)>| q.iter().map(|&(a, b)| json!([a, b])).collect::<Vec<_>>();
    let body = json!({
        "model": app.model_name,
        "state": h["state"],
        "breaker": h["breaker"],
        "queue_len": h["local"]["queue_len"],
        "queue_depth": h["local"]["queue_depth"],
        "routes": l.routes,
        "recent_routes": l.recent_routes.iter().map(|r| json!([r.0, r.1, r.2, r.3])).collect::<Vec<_>>(),
        "ttft": pairs(&l.ttft_ms),
        "ttft_quantiles_ms": [quantile(&ttft, 0.5), quantile(&ttft, 0.95), quantile(&ttft, 0.99)],
        "itl": pairs(&l.itl_ms),
        "decode_tps": pairs(&l.decode_tps),
        "prefill_tps": pairs(&l.prefill_tps),
        "memory": l.memory.iter().map(|&(a, b, c)| json!([a, b, c])).collect::<Vec<_>>(),
        "memory_available_gb": h["memory"]["available_bytes"].as_f64().map(|b| b / 1e9),
        "queue": l.queue.iter().map(|&(a, b, c)| json!([a, b, c])).collect::<Vec<_>>(),
        "experts": experts,
    });
    axum::Json(body).into_response()
}
