//! The engine thread: one thread owns the model, its caches and its state; requests reach it
//! through a bounded queue, each carrying its reply sink and a cancel flag.
//!
//! [`Faults`] lets tests and drills slow the engine down or make it fail through the same code
//! path a slow or broken kernel would take (see docs/SERVER.md, "Fault injection").

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::prefix::{Observer, PrefixCache};
use crate::{Engine, EngineError, GenerateParams, GenerationStats};

/// What the engine thread is doing (reported through [`WorkerConfig::on_phase`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    /// Mapping weights, allocating state.
    Loading,
    /// Waiting for work.
    Idle,
    /// Prefilling a prompt.
    Prefill,
    /// Decoding.
    Decoding,
    /// Loading failed: the engine will not serve.
    Failed(String),
}

/// A message from the engine thread to one request.
#[derive(Debug, Clone)]
pub enum Event {
    /// The request left the queue and its prompt was prefilled.
    Started {
        /// Time spent in the queue and in prefill.
        queue_wait: Duration,
    },
    /// A generated token id.
    Token(u32),
    /// Generation ended.
    Done {
        /// Timings and counts.
        stats: GenerationStats,
        /// Prompt tokens reused from the prefix cache.
        cached_tokens: usize,
    },
    /// Generation failed.
    Error {
        /// The error, for the client.
        message: String,
        /// Whether the request itself was at fault (prompt too long, bad params) rather than the engine.
        client_error: bool,
    },
}

/// Receives the events of one request; returning `false` cancels it.
pub type Sink = Box<dyn FnMut(Event) -> bool + Send>;

/// One request for the engine thread.
pub struct Job {
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Generation settings.
    pub params: GenerateParams,
    /// Set by the requester to cancel (checked before prefill and after each token).
    pub cancel: Arc<AtomicBool>,
    /// Where events go.
    pub sink: Sink,
}

/// Injected faults: delays and failures on the engine thread's real code path.
#[derive(Debug, Default)]
pub struct Faults {
    /// Sleep before each prefill, milliseconds.
    pub prefill_delay_ms: AtomicU64,
    /// Sleep before each decode step, milliseconds.
    pub token_delay_ms: AtomicU64,
    /// Fail this many upcoming generations with an engine error.
    pub fail_next: AtomicU64,
    /// Fail every generation while set.
    pub fail_all: AtomicBool,
}

/// State shared between the engine thread and its handles.
pub struct Shared {
    /// Injected faults.
    pub faults: Faults,
    /// Jobs queued and not yet started.
    pub queued: AtomicUsize,
    /// Jobs started and not yet finished (0 or 1).
    pub running: AtomicUsize,
    /// Expert assignments, [n_layers][n_experts] (MoE layers only; empty until the model is loaded).
    pub expert_counts: Mutex<Vec<Vec<u64>>>,
    /// Prefix-cache hits and misses.
    pub cache_hits: AtomicU64,
    /// Prefix-cache misses.
    pub cache_misses: AtomicU64,
    /// Engine errors so far.
    pub errors: AtomicU64,
    /// The loaded model's vocabulary limit, once loaded (0 before).
    pub vocab_limit: AtomicUsize,
    /// Where generations run ([`Engine::backend_name`]), once loaded (`None` before).
    pub backend: Mutex<Option<String>>,
}

/// Settings of the engine thread.
pub struct WorkerConfig {
    /// Model snapshot folder.
    pub dir: PathBuf,
    /// Context limit in tokens.
    pub max_ctx: usize,
    /// Most jobs waiting in the queue (a full queue refuses new jobs).
    pub queue_depth: usize,
    /// Prefix-cache snapshots kept (0 disables reuse).
    pub prefix_cache: usize,
    /// Called on the engine thread at each phase change.
    pub on_phase: Arc<dyn Fn(Phase) + Send + Sync>,
    /// Builds the accelerator on the engine thread once the model is loaded (`None`: the CPU
    /// runs the generations). A failure fails the load like a missing tensor would.
    pub accelerator: Option<AcceleratorFactory>,
}

