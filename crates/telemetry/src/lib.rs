//! Telemetry for calla: metric names, the engine state machine, the Prometheus recorder and
//! JSON logs.
//!
//! Metric names follow `calla_<subsystem>_<what>_<unit>`. Every metric calla exports is named
//! here, so the server, the dashboard and `bench/grafana/calla.json` agree.

#![warn(missing_docs)]

use std::sync::{Arc, Mutex};

pub use metrics_exporter_prometheus::PrometheusHandle;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use serde::Serialize;

/// Metric names.
pub mod names {
    /// Histogram: time to first token of local generations, seconds.
    pub const TTFT_SECONDS: &str = "calla_engine_ttft_seconds";
    /// Histogram: time between consecutive generated tokens, seconds.
    pub const INTER_TOKEN_SECONDS: &str = "calla_engine_inter_token_seconds";
    /// Gauge: prefill speed of the last local generation, tokens/s.
    pub const PREFILL_TPS: &str = "calla_engine_prefill_tokens_per_second";
    /// Gauge: decode speed of the last local generation, tokens/s.
    pub const DECODE_TPS: &str = "calla_engine_decode_tokens_per_second";
    /// Counter: tokens generated locally.
    pub const GENERATED_TOKENS: &str = "calla_engine_generated_tokens_total";
    /// Counter: prompt tokens processed locally (`cached` label: reused from the prefix cache or not).
    pub const PROMPT_TOKENS: &str = "calla_engine_prompt_tokens_total";
    /// Gauge: requests waiting for the engine thread.
    pub const QUEUE_DEPTH: &str = "calla_engine_queue_depth";
    /// Gauge: 1 for the current engine state (`state` label), 0 for the others.
    pub const ENGINE_STATE: &str = "calla_engine_state";
    /// Counter: engine state transitions (`from`, `to`).
    pub const ENGINE_TRANSITIONS: &str = "calla_engine_state_transitions_total";
    /// Counter: engine errors.
    pub const ENGINE_ERRORS: &str = "calla_engine_errors_total";
    /// Counter: expert assignments per MoE layer (`layer`).
    pub const EXPERT_ASSIGNMENTS: &str = "calla_engine_expert_assignments_total";
    /// Gauge: most-loaded expert's share over the mean share, per MoE layer (`layer`); 1 = balanced.
    pub const EXPERT_IMBALANCE: &str = "calla_engine_expert_load_imbalance_ratio";
    /// Gauge: MemAvailable of the host, bytes.
    pub const MEM_AVAILABLE: &str = "calla_system_memory_available_bytes";
    /// Gauge: MemTotal of the host, bytes.
    pub const MEM_TOTAL: &str = "calla_system_memory_total_bytes";
    /// Gauge: Linux PSI memory `some avg10`, percent.
    pub const MEM_PSI_SOME: &str = "calla_system_memory_pressure_some_avg10_percent";
    /// Counter: routing decisions (`target` = local / cloud / refused, `reason`).
    pub const ROUTE_DECISIONS: &str = "calla_router_decisions_total";
    /// Gauge: breaker state, 0 closed, 1 half-open, 2 open.
    pub const BREAKER_STATE: &str = "calla_router_breaker_state";
    /// Counter: breaker trips (`reason`).
    pub const BREAKER_TRIPS: &str = "calla_router_breaker_trips_total";
    /// Counter: HTTP requests (`path`, `status`).
    pub const HTTP_REQUESTS: &str = "calla_http_requests_total";
    /// Histogram: time to first byte of cloud-served requests, seconds.
    pub const CLOUD_TTFB_SECONDS: &str = "calla_router_cloud_ttfb_seconds";

    /// Every name above.
    pub const ALL: &[&str] = &[
        TTFT_SECONDS,
        INTER_TOKEN_SECONDS,
        PREFILL_TPS,
        DECODE_TPS,
        GENERATED_TOKENS,
        PROMPT_TOKENS,
        QUEUE_DEPTH,
        ENGINE_STATE,
        ENGINE_TRANSITIONS,
        ENGINE_ERRORS,
        EXPERT_ASSIGNMENTS,
        EXPERT_IMBALANCE,
        MEM_AVAILABLE,
        MEM_TOTAL,
        MEM_PSI_SOME,
        ROUTE_DECISIONS,
        BREAKER_STATE,
        BREAKER_TRIPS,
        HTTP_REQUESTS,
        CLOUD_TTFB_SECONDS,
    ];
}

