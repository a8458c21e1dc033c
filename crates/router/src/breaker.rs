//! The circuit breaker: when the local engine is slow, memory-pressured or failing, eligible
//! requests go to the cloud upstream; half-open probes bring local service back.
//!
//! The policy is pure functions over plain data ([`trip_reason`], [`next_state`], [`p95`]),
//! tested by tables; [`Breaker`] holds the windows and the clock-free state and calls them.
//! Time is passed in as seconds since an arbitrary origin, so tests need no clock.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

/// Thresholds (`breaker` in the config file).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "camelCase")]
pub struct BreakerConfig {
    /// Open when the p95 of local TTFT over the window exceeds this, milliseconds.
    pub ttft_p95_ms: f64,
    /// TTFT samples in the sliding window.
    pub ttft_window: usize,
    /// Samples needed before the TTFT rule applies.
    pub ttft_min_samples: usize,
    /// Open when decode speed stays more than this fraction below its baseline ...
    pub decode_drop_fraction: f64,
    /// ... for longer than this, seconds.
    pub decode_drop_seconds: f64,
    /// Baseline decode speed, tokens/s; learned from the first measurements when absent.
    pub decode_baseline_tps: Option<f64>,
    /// Decode measurements used to learn the baseline (their median).
    pub decode_baseline_samples: usize,
    /// Memory pressure: MemAvailable below this, MB (10^6 bytes).
    #[serde(rename = "memAvailableMinMB")]
    pub mem_available_min_mb: f64,
    /// Memory pressure: PSI `some avg10` above this, percent.
    pub psi_some_avg10_max: f64,
    /// Open after this many consecutive engine errors.
    pub error_threshold: u32,
    /// Stay open at least this long before a half-open probe, seconds.
    pub open_seconds: f64,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig {
            ttft_p95_ms: 1500.0,
            ttft_window: 20,
            ttft_min_samples: 3,
            decode_drop_fraction: 0.30,
            decode_drop_seconds: 30.0,
            decode_baseline_tps: None,
            decode_baseline_samples: 3,
            mem_available_min_mb: 1024.0,
            psi_some_avg10_max: 25.0,
            error_threshold: 3,
            open_seconds: 10.0,
        }
    }
}

/// Why the breaker opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TripReason {
    /// TTFT p95 over the window above the threshold.
    Ttft,
    /// Decode speed below baseline for too long.
    DecodeSlow,
    /// Low MemAvailable or high PSI.
    MemoryPressure,
    /// Consecutive engine errors.
    EngineErrors,
    /// Opened by an operator (`/admin/breaker`).
    Manual,
}

impl TripReason {
    /// Label value.
    pub fn as_str(self) -> &'static str {
        match self {
            TripReason::Ttft => "ttft",
            TripReason::DecodeSlow => "decode_slow",
            TripReason::MemoryPressure => "memory_pressure",
            TripReason::EngineErrors => "engine_errors",
            TripReason::Manual => "manual",
        }
    }
}

/// What the policy looks at.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Signals {
    /// p95 of the TTFT window, ms (None: too few samples).
    pub ttft_p95_ms: Option<f64>,
    /// How long decode speed has been below the allowed fraction of baseline, seconds (0: not slow).
    pub decode_slow_for_s: f64,
    /// MemAvailable, bytes (None: unknown).
    pub mem_available_bytes: Option<u64>,
    /// PSI memory `some avg10`, percent (None: unknown).
    pub psi_some_avg10: Option<f64>,
    /// Consecutive engine errors.
    pub consecutive_errors: u32,
}

/// Whether memory is under pressure.
pub fn memory_pressured(cfg: &BreakerConfig, s: &Signals) -> bool {
    s.mem_available_bytes.is_some_and(|b| (b as f64) < cfg.mem_available_min_mb * 1e6)
        || s.psi_some_avg10.is_some_and(|p| p > cfg.psi_some_avg10_max)
}

