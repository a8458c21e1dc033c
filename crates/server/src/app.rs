//! The application state shared by every handler: the engine thread, the breaker, the cloud
//! upstream, the state machine, live statistics; and the background monitor.

use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use engine::worker::{Phase, Worker, WorkerConfig};
use metrics::{counter, gauge};
use router::policy::{self, LocalAvailability, Route, RouteInput};
use router::probe::MemorySample;
use router::{Admission, Breaker, CloudUpstream, Config};
use sampler::SamplingParams;
use serde_json::{json, Value};
use telemetry::{names, LocalPhase, StateMachine};
use text::{ChatTemplate, Tokenizer};

/// How to start the server.
pub struct ServeOptions {
    /// Model snapshot folder.
    pub model_dir: PathBuf,
    /// Parsed config file (defaults when none).
    pub config: Config,
    /// Serve `/admin/*` regardless of the config.
    pub admin: bool,
    /// Run the local engine (false: the probe said the model does not fit; cloud only).
    pub local: bool,
    /// Why local mode is off, for `/health` and 503 messages.
    pub local_off_reason: Option<String>,
    /// Builds the accelerator the local engine runs on (`None`: the CPU; `calla serve
    /// --device cuda` sets it).
    pub accelerator: Option<engine::worker::AcceleratorFactory>,
}

/// Live numbers for `/dashboard/data` (Prometheus has the same, aggregated).
#[derive(Default)]
pub struct Live {
    /// (time s, TTFT ms) of recent local requests.
    pub ttft_ms: VecDeque<(f64, f64)>,
    /// (time s, inter-token ms) samples, recent.
    pub itl_ms: VecDeque<(f64, f64)>,
    /// (time s, decode tok/s) of recent local requests.
    pub decode_tps: VecDeque<(f64, f64)>,
    /// (time s, prefill tok/s).
    pub prefill_tps: VecDeque<(f64, f64)>,
    /// (time s, MemAvailable bytes, PSI some avg10).
    pub memory: VecDeque<(f64, f64, f64)>,
    /// (time s, queue length, breaker gauge).
    pub queue: VecDeque<(f64, f64, f64)>,
    /// Routing decisions: local, cloud, refused.
    pub routes: [u64; 3],
    /// Recent routing decisions (time s, target, reason, categories).
    pub recent_routes: VecDeque<(f64, &'static str, &'static str, String)>,
}

fn push_capped<T>(q: &mut VecDeque<T>, x: T, cap: usize) {
    if q.len() >= cap {
        q.pop_front();
    }
    q.push_back(x);
}

/// Memory readings forced through `/admin/faults` (they replace the monitor's readings).
#[derive(Debug, Default, Clone, Copy)]
pub struct MemoryOverride {
    /// MemAvailable, bytes.
    pub available_bytes: Option<u64>,
    /// PSI some avg10, percent.
    pub psi_some_avg10: Option<f64>,
}

/// Everything the handlers share.
pub struct App {
    /// The config.
    pub cfg: Config,
    /// Served model name.
    pub model_name: String,
    /// Tokenizer (prompt limits, decoding).
    pub tokenizer: Arc<Tokenizer>,
    /// Chat template.
    pub template: ChatTemplate,
    /// Sampling defaults from `generation_config.json`.
    pub defaults: SamplingParams,
    /// The engine thread (None: local mode off).
    pub worker: Option<Worker>,
    /// Why local mode is off.
    pub local_off_reason: Option<String>,
    /// Load error of the engine thread.
    pub load_error: Mutex<Option<String>>,
    /// The cloud upstream.
    pub cloud: Option<CloudUpstream>,
    /// The upstream failed its last request or health check.
    pub cloud_down: AtomicBool,
    /// The upstream's last error.
    pub cloud_error: Mutex<Option<String>>,
    /// The breaker.
    pub breaker: Mutex<Breaker>,
    /// The engine state machine.
    pub sm: StateMachine,
    /// Prometheus handle.
    pub prom: telemetry::PrometheusHandle,
    /// Start time.
    pub t0: Instant,
    /// Last memory reading.
    pub memory: Mutex<MemorySample>,
    /// Forced memory readings.
    pub memory_override: Mutex<MemoryOverride>,
    /// Dashboard data.
    pub live: Mutex<Live>,
    /// `/admin/*` enabled.
    pub admin: bool,
    audit: Option<Mutex<std::fs::File>>,
    /// Request counter (ids).
    pub seq: AtomicU64,
    /// Requests being served (local or cloud).
    pub inflight: AtomicUsize,
}