/// Latency buckets (seconds) for the TTFT and inter-token histograms.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0];

/// Installs the global Prometheus recorder (once per process; later calls return the same
/// handle). Histograms get [`LATENCY_BUCKETS`], so `histogram_quantile` works in Prometheus.
pub fn install_prometheus() -> PrometheusHandle {
    static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), LATENCY_BUCKETS)
                .expect("static buckets are valid")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (tests in one process): keep ours as a handle only.
            let _ = metrics::set_global_recorder(recorder);
            handle
        })
        .clone()
}

/// Structured JSON logs on stderr, filtered by `CALLA_LOG` (default `info`).
pub fn init_json_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CALLA_LOG").unwrap_or_else(|_| "info".into());
    let _ = tracing_subscriber::fmt().json().with_writer(std::io::stderr).with_env_filter(filter).try_init();
}

/// The engine state from the design (issue 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum EngineState {
    /// Loaded, nothing running.
    Idle,
    /// Loading / mapping weights and allocating state.
    AllocatingWeights,
    /// Processing a prompt.
    Prefill,
    /// Generating tokens.
    Decoding,
    /// The breaker is open (TTFT, decode speed or memory pressure): eligible traffic goes upstream.
    Throttled,
    /// The engine failed (load error, kernel error, out of memory).
    Failed,
    /// A request is being served by the cloud upstream and nothing runs locally.
    CloudInference,
}

impl EngineState {
    /// Every state, in gauge order.
    pub const ALL: [EngineState; 7] = [
        EngineState::Idle,
        EngineState::AllocatingWeights,
        EngineState::Prefill,
        EngineState::Decoding,
        EngineState::Throttled,
        EngineState::Failed,
        EngineState::CloudInference,
    ];

    /// The name used in `/health`, logs and the `state` label.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineState::Idle => "Idle",
            EngineState::AllocatingWeights => "AllocatingWeights",
            EngineState::Prefill => "Prefill",
            EngineState::Decoding => "Decoding",
            EngineState::Throttled => "Throttled",
            EngineState::Failed => "Failed",
            EngineState::CloudInference => "CloudInference",
        }
    }
}

/// What the local engine thread is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum LocalPhase {
    /// No local engine in this process (cloud-only: the model does not fit).
    Disabled,
    /// Loading weights.
    Loading,
    /// Waiting for work.
    Idle,
    /// Prefilling a prompt.
    Prefill,
    /// Decoding.
    Decoding,
    /// Loading failed, or the engine hit an error it cannot recover from.
    Failed,
}

/// The inputs the engine state is derived from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct StateInputs {
    /// The local engine thread.
    pub local: LocalPhase,
    /// Requests being served upstream right now.
    pub cloud_inflight: usize,
    /// Breaker open (or half-open) because the local engine is slow, pressured or erroring.
    pub throttled: bool,
}

/// The state machine as a pure function: local work wins (it is what the hardware is doing),
/// then failure, then cloud work, then throttling.
pub fn derive_state(i: &StateInputs) -> EngineState {
    match i.local {
        LocalPhase::Loading => EngineState::AllocatingWeights,
        LocalPhase::Prefill => EngineState::Prefill,
        LocalPhase::Decoding => EngineState::Decoding,
        LocalPhase::Failed if i.cloud_inflight == 0 => EngineState::Failed,
        _ if i.cloud_inflight > 0 => EngineState::CloudInference,
        LocalPhase::Failed => EngineState::Failed,
        LocalPhase::Disabled => EngineState::Idle,
        LocalPhase::Idle if i.throttled => EngineState::Throttled,
        LocalPhase::Idle => EngineState::Idle,
    }
}

/// Inputs, current state, recent transitions.
type Machine = (StateInputs, EngineState, Vec<(EngineState, EngineState)>);

/// Holds [`StateInputs`], derives the [`EngineState`], logs each transition and keeps the
/// `calla_engine_state` gauge current. Cheap to clone (shared).
#[derive(Clone)]
pub struct StateMachine {
    inner: Arc<Mutex<Machine>>,
}