/// Builds an [`crate::Accelerator`] from the loaded engine (its model's weights and context
/// limit), on the engine thread; the error is reported as the load failure.
pub type AcceleratorFactory = Box<dyn FnOnce(&Engine) -> Result<Box<dyn crate::Accelerator>, String> + Send>;

/// Why a job was not queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// The queue is full.
    #[error("the engine queue is full ({0} requests waiting)")]
    QueueFull(usize),
    /// The engine thread has stopped (load failure).
    #[error("the local engine is not running")]
    Stopped,
}

/// Handle to the engine thread. Cloning shares the thread.
#[derive(Clone)]
pub struct Worker {
    tx: SyncSender<Job>,
    depth: usize,
    /// Shared counters and fault switches.
    pub shared: Arc<Shared>,
}

impl Worker {
    /// Starts the engine thread; it loads the model (phase `Loading`), then serves jobs in order.
    pub fn spawn(cfg: WorkerConfig) -> Worker {
        let (tx, rx) = sync_channel::<Job>(cfg.queue_depth);
        let shared = Arc::new(Shared {
            faults: Faults::default(),
            queued: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            expert_counts: Mutex::new(Vec::new()),
            cache_hits: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            vocab_limit: AtomicUsize::new(0),
            backend: Mutex::new(None),
        });
        let depth = cfg.queue_depth;
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("calla-engine".into())
            .spawn(move || run(cfg, rx, sh))
            .expect("cannot spawn the engine thread");
        Worker { tx, depth, shared }
    }

    /// Queues a job without blocking.
    ///
    /// # Errors
    /// [`SubmitError::QueueFull`] or [`SubmitError::Stopped`].
    pub fn submit(&self, job: Job) -> Result<(), SubmitError> {
        self.shared.queued.fetch_add(1, Ordering::SeqCst);
        match self.tx.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                match e {
                    TrySendError::Full(_) => Err(SubmitError::QueueFull(self.depth)),
                    TrySendError::Disconnected(_) => Err(SubmitError::Stopped),
                }
            }
        }
    }

    /// Jobs waiting in the queue.
    pub fn queue_len(&self) -> usize {
        self.shared.queued.load(Ordering::SeqCst)
    }

    /// The queue's capacity.
    pub fn queue_depth(&self) -> usize {
        self.depth
    }
}

/// The engine thread's observer: phase reports, expert counts, injected faults, cancellation.
struct Watch<'a> {
    shared: &'a Shared,
    on_phase: &'a (dyn Fn(Phase) + Send + Sync),
    cancel: &'a AtomicBool,
    counts: Vec<Vec<u64>>,
}

impl Observer for Watch<'_> {
    fn prefill_start(&mut self, _cached: usize, _new: usize) -> Result<(), EngineError> {
        (self.on_phase)(Phase::Prefill);
        let f = &self.shared.faults;
        let d = f.prefill_delay_ms.load(Ordering::Relaxed);
        if d > 0 {
            std::thread::sleep(Duration::from_millis(d));
        }
        if f.fail_all.load(Ordering::Relaxed)
            || f.fail_next.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
        {
            return Err(EngineError::Injected("prefill failed (fault injection)".into()));
        }
        Ok(())
    }
    fn decode_start(&mut self) {
        (self.on_phase)(Phase::Decoding);
    }
    fn before_step(&mut self) -> Result<(), EngineError> {
        let d = self.shared.faults.token_delay_ms.load(Ordering::Relaxed);
        if d > 0 && !self.cancel.load(Ordering::Relaxed) {
            std::thread::sleep(Duration::from_millis(d));
        }
        Ok(())
    }
    fn wants_experts(&self) -> bool {
        true
    }
    fn experts(&mut self, layer: usize, ids: &[f32]) {
        if let Some(row) = self.counts.get_mut(layer) {
            for &e in ids {
                if let Some(c) = row.get_mut(e as usize) {
                    *c += 1;
                }
            }
        }
    }
    fn expert_counts(&mut self, layer: usize, counts: &[u64]) {
        if let Some(row) = self.counts.get_mut(layer) {
            for (c, n) in row.iter_mut().zip(counts) {
                *c += n;
            }
        }
    }
}