/// The first rule that says "open", in order: engine errors, memory, TTFT, decode speed.
pub fn trip_reason(cfg: &BreakerConfig, s: &Signals) -> Option<TripReason> {
    if cfg.error_threshold > 0 && s.consecutive_errors >= cfg.error_threshold {
        return Some(TripReason::EngineErrors);
    }
    if memory_pressured(cfg, s) {
        return Some(TripReason::MemoryPressure);
    }
    if s.ttft_p95_ms.is_some_and(|p| p > cfg.ttft_p95_ms) {
        return Some(TripReason::Ttft);
    }
    if s.decode_slow_for_s > cfg.decode_drop_seconds {
        return Some(TripReason::DecodeSlow);
    }
    None
}

/// Breaker state.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum BreakerState {
    /// Local serves eligible traffic.
    Closed,
    /// Eligible traffic goes upstream.
    Open {
        /// When it opened, seconds.
        since_s: f64,
        /// Why.
        reason: TripReason,
    },
    /// One local probe decides between Closed and Open.
    HalfOpen {
        /// A probe request is running.
        probe_inflight: bool,
    },
}

impl BreakerState {
    /// Gauge value: 0 closed, 1 half-open, 2 open.
    pub fn gauge(&self) -> f64 {
        match self {
            BreakerState::Closed => 0.0,
            BreakerState::HalfOpen { .. } => 1.0,
            BreakerState::Open { .. } => 2.0,
        }
    }

    /// `closed`, `half_open` or `open`.
    pub fn name(&self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::HalfOpen { .. } => "half_open",
            BreakerState::Open { .. } => "open",
        }
    }
}

/// Events the breaker reacts to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BreakerEvent {
    /// Time passed / signals changed.
    Tick,
    /// A half-open probe was admitted.
    ProbeStarted,
    /// A half-open probe finished: `ok` when it succeeded within the TTFT threshold.
    ProbeFinished {
        /// Success.
        ok: bool,
    },
}

/// The state transition function.
pub fn next_state(cfg: &BreakerConfig, state: BreakerState, s: &Signals, ev: BreakerEvent, now_s: f64) -> BreakerState {
    use BreakerState::*;
    match (state, ev) {
        (Closed, BreakerEvent::Tick) => match trip_reason(cfg, s) {
            Some(reason) => Open { since_s: now_s, reason },
            None => Closed,
        },
        (Open { since_s, reason }, BreakerEvent::Tick) => {
            // Memory pressure holds the breaker open however long it lasts; a manual open waits
            // for an operator.
            if reason == TripReason::Manual || memory_pressured(cfg, s) || now_s - since_s < cfg.open_seconds {
                let reason = if memory_pressured(cfg, s) { TripReason::MemoryPressure } else { reason };
                Open { since_s, reason }
            } else {
                HalfOpen { probe_inflight: false }
            }
        }
        (HalfOpen { .. }, BreakerEvent::Tick) if memory_pressured(cfg, s) => {
            Open { since_s: now_s, reason: TripReason::MemoryPressure }
        }
        (HalfOpen { probe_inflight: false }, BreakerEvent::ProbeStarted) => HalfOpen { probe_inflight: true },
        (HalfOpen { .. }, BreakerEvent::ProbeFinished { ok: true }) => Closed,
        (HalfOpen { .. }, BreakerEvent::ProbeFinished { ok: false }) => {
            Open { since_s: now_s, reason: trip_reason(cfg, s).unwrap_or(TripReason::Ttft) }
        }
        (st, _) => st,
    }
}

/// The 95th percentile (nearest rank) of `xs`; None when empty.
pub fn p95(xs: &[f64]) -> Option<f64> {
    if xs.is_empty() {
        return None;
    }
    let mut v = xs.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let rank = ((0.95 * v.len() as f64).ceil() as usize).clamp(1, v.len());
    Some(v[rank - 1])
}

/// Where the breaker sends an eligible (not pinned) request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Serve locally.
    Local,
    /// Serve locally as the half-open probe; report the result with [`Breaker::probe_finished`].
    Probe,
    /// Send upstream.
    Cloud,
}

/// The breaker with its windows.
#[derive(Debug, Clone)]
pub struct Breaker {
    /// Thresholds.
    pub cfg: BreakerConfig,
    state: BreakerState,
    ttft_ms: VecDeque<f64>,
    baseline_samples: Vec<f64>,
    slow_since_s: Option<f64>,
    last_slow_check_s: f64,
    mem_available_bytes: Option<u64>,
    psi_some_avg10: Option<f64>,
    consecutive_errors: u32,
    /// Trips so far.
    pub trips: u64,
}