impl App {
    /// Loads tokenizer, template and generation defaults, starts the engine thread (when
    /// local mode is on) and the monitor. Must run inside a Tokio runtime.
    ///
    /// # Errors
    /// Missing tokenizer/template, bad cloud config, unwritable audit log.
    pub fn start(mut opts: ServeOptions) -> anyhow::Result<Arc<App>> {
        let accelerator = opts.accelerator.take();
        let dir = &opts.model_dir;
        let tokenizer = Tokenizer::from_dir(dir)?
            .ok_or_else(|| anyhow::anyhow!("{} has no tokenizer.json: the server needs one", dir.display()))?;
        let template = ChatTemplate::from_dir(dir)?
            .ok_or_else(|| anyhow::anyhow!("{} has no chat template: the server needs one", dir.display()))?;
        let gen = spec::GenerationConfig::from_dir(dir).map_err(|e| anyhow::anyhow!("{e}"))?;
        let defaults = engine::sampling_defaults(&gen);
        let cloud = match &opts.config.cloud {
            Some(c) => Some(CloudUpstream::new(c)?),
            None => None,
        };
        let audit = match &opts.config.audit_log {
            Some(p) => Some(Mutex::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)
                    .map_err(|e| anyhow::anyhow!("cannot open audit log {p}: {e}"))?,
            )),
            None => None,
        };
        let prom = telemetry::install_prometheus();
        let sm = StateMachine::new(if opts.local { LocalPhase::Loading } else { LocalPhase::Disabled });
        let admin = opts.admin || opts.config.admin.enabled;
        let app = Arc::new_cyclic(|weak: &std::sync::Weak<App>| {
            let worker = opts.local.then(|| {
                let w = weak.clone();
                let sm2 = sm.clone();
                Worker::spawn(WorkerConfig {
                    dir: dir.clone(),
                    max_ctx: opts.config.max_context_tokens.unwrap_or(32_768),
                    queue_depth: opts.config.limits.queue_depth.max(1),
                    prefix_cache: opts.config.prefix_cache.unwrap_or(2),
                    on_phase: Arc::new(move |p: Phase| {
                        let local = match &p {
                            Phase::Loading => LocalPhase::Loading,
                            Phase::Idle => LocalPhase::Idle,
                            Phase::Prefill => LocalPhase::Prefill,
                            Phase::Decoding => LocalPhase::Decoding,
                            Phase::Failed(msg) => {
                                tracing::error!(target: "calla::engine", error = %msg, "local engine failed to load");
                                if let Some(a) = w.upgrade() {
                                    *a.load_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(msg.clone());
                                }
                                LocalPhase::Failed
                            }
                        };
                        sm2.update(|i| i.local = local);
                    }),
                    accelerator,
                })
            });
            App {
                model_name: opts.config.model_name(),
                breaker: Mutex::new(Breaker::new(opts.config.breaker.clone())),
                cfg: opts.config,
                tokenizer: Arc::new(tokenizer),
                template,
                defaults,
                worker,
                local_off_reason: opts.local_off_reason,
                load_error: Mutex::new(None),
                cloud,
                cloud_down: AtomicBool::new(false),
                cloud_error: Mutex::new(None),
                sm,
                prom,
                t0: Instant::now(),
                memory: Mutex::new(MemorySample::default()),
                memory_override: Mutex::new(MemoryOverride::default()),
                live: Mutex::new(Live::default()),
                admin,
                audit,
                seq: AtomicU64::new(1),
                inflight: AtomicUsize::new(0),
            }
        });
        let mon = app.clone();
        tokio::spawn(async move { mon.monitor().await });
        Ok(app)
    }

    /// Seconds since start (the breaker's clock).
    pub fn now_s(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    /// Unix time, seconds.
    pub fn unix(&self) -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
    }

    /// Whether the engine thread can take a request now.
    pub fn local_availability(&self) -> LocalAvailability {
        let Some(w) = &self.worker else { return LocalAvailability::Unavailable };
        match self.sm.inputs().local {
            LocalPhase::Loading => LocalAvailability::Loading,
            LocalPhase::Failed | LocalPhase::Disabled => LocalAvailability::Unavailable,
            _ if w.queue_len() >= w.queue_depth() => LocalAvailability::QueueFull,
            _ => LocalAvailability::Ready,
        }
    }

    /// A cloud upstream is configured and not known to be down.
    pub fn cloud_usable(&self) -> bool {
        self.cloud.is_some() && !self.cloud_down.load(Ordering::SeqCst)
    }

    /// Decides where a request goes (and takes the half-open probe slot when it is the probe).
    pub fn decide(&self, pinned_local: bool, prefers_cloud: bool) -> Route {
        let now = self.now_s();
        let mut b = self.breaker.lock().unwrap_or_else(|e| e.into_inner());
        let before = b.state();
        let admission = if pinned_local { Admission::Local } else { b.admit(now) };
        let r = policy::route(&RouteInput {
            pinned_local,
            prefers_cloud,
            local: self.local_availability(),
            admission,
            cloud_usable: self.cloud_usable(),
        });
        if let Route::Local { probe: true, .. } = r {
            b.begin_probe(now);
        }
        let after = b.state();
        drop(b);
        if before.name() != after.name() {
            self.breaker_changed(before, after);
        }
        r
    }

    /// Records a routing decision (metrics, dashboard, log).
    pub fn record_route(&self, target: &'static str, reason: &'static str, cats: &str) {
        counter!(names::ROUTE_DECISIONS, "target" => target, "reason" => reason).increment(1);
        tracing::info!(target: "calla::router", route = target, reason, categories = cats, "routing decision");
        let mut l = self.live.lock().unwrap_or_else(|e| e.into_inner());
        let i = match target {
            "local" => 0,
            "cloud" => 1,
            _ => 2,
        };
        l.routes[i] += 1;
        let now = self.now_s();
        push_capped(&mut l.recent_routes, (now, target, reason, cats.to_string()), 50);
    }

    /// Appends one line to the audit log.
    pub fn audit(&self, path: &str, route: &str, reason: &str, cats: &[String], body: &Value) {
        if let Some(f) = &self.audit {
            let line = json!({"time": self.unix(), "path": path, "route": route, "reason": reason,
                              "categories": cats, "body": body});
            let mut f = f.lock().unwrap_or_else(|e| e.into_inner());
            let _ = writeln!(f, "{line}");
            let _ = f.flush();
        }
    }

    /// A breaker transition: log, metrics, state machine.
    pub fn breaker_changed(&self, from: router::BreakerState, to: router::BreakerState) {
        let reason = match to {
            router::BreakerState::Open { reason, .. } => reason.as_str(),
            _ => "",
        };
        tracing::warn!(target: "calla::breaker", from = from.name(), to = to.name(), reason, "breaker transition");
        if let router::BreakerState::Open { reason, .. } = to {
            counter!(names::BREAKER_TRIPS, "reason" => reason.as_str()).increment(1);
        }
        gauge!(names::BREAKER_STATE).set(to.gauge());
        let throttled = !matches!(to, router::BreakerState::Closed);
        self.sm.update(|i| i.throttled = throttled);
    }

    /// A finished local generation: breaker windows, histograms, dashboard.
    pub fn local_finished(&self, ttft: Option<Duration>, decode_tps: Option<f64>, prefill_tps: Option<f64>) {
        let now = self.now_s();
        if let Some(t) = ttft {
            let ms = t.as_secs_f64() * 1e3;
            {
                let mut b = self.breaker.lock().unwrap_or_else(|e| e.into_inner());
                b.record_local(ms, decode_tps, now);
            }
            let mut l = self.live.lock().unwrap_or_else(|e| e.into_inner());
            push_capped(&mut l.ttft_ms, (now, ms), 300);
            if let Some(x) = decode_tps {
                gauge!(names::DECODE_TPS).set(x);
                push_capped(&mut l.decode_tps, (now, x), 300);
            }
            if let Some(x) = prefill_tps {
                gauge!(names::PREFILL_TPS).set(x);
                push_capped(&mut l.prefill_tps, (now, x), 300);
            }
        }
        self.tick_breaker();
    }

    /// An inter-token gap.
    pub fn inter_token(&self, d: Duration) {
        metrics::histogram!(names::INTER_TOKEN_SECONDS).record(d.as_secs_f64());
        let now = self.now_s();
        let mut l = self.live.lock().unwrap_or_else(|e| e.into_inner());
        push_capped(&mut l.itl_ms, (now, d.as_secs_f64() * 1e3), 600);
    }

    /// A local engine error (not the client's fault).
    pub fn local_error(&self) {
        counter!(names::ENGINE_ERRORS).increment(1);
        self.breaker.lock().unwrap_or_else(|e| e.into_inner()).record_error();
        self.tick_breaker();
    }

    /// A half-open probe finished.
    pub fn probe_finished(&self, ok: bool) {
        let now = self.now_s();
        let t = self.breaker.lock().unwrap_or_else(|e| e.into_inner()).probe_finished(ok, now);
        if let Some((a, b)) = t {
            self.breaker_changed(a, b);
        }
    }

    /// Re-evaluates the breaker.
    pub fn tick_breaker(&self) {
        let now = self.now_s();
        let t = self.breaker.lock().unwrap_or_else(|e| e.into_inner()).tick(now);
        if let Some((a, b)) = t {
            self.breaker_changed(a, b);
        }
    }

    /// The upstream answered (or not).
    pub fn cloud_result(&self, err: Option<String>) {
        let down = err.is_some();
        let was = self.cloud_down.swap(down, Ordering::SeqCst);
        if was != down {
            tracing::warn!(target: "calla::cloud", down, error = err.as_deref().unwrap_or(""), "cloud upstream health changed");
        }
        if let Some(e) = err {
            *self.cloud_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        }
    }

    /// Queue gauge.
    pub fn update_queue_gauge(&self) {
        if let Some(w) = &self.worker {
            gauge!(names::QUEUE_DEPTH).set(w.queue_len() as f64);
        }
    }

    async fn monitor(self: Arc<Self>) {
        let period = Duration::from_millis(self.cfg.memory_monitor.interval_ms.max(50));
        let mut tick = tokio::time::interval(period);
        let mut n: u64 = 0;
        loop {
            tick.tick().await;
            n += 1;
            let mm = &self.cfg.memory_monitor;
            let (a, b) = (mm.meminfo_path.clone(), mm.psi_path.clone());
            let mut m =
                tokio::task::spawn_blocking(move || router::probe::read_memory(&a, &b)).await.unwrap_or_default();
            let o = *self.memory_override.lock().unwrap_or_else(|e| e.into_inner());
            if o.available_bytes.is_some() {
                m.available_bytes = o.available_bytes;
            }
            if o.psi_some_avg10.is_some() {
                m.psi_some_avg10 = o.psi_some_avg10;
            }
            *self.memory.lock().unwrap_or_else(|e| e.into_inner()) = m;
            if let Some(x) = m.available_bytes {
                gauge!(names::MEM_AVAILABLE).set(x as f64);
            }
            if let Some(x) = m.total_bytes {
                gauge!(names::MEM_TOTAL).set(x as f64);
            }
            if let Some(x) = m.psi_some_avg10 {
                gauge!(names::MEM_PSI_SOME).set(x);
            }
            self.breaker.lock().unwrap_or_else(|e| e.into_inner()).record_memory(m.available_bytes, m.psi_some_avg10);
            self.tick_breaker();
            self.update_queue_gauge();
            let now = self.now_s();
            {
                let bg = self.breaker.lock().unwrap_or_else(|e| e.into_inner()).state().gauge();
                let q = self.worker.as_ref().map_or(0, |w| w.queue_len()) as f64;
                let mut l = self.live.lock().unwrap_or_else(|e| e.into_inner());
                push_capped(
                    &mut l.memory,
                    (now, m.available_bytes.unwrap_or(0) as f64, m.psi_some_avg10.unwrap_or(0.0)),
                    600,
                );
                push_capped(&mut l.queue, (now, q, bg), 600);
            }
            if let Some(w) = &self.worker {
                let counts = w.shared.expert_counts.lock().unwrap_or_else(|e| e.into_inner()).clone();
                for (l, row) in counts.iter().enumerate() {
                    let total: u64 = row.iter().sum();
                    if total == 0 {
                        continue;
                    }
                    let max = row.iter().copied().max().unwrap_or(0) as f64;
                    let mean = total as f64 / row.len() as f64;
                    gauge!(names::EXPERT_IMBALANCE, "layer" => l.to_string()).set(max / mean);
                    counter!(names::EXPERT_ASSIGNMENTS, "layer" => l.to_string()).absolute(total);
                }
            }
            // Re-check a down upstream every ~2 s.
            if let Some(c) = &self.cloud {
                let every = (2000 / period.as_millis().max(1) as u64).max(1);
                if self.cloud_down.load(Ordering::SeqCst) && (n % every) == 0 /* keeps MSRV 1.85 */ {
                    let ok = c.healthy().await;
                    if ok {
                        self.cloud_result(None);
                    }
                }
            }
        }
    }

    /// `/health`.
    pub fn health(&self) -> Value {
        let b = self.breaker.lock().unwrap_or_else(|e| e.into_inner());
        let now = self.now_s();
        let sig = b.signals(now);
        let (breaker_reason, since) = match b.state() {
            router::BreakerState::Open { reason, since_s } => (Some(reason.as_str()), Some(since_s)),
            _ => (None, None),
        };
        let breaker = json!({
            "state": b.state().name(), "reason": breaker_reason, "open_since_s": since, "trips": b.trips,
            "ttft_p95_ms": sig.ttft_p95_ms, "decode_baseline_tps": b.decode_baseline_tps(),
            "decode_slow_for_s": sig.decode_slow_for_s, "consecutive_errors": sig.consecutive_errors,
        });
        drop(b);
        let state = self.sm.state();
        let m = *self.memory.lock().unwrap_or_else(|e| e.into_inner());
        let local = json!({
            "enabled": self.worker.is_some(),
            "backend": self.worker.as_ref().and_then(|w| w.shared.backend.lock().unwrap_or_else(|e| e.into_inner()).clone()),
            "phase": self.sm.inputs().local,
            "off_reason": self.local_off_reason,
            "load_error": *self.load_error.lock().unwrap_or_else(|e| e.into_inner()),
            "queue_len": self.worker.as_ref().map(|w| w.queue_len()),
            "queue_depth": self.worker.as_ref().map(|w| w.queue_depth()),
            "prefix_cache_hits": self.worker.as_ref().map(|w| w.shared.cache_hits.load(Ordering::Relaxed)),
            "errors": self.worker.as_ref().map(|w| w.shared.errors.load(Ordering::Relaxed)),
        });
        let cloud = self.cloud.as_ref().map(|c| {
            json!({"base_url": c.base_url(), "healthy": !self.cloud_down.load(Ordering::SeqCst),
                   "last_error": *self.cloud_error.lock().unwrap_or_else(|e| e.into_inner())})
        });
        let status = match state {
            telemetry::EngineState::Failed if !self.cloud_usable() => "failed",
            telemetry::EngineState::Failed | telemetry::EngineState::Throttled => "degraded",
            telemetry::EngineState::AllocatingWeights => "starting",
            _ => "ok",
        };
        let transitions: Vec<String> = self
            .sm
            .transitions()
            .iter()
            .rev()
            .take(10)
            .map(|(a, b)| format!("{}->{}", a.as_str(), b.as_str()))
            .collect();
        json!({
            "status": status, "state": state.as_str(), "model": self.model_name, "uptime_s": now,
            "local": local, "breaker": breaker, "cloud": cloud, "memory": m,
            "inflight": self.inflight.load(Ordering::SeqCst), "recent_transitions": transitions,
        })
    }
}