impl Default for StateMachine {
    fn default() -> Self {
        Self::new(LocalPhase::Loading)
    }
}

impl StateMachine {
    /// A machine starting from `local`.
    pub fn new(local: LocalPhase) -> Self {
        let inputs = StateInputs { local, cloud_inflight: 0, throttled: false };
        let s = derive_state(&inputs);
        set_state_gauge(s);
        StateMachine { inner: Arc::new(Mutex::new((inputs, s, Vec::new()))) }
    }

    /// Applies `f` to the inputs; logs and counts the transition when the state changes.
    pub fn update(&self, f: impl FnOnce(&mut StateInputs)) -> EngineState {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut g.0);
        let next = derive_state(&g.0);
        let prev = g.1;
        if next != prev {
            g.1 = next;
            if g.2.len() >= 64 {
                g.2.remove(0);
            }
            g.2.push((prev, next));
            tracing::info!(target: "calla::state", from = prev.as_str(), to = next.as_str(), "engine state transition");
            metrics::counter!(names::ENGINE_TRANSITIONS, "from" => prev.as_str(), "to" => next.as_str()).increment(1);
            set_state_gauge(next);
        }
        next
    }

    /// The current state.
    pub fn state(&self) -> EngineState {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).1
    }

    /// The current inputs.
    pub fn inputs(&self) -> StateInputs {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    /// The last transitions (at most 64), oldest first.
    pub fn transitions(&self) -> Vec<(EngineState, EngineState)> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).2.clone()
    }
}

fn set_state_gauge(s: EngineState) {
    for x in EngineState::ALL {
        metrics::gauge!(names::ENGINE_STATE, "state" => x.as_str()).set(if x == s { 1.0 } else { 0.0 });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_table() {
        use EngineState as E;
        use LocalPhase as L;
        let cases = [
            (L::Loading, 0, false, E::AllocatingWeights),
            (L::Loading, 1, true, E::AllocatingWeights),
            (L::Idle, 0, false, E::Idle),
            (L::Idle, 0, true, E::Throttled),
            (L::Idle, 2, true, E::CloudInference),
            (L::Prefill, 1, true, E::Prefill),
            (L::Decoding, 0, false, E::Decoding),
            (L::Failed, 0, false, E::Failed),
            (L::Failed, 1, false, E::CloudInference),
            (L::Disabled, 0, false, E::Idle),
            (L::Disabled, 1, false, E::CloudInference),
        ];
        for (local, cloud_inflight, throttled, want) in cases {
            let got = derive_state(&StateInputs { local, cloud_inflight, throttled });
            assert_eq!(got, want, "{local:?} cloud={cloud_inflight} throttled={throttled}");
        }
    }

    #[test]
    fn grafana_dashboard_uses_exported_names() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/grafana/calla.json");
        let text = std::fs::read_to_string(path).expect("bench/grafana/calla.json");
        let mut found = 0;
        for (i, _) in text.match_indices("calla_") {
            let name: String =
                text[i..].chars().take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_').collect();
            if name == "calla_" || text[..i].ends_with("uid\": \"") {
                continue;
            }
            let base = name.strip_suffix("_bucket").unwrap_or(&name);
            assert!(names::ALL.contains(&base), "Grafana panel uses unknown metric {name}");
            found += 1;
        }
        assert!(found >= 10);
    }

    #[test]
    fn machine_records_transitions() {
        let m = StateMachine::new(LocalPhase::Loading);
        assert_eq!(m.state(), EngineState::AllocatingWeights);
        m.update(|i| i.local = LocalPhase::Idle);
        m.update(|i| i.local = LocalPhase::Prefill);
        m.update(|i| i.local = LocalPhase::Decoding);
        m.update(|i| i.local = LocalPhase::Decoding);
        m.update(|i| i.local = LocalPhase::Idle);
        let t: Vec<_> = m.transitions().iter().map(|(a, b)| format!("{}>{}", a.as_str(), b.as_str())).collect();
        assert_eq!(t, ["AllocatingWeights>Idle", "Idle>Prefill", "Prefill>Decoding", "Decoding>Idle"]);
    }
}