impl Breaker {
    /// A closed breaker.
    pub fn new(cfg: BreakerConfig) -> Self {
        Breaker {
            cfg,
            state: BreakerState::Closed,
            ttft_ms: VecDeque::new(),
            baseline_samples: Vec::new(),
            slow_since_s: None,
            last_slow_check_s: 0.0,
            mem_available_bytes: None,
            psi_some_avg10: None,
            consecutive_errors: 0,
            trips: 0,
        }
    }

    /// The state.
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// The decode baseline in use, tokens/s.
    pub fn decode_baseline_tps(&self) -> Option<f64> {
        self.cfg.decode_baseline_tps.or_else(|| {
            if self.baseline_samples.len() >= self.cfg.decode_baseline_samples.max(1) {
                let mut v = self.baseline_samples.clone();
                v.sort_by(|a, b| a.total_cmp(b));
                Some(v[v.len() / 2])
            } else {
                None
            }
        })
    }

    /// Current signals at `now_s`.
    pub fn signals(&self, now_s: f64) -> Signals {
        let window: Vec<f64> = self.ttft_ms.iter().copied().collect();
        Signals {
            ttft_p95_ms: if window.len() >= self.cfg.ttft_min_samples.max(1) { p95(&window) } else { None },
            decode_slow_for_s: self.slow_since_s.map(|t| (now_s - t).max(0.0)).unwrap_or(0.0),
            mem_available_bytes: self.mem_available_bytes,
            psi_some_avg10: self.psi_some_avg10,
            consecutive_errors: self.consecutive_errors,
        }
    }

    fn step(&mut self, ev: BreakerEvent, now_s: f64) -> Option<(BreakerState, BreakerState)> {
        let prev = self.state;
        let next = next_state(&self.cfg, prev, &self.signals(now_s), ev, now_s);
        self.state = next;
        if matches!(next, BreakerState::Open { .. }) && !matches!(prev, BreakerState::Open { .. }) {
            self.trips += 1;
        }
        if next == BreakerState::Closed && prev != BreakerState::Closed {
            // Fresh start: old slow samples must not re-trip at once.
            self.ttft_ms.clear();
            self.slow_since_s = None;
            self.consecutive_errors = 0;
        }
        (prev.name() != next.name()).then_some((prev, next))
    }

    /// Re-evaluates the policy; returns `(from, to)` when the state changed.
    pub fn tick(&mut self, now_s: f64) -> Option<(BreakerState, BreakerState)> {
        self.step(BreakerEvent::Tick, now_s)
    }

    /// A memory sample from the monitor.
    pub fn record_memory(&mut self, available_bytes: Option<u64>, psi_some_avg10: Option<f64>) {
        self.mem_available_bytes = available_bytes;
        self.psi_some_avg10 = psi_some_avg10;
    }

    /// A finished local generation: TTFT, decode speed (None: too few tokens to measure).
    pub fn record_local(&mut self, ttft_ms: f64, decode_tps: Option<f64>, now_s: f64) {
        self.consecutive_errors = 0;
        self.ttft_ms.push_back(ttft_ms);
        while self.ttft_ms.len() > self.cfg.ttft_window.max(1) {
            self.ttft_ms.pop_front();
        }
        if let Some(tps) = decode_tps.filter(|x| x.is_finite() && *x > 0.0) {
            match self.decode_baseline_tps() {
                None => self.baseline_samples.push(tps),
                Some(base) => {
                    if tps < base * (1.0 - self.cfg.decode_drop_fraction) {
                        self.slow_since_s.get_or_insert(now_s);
                    } else {
                        self.slow_since_s = None;
                    }
                }
            }
            self.last_slow_check_s = now_s;
        }
    }

    /// A local engine error.
    pub fn record_error(&mut self) {
        self.consecutive_errors += 1;
    }

