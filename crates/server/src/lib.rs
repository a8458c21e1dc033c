//! calla's OpenAI-compatible HTTP server (axum): `/v1/chat/completions` (SSE and whole),
//! `/v1/completions`, `/v1/models`, `/health`, `/metrics`, `/dashboard`, and `/admin/*` for
//! fault injection. One engine thread owns the model; requests queue to it; requests that may
//! leave the machine go to a cloud upstream when the breaker is open (see docs/SERVER.md).

#![warn(missing_docs)]

pub mod app;
pub mod dashboard;
pub mod error;
pub mod handlers;
pub mod params;
pub mod parse;

use std::net::SocketAddr;
use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;

pub use app::{App, ServeOptions};

/// The HTTP routes.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(handlers::chat))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/models", get(handlers::models))
        .route("/health", get(handlers::health))
        .route("/metrics", get(handlers::metrics_text))
        .route("/dashboard", get(dashboard::page))
        .route("/dashboard/data", get(dashboard::data))
        .route("/dashboard/uPlot.iife.min.js", get(dashboard::uplot_js))
        .route("/dashboard/uPlot.min.css", get(dashboard::uplot_css))
        .route("/admin/faults", post(handlers::admin_faults))
        .route("/admin/breaker", post(handlers::admin_breaker))
        .fallback(handlers::not_found)
        .with_state(app)
}

/// Binds `addr` and serves until Ctrl-C / SIGTERM. Prints `listening on http://ADDR` to stderr
/// once bound (tests wait for it).
///
/// # Errors
/// Startup errors (model files, config, bind).
pub async fn serve(opts: ServeOptions, addr: SocketAddr) -> anyhow::Result<()> {
    let app = App::start(opts)?;
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| anyhow::anyhow!("cannot bind {addr}: {e}"))?;
    let local = listener.local_addr()?;
    tracing::info!(target: "calla::server", addr = %local, "listening");
    eprintln!("listening on http://{local}");
    axum::serve(listener, router(app))
        .with_graceful_shutdown(async {
            let ctrl_c = tokio::signal::ctrl_c();
            #[cfg(unix)]
            {
                let mut term =
                    tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("signal handler");
                tokio::select! { _ = ctrl_c => {}, _ = term.recv() => {} }
            }
            #[cfg(not(unix))]
            let _ = ctrl_c.await;
        })
        .await?;
    Ok(())
}