fn run(cfg: WorkerConfig, rx: Receiver<Job>, shared: Arc<Shared>) {
    let on_phase = cfg.on_phase.clone();
    on_phase(Phase::Loading);
    let opened = Engine::open(&cfg.dir, cfg.max_ctx).map_err(|e| e.to_string()).and_then(|mut eng| {
        if let Some(make) = cfg.accelerator {
            let acc = make(&eng).map_err(|e| format!("cannot start the accelerator: {e}"))?;
            eng.set_accelerator(acc);
        }
        Ok(eng)
    });
    let eng = match opened {
        Ok(e) => e,
        Err(e) => {
            on_phase(Phase::Failed(e.to_string()));
            // Answer whatever was queued, then stop (dropping `rx` refuses new jobs).
            while let Ok(mut job) = rx.try_recv() {
                shared.queued.fetch_sub(1, Ordering::SeqCst);
                (job.sink)(Event::Error {
                    message: format!("the local engine failed to load: {e}"),
                    client_error: false,
                });
            }
            return;
        }
    };
    let (n_layers, n_experts) = (eng.model.cfg.layer_types.len(), eng.model.cfg.num_experts);
    *shared.expert_counts.lock().unwrap_or_else(|e| e.into_inner()) = vec![vec![0; n_experts]; n_layers];
    shared.vocab_limit.store(eng.vocab_limit(), Ordering::SeqCst);
    *shared.backend.lock().unwrap_or_else(|e| e.into_inner()) = Some(eng.backend_name());
    let mut cache = PrefixCache::new(cfg.prefix_cache);
    on_phase(Phase::Idle);
    while let Ok(mut job) = rx.recv() {
        shared.queued.fetch_sub(1, Ordering::SeqCst);
        if job.cancel.load(Ordering::SeqCst) {
            continue;
        }
        shared.running.store(1, Ordering::SeqCst);
        let enqueued = Instant::now();
        let mut watch = Watch {
            shared: &shared,
            on_phase: &*on_phase,
            cancel: &job.cancel,
            counts: vec![vec![0; n_experts]; n_layers],
        };
        let mut started = false;
        let cancel = job.cancel.clone();
        let sink = &mut job.sink;
        let result = eng.generate_cached(&mut cache, &job.prompt, &job.params, &mut watch, |id| {
            if !started {
                started = true;
                // Started marks the first token; the reused prefix length comes with Done.
                if !sink(Event::Started { queue_wait: enqueued.elapsed() }) {
                    return false;
                }
            }
            sink(Event::Token(id)) && !cancel.load(Ordering::SeqCst)
        });
        {
            let mut total = shared.expert_counts.lock().unwrap_or_else(|e| e.into_inner());
            for (t, w) in total.iter_mut().zip(&watch.counts) {
                for (a, b) in t.iter_mut().zip(w) {
                    *a += b;
                }
            }
        }
        shared.cache_hits.store(cache.hits, Ordering::Relaxed);
        shared.cache_misses.store(cache.misses, Ordering::Relaxed);
        // idle before the job's last event: a client that has its answer never sees the
        // engine still busy with it (/health polled right after a response)
        shared.running.store(0, Ordering::SeqCst);
        on_phase(Phase::Idle);
        match result {
            Ok(out) => {
                (job.sink)(Event::Done { stats: out.stats, cached_tokens: out.cached_tokens });
            }
            Err(e) => {
                let client_error = e.is_client_error();
                if !client_error {
                    shared.errors.fetch_add(1, Ordering::SeqCst);
                }
                (job.sink)(Event::Error { message: e.to_string(), client_error });
            }
        }
    }
}