    /// Opens the breaker by hand (stays open until [`Breaker::reset`]).
    pub fn force_open(&mut self, now_s: f64) {
        if !matches!(self.state, BreakerState::Open { .. }) {
            self.trips += 1;
        }
        self.state = BreakerState::Open { since_s: now_s, reason: TripReason::Manual };
    }

    /// Closes the breaker and clears the windows (the learned baseline is kept).
    pub fn reset(&mut self) {
        self.state = BreakerState::Closed;
        self.ttft_ms.clear();
        self.slow_since_s = None;
        self.consecutive_errors = 0;
    }

    /// Where an eligible request would go now (advances Open → HalfOpen as time allows).
    pub fn admit(&mut self, now_s: f64) -> Admission {
        self.tick(now_s);
        match self.state {
            BreakerState::Closed => Admission::Local,
            BreakerState::Open { .. } => Admission::Cloud,
            BreakerState::HalfOpen { probe_inflight: true } => Admission::Cloud,
            BreakerState::HalfOpen { probe_inflight: false } => Admission::Probe,
        }
    }

    /// The request admitted as [`Admission::Probe`] is being served locally: later requests
    /// go upstream until [`Breaker::probe_finished`].
    pub fn begin_probe(&mut self, now_s: f64) {
        self.step(BreakerEvent::ProbeStarted, now_s);
    }

