//! The CUDA backend as the engine's [`engine::Accelerator`]: `calla run --device cuda` and
//! `calla serve --device cuda` generate through it.
//!
//! One [`CudaSession`] (GDN state, KV cache, token history, the captured step graphs) and one
//! [`Prefiller`] serve every request in turn: a request's prompt goes through the batched
//! prefill, then each decode step is one replay of the step graph, which samples on the device
//! and appends the token to the device history; the host reads back only that token (4 bytes)
//! to stream it and to test it against the stop ids.
//!
//! The prefix cache lives on the device: snapshots of the session's state
//! ([`SessionSnapshot`]) after each prompt and after each finished generation; a prompt that
//! extends a snapshot's tokens continues from it and prefills only the rest.

use engine::{Accelerator, EngineError};
use model::Model;
use sampler::SamplingParams;
use spec::production as p;

use crate::decode::{CudaModel, CudaSession};
use crate::prefill::{Prefiller, SessionSnapshot};
use crate::{CudaContext, CudaError};

/// The model on one GPU, with one sequence at a time.
pub struct CudaAccelerator {
    cx: CudaContext,
    m: CudaModel,
    sess: CudaSession,
    pf: Prefiller,
    device: String,
    /// Context limit of the engine, tokens.
    max_ctx: usize,
    /// Whether a sequence is running (`step` is valid).
    running: bool,
    /// The tokens the session's state holds: the prompt, then each token fed back by `step`.
    fed: Vec<u32>,
    /// The token returned last (not yet fed).
    last: u32,
    /// The prefix cache: snapshots of the state, most recent first.
    snapshots: Vec<SessionSnapshot>,
    /// Device bytes the snapshots may take together: half the memory free once the model,
    /// the session and the prefill buffers are in place.
    cache_budget: usize,
}

impl CudaAccelerator {
    /// Opens CUDA device `ordinal`, uploads `model`'s weights (the decode layout and the
    /// prefill layout of the experts), and allocates one sequence of `max_ctx` tokens and
    /// prefill chunks of `min(prefill_chunk, max_ctx)` tokens (their buffers take about 260 kB
    /// per token of chunk: 2.1 GB at 8,192). The step graphs run with
    /// programmatic dependent launch (the measured default of `calla cuda-bench --pdl`).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for a device other than compute capability 9.0, a compact
    /// vocabulary ([`spec::VOCAB_MAP_FILE`]: the kernels take the published vocabulary), or a layer
    /// whose projections the kernels do not take; NVRTC and driver errors (out of memory).
    pub fn new(ordinal: usize, model: &Model, max_ctx: usize, vocab_limit: usize, prefill_chunk: usize) -> Result<Self, CudaError> {
        if model.vocab_map.is_some() {
            return Err(CudaError::Unsupported(format!(
                "the model has a compact vocabulary ({}); the CUDA backend runs the published vocabulary only",
                spec::VOCAB_MAP_FILE
            )));
        }
        if max_ctx < 2 {
            return Err(CudaError::Unsupported(format!("a context limit of {max_ctx} tokens leaves no room to generate")));
        }
        let cx = CudaContext::new(ordinal)?;
        let device = cx.raw().name().unwrap_or_else(|_| format!("device {ordinal}"));
        // rows past the real tokenizer's ids are padding: never picked (MODEL.md §3.3)
        let vocab_limit = vocab_limit.min(p::VOCAB_REAL).min(model.cfg.vocab_size);
        let m = CudaModel::upload(&cx, &model.cfg, &model.weights, vocab_limit)?;
        // one slot more than the engine's limit: the session keeps the last slot of its token
        // history for the token sampled after the final position
        let mut sess = CudaSession::new(&cx, &m, max_ctx + 1)?;
        sess.set_pdl(true);
        let pf = Prefiller::new(&cx, &m, &model.weights, prefill_chunk.clamp(1, max_ctx))?;
        cx.synchronize()?;
        cx.raw().bind_to_thread()?;
        let (free, _total) = cudarc::driver::result::mem_get_info()?;
        Ok(CudaAccelerator {
            cx,
            m,
            sess,
            pf,
            device,
            max_ctx,
            running: false,
            fed: Vec::new(),
            last: 0,
            snapshots: Vec::new(),
            cache_budget: free / 2,
        })
    }

    /// The device sampler for `params`: `None` (the greedy `argmax_step`) when they ask for
    /// the plain argmax, which is what the device sampler would pick too.
    fn sampler_for(params: &SamplingParams) -> Option<&SamplingParams> {
        let plain_greedy = params.is_greedy()
            && params.presence_penalty == 0.0
            && params.frequency_penalty == 0.0
            && params.repetition_penalty == 1.0;
        (!plain_greedy).then_some(params)
    }