    /// The probe admitted by [`Breaker::admit`] finished.
    pub fn probe_finished(&mut self, ok: bool, now_s: f64) -> Option<(BreakerState, BreakerState)> {
        self.step(BreakerEvent::ProbeFinished { ok }, now_s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BreakerConfig {
        BreakerConfig { decode_baseline_tps: Some(100.0), ..BreakerConfig::default() }
    }

    #[test]
    fn p95_nearest_rank() {
        assert_eq!(p95(&[]), None);
        assert_eq!(p95(&[5.0]), Some(5.0));
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(p95(&v), Some(19.0));
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(p95(&v), Some(95.0));
    }

    #[test]
    fn trip_table() {
        let c = cfg();
        let base = Signals::default();
        let cases: Vec<(&str, Signals, Option<TripReason>)> = vec![
            ("nothing", base, None),
            ("ttft at threshold", Signals { ttft_p95_ms: Some(1500.0), ..base }, None),
            ("ttft above", Signals { ttft_p95_ms: Some(1500.1), ..base }, Some(TripReason::Ttft)),
            ("slow 30 s", Signals { decode_slow_for_s: 30.0, ..base }, None),
            ("slow 31 s", Signals { decode_slow_for_s: 31.0, ..base }, Some(TripReason::DecodeSlow)),
            ("low mem", Signals { mem_available_bytes: Some(500_000_000), ..base }, Some(TripReason::MemoryPressure)),
            ("ok mem", Signals { mem_available_bytes: Some(8_000_000_000), ..base }, None),
            ("psi", Signals { psi_some_avg10: Some(40.0), ..base }, Some(TripReason::MemoryPressure)),
            ("2 errors", Signals { consecutive_errors: 2, ..base }, None),
            ("3 errors", Signals { consecutive_errors: 3, ..base }, Some(TripReason::EngineErrors)),
            (
                "errors win",
                Signals { consecutive_errors: 3, ttft_p95_ms: Some(9e9), psi_some_avg10: Some(99.0), ..base },
                Some(TripReason::EngineErrors),
            ),
        ];
        for (name, s, want) in cases {
            assert_eq!(trip_reason(&c, &s), want, "{name}");
        }
    }

    #[test]
    fn transition_table() {
        use BreakerEvent as E;
        use BreakerState as S;
        let c = cfg();
        let calm = Signals::default();
        let slow = Signals { ttft_p95_ms: Some(2000.0), ..calm };
        let mem = Signals { mem_available_bytes: Some(1), ..calm };
        let open = S::Open { since_s: 100.0, reason: TripReason::Ttft };
        let cases = [
            ("closed stays", S::Closed, calm, E::Tick, 0.0, S::Closed),
            ("closed trips", S::Closed, slow, E::Tick, 5.0, S::Open { since_s: 5.0, reason: TripReason::Ttft }),
            ("open waits", open, calm, E::Tick, 105.0, open),
            ("open to half", open, calm, E::Tick, 110.0, S::HalfOpen { probe_inflight: false }),
            (
                "memory holds open",
                open,
                mem,
                E::Tick,
                500.0,
                S::Open { since_s: 100.0, reason: TripReason::MemoryPressure },
            ),
            (
                "half probe",
                S::HalfOpen { probe_inflight: false },
                calm,
                E::ProbeStarted,
                0.0,
                S::HalfOpen { probe_inflight: true },
            ),
            ("probe ok", S::HalfOpen { probe_inflight: true }, calm, E::ProbeFinished { ok: true }, 1.0, S::Closed),
            (
                "probe bad",
                S::HalfOpen { probe_inflight: true },
                calm,
                E::ProbeFinished { ok: false },
                7.0,
                S::Open { since_s: 7.0, reason: TripReason::Ttft },
            ),
            (
                "half under memory",
                S::HalfOpen { probe_inflight: true },
                mem,
                E::Tick,
                9.0,
                S::Open { since_s: 9.0, reason: TripReason::MemoryPressure },
            ),
            ("closed ignores probe", S::Closed, calm, E::ProbeFinished { ok: false }, 0.0, S::Closed),
        ];
        for (name, st, s, ev, now, want) in cases {
            assert_eq!(next_state(&c, st, &s, ev, now), want, "{name}");
        }
    }

    #[test]
    fn breaker_ttft_cycle() {
        let mut b = Breaker::new(BreakerConfig { ttft_p95_ms: 100.0, open_seconds: 5.0, ..cfg() });
        for i in 0..3 {
            assert_eq!(b.admit(i as f64), Admission::Local);
            b.record_local(500.0, None, i as f64);
        }
        assert_eq!(b.admit(3.0), Admission::Cloud);
        assert!(matches!(b.state(), BreakerState::Open { reason: TripReason::Ttft, .. }));
        assert_eq!(b.admit(7.0), Admission::Cloud);
        assert_eq!(b.admit(8.5), Admission::Probe);
        assert_eq!(b.admit(8.5), Admission::Probe, "admit alone does not take the probe slot");
        b.begin_probe(8.5);
        assert_eq!(b.admit(8.6), Admission::Cloud, "one probe at a time");
        b.record_local(10.0, None, 9.0);
        b.probe_finished(true, 9.0);
        assert_eq!(b.state(), BreakerState::Closed);
        assert_eq!(b.admit(9.1), Admission::Local, "window cleared on close");
        assert_eq!(b.trips, 1);
    }

    #[test]
    fn breaker_decode_drop_needs_duration() {
        let mut b = Breaker::new(BreakerConfig { decode_baseline_tps: None, ..cfg() });
        for t in 0..3 {
            b.record_local(10.0, Some(100.0), t as f64);
        }
        assert_eq!(b.decode_baseline_tps(), Some(100.0));
        b.record_local(10.0, Some(60.0), 10.0); // 40% below: slow since 10 s
        assert_eq!(b.admit(20.0), Admission::Local);
        b.record_local(10.0, Some(65.0), 35.0);
        assert_eq!(b.admit(40.5), Admission::Cloud);
        assert!(matches!(b.state(), BreakerState::Open { reason: TripReason::DecodeSlow, .. }));
        // A recovery resets the slow clock.
        let mut b = Breaker::new(cfg());
        b.record_local(10.0, Some(50.0), 0.0);
        b.record_local(10.0, Some(90.0), 20.0);
        assert_eq!(b.admit(60.0), Admission::Local);
    }

    #[test]
    fn breaker_errors_and_memory() {
        let mut b = Breaker::new(BreakerConfig { error_threshold: 2, ..cfg() });
        b.record_error();
        assert_eq!(b.admit(0.0), Admission::Local);
        b.record_error();
        assert_eq!(b.admit(0.1), Admission::Cloud);
        let mut b = Breaker::new(cfg());
        b.record_memory(Some(100_000_000), None);
        assert_eq!(b.admit(0.0), Admission::Cloud);
        assert_eq!(b.admit(100.0), Admission::Cloud, "still pressured");
        b.record_memory(Some(10_000_000_000), Some(0.0));
        assert_eq!(b.admit(100.1), Admission::Probe);
    }
}