    /// Index into `snapshots` of the longest one `prompt` extends by at least one token, or
    /// equals when it kept its logits.
    fn lookup(&self, prompt: &[u32]) -> Option<usize> {
        self.snapshots
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                let n = s.tokens().len();
                (n < prompt.len() || (n == prompt.len() && s.has_logits())) && prompt.starts_with(s.tokens())
            })
            .max_by_key(|(_, s)| s.tokens().len())
            .map(|(i, _)| i)
    }

    /// Puts `snap` first in the cache (replacing one of the same tokens), keeping `keep` at
    /// most and the device bytes within the budget (the oldest go first).
    fn keep_snapshot(&mut self, snap: SessionSnapshot, keep: usize) {
        self.snapshots.retain(|s| s.tokens() != snap.tokens());
        self.snapshots.truncate(keep.saturating_sub(1));
        while !self.snapshots.is_empty() && self.cache_bytes() + snap.bytes() > self.cache_budget {
            self.snapshots.pop();
        }
        if snap.bytes() <= self.cache_budget {
            self.snapshots.insert(0, snap);
        }
    }

    /// Whether a snapshot after `n` tokens is worth keeping: it fits the budget, and a later
    /// prompt can still extend it within the context.
    fn worth_keeping(&self, n: usize) -> bool {
        n + 1 < self.max_ctx && self.sess.snapshot_bytes(n) <= self.cache_budget
    }

    /// Device bytes the prefix cache holds.
    pub fn cache_bytes(&self) -> usize {
        self.snapshots.iter().map(SessionSnapshot::bytes).sum()
    }

    /// Waits for the queued work and reads the token the last step appended.
    fn last_token(&self) -> Result<u32, CudaError> {
        let pos = self.sess.pos();
        let v = self.cx.stream().clone_dtoh(&self.sess.ids.slice(pos..pos + 1))?;
        Ok(v[0] as u32)
    }
}

/// A device failure: the engine's fault, never the request's (the request's own faults are
/// caught by [`Accelerator::check_sampling`] and the engine's checks before any device work).
fn device_err(e: CudaError) -> EngineError {
    EngineError::Accelerator(e.to_string())
}

/// The device sampler's refusal of a request's parameters: the request's fault (HTTP 400).
fn sampling_err(e: CudaError) -> EngineError {
    match e {
        CudaError::Unsupported(msg) => EngineError::Unsupported(msg),
        e => EngineError::Accelerator(e.to_string()),
    }
}

impl Accelerator for CudaAccelerator {
    fn describe(&self) -> String {
        format!("cuda · {}", self.device)
    }

    fn take_expert_counts(&mut self) -> Option<Vec<Vec<u64>>> {
        // telemetry only: a device error here shows up in the next start or step
        self.sess.take_expert_counts(&self.cx).ok()
    }

    fn check_sampling(&self, params: &SamplingParams) -> Result<(), EngineError> {
        crate::sample::check_params(params, self.m.vocab_limit).map(|_| ()).map_err(sampling_err)
    }

    fn reusable(&self, prompt: &[u32]) -> usize {
        self.lookup(prompt).map_or(0, |i| self.snapshots[i].tokens().len())
    }

    fn start(&mut self, prompt: &[u32], params: &SamplingParams, keep: usize) -> Result<(u32, usize), EngineError> {
        self.running = false;
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() >= self.max_ctx {
            return Err(EngineError::PromptTooLong { prompt_tokens: prompt.len(), limit: self.max_ctx });
        }
        if keep == 0 {
            self.snapshots.clear();
        }
        self.sess.set_sampling(&self.cx, &self.m, Self::sampler_for(params)).map_err(sampling_err)?;
        let mut hit = self.lookup(prompt);
        let cached = hit.map_or(0, |i| self.snapshots[i].tokens().len());
        let exact = cached == prompt.len();
        if let (true, Some(i)) = (exact, hit) {
            // the same prompt again: its snapshot moves to the front instead of being copied
            let s = self.snapshots.remove(i);
            self.snapshots.insert(0, s);
            hit = Some(0);
        }
        let keep_prompt = keep > 0 && !exact && self.worth_keeping(prompt.len());
        // The device errors below leave the session to the next start, which resets it.
        let snap = hit.map(|i| &self.snapshots[i]);
        let kept = self.sess.start_batched_from(&self.cx, &self.m, &mut self.pf, snap, prompt, keep_prompt).map_err(device_err)?;
        self.fed.clear();
        self.fed.extend_from_slice(prompt);
        if let Some(k) = kept {
            self.keep_snapshot(k, keep);
        }
        let id = self.last_token().map_err(device_err)?;
        self.last = id;
        self.running = true;
        Ok((id, cached))
    }

    fn finish(&mut self, keep: usize) {
        self.running = false;
        // (nothing fed back, i.e. stopped at the first token: the snapshot after the prompt is it)
        if keep > 0
            && !self.fed.is_empty()
            && self.worth_keeping(self.fed.len())
            && !self.snapshots.iter().any(|s| s.tokens() == self.fed.as_slice())
        {
            match self.sess.snapshot(&self.cx, &self.fed) {
                Ok(snap) => self.keep_snapshot(snap, keep),
                // out of device memory: the generation stands, the cache gives its memory back
                Err(_) => self.snapshots.clear(),
            }
        }
    }

    fn step(&mut self) -> Result<u32, EngineError> {
        if !self.running {
            return Err(EngineError::Accelerator("decode step before a sequence was started".into()));
        }
        let n = self.sess.decode(&self.m, 1).map_err(|e| {
            self.running = false;
            device_err(e)
        })?;
        if n == 0 {
            self.running = false;
            return Err(EngineError::Accelerator(format!("the context of {} tokens is full", self.max_ctx)));
        }
        self.fed.push(self.last);
        let id = self.last_token().map_err(|e| {
            self.running = false;
            device_err(e)
        })?;
        self.last = id;
        Ok(id)
    }
}
