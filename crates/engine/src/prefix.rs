//! Prefix reuse across requests, and the observed generation loop the server runs.
//!
//! Gated DeltaNet state cannot be truncated (the recurrent state after token t mixes every
//! token before it), so the cache keeps whole-state snapshots at request boundaries: the state
//! after a prompt, and the state after that prompt plus the tokens generated for it. A new
//! prompt that starts with exactly the tokens of a snapshot continues from a clone of it and
//! prefills only the rest; those reused tokens are OpenAI's `cached_tokens`.

use std::time::{Duration, Instant};

use model::{Logits, State};
use sampler::Sampler;

use crate::{Accelerator, Engine, EngineError, FinishReason, GenerateParams, GenerationStats};

/// One snapshot: the state after `tokens`, and the (unprocessed) logits that followed them.
struct Entry {
    tokens: Vec<u32>,
    state: State,
    // [vocab]: logits predicting the token after `tokens`.
    logits: Vec<f32>,
}

/// Snapshots of sequence state at request boundaries (most recent first).
pub struct PrefixCache {
    entries: Vec<Entry>,
    capacity: usize,
    /// Lookups that reused a snapshot.
    pub hits: u64,
    /// Lookups that did not.
    pub misses: u64,
}

impl PrefixCache {
    /// A cache holding at most `capacity` snapshots (0 disables it).
    pub fn new(capacity: usize) -> Self {
        PrefixCache { entries: Vec::new(), capacity, hits: 0, misses: 0 }
    }

    /// Snapshots held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no snapshot is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes of sequence state held (logits excluded).
    pub fn state_bytes(&self) -> usize {
        self.entries.iter().map(|e| e.state.bytes()).sum()
    }

    /// Drops every snapshot.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// The longest snapshot whose tokens are a prefix of `prompt`.
    fn lookup(&self, prompt: &[u32]) -> Option<&Entry> {
        self.entries
            .iter()
            .filter(|e| e.tokens.len() <= prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|e| e.tokens.len())
    }

    fn insert(&mut self, tokens: Vec<u32>, state: State, logits: Vec<f32>) {
        if self.capacity == 0 {
            return;
        }
        self.entries.retain(|e| e.tokens != tokens);
        self.entries.insert(0, Entry { tokens, state, logits });
        self.entries.truncate(self.capacity);
    }
}

/// Watches (and may slow down or fail) a generation: the engine thread's hooks for state
/// transitions, expert-routing counts and fault injection. Every method has a no-op default.
pub trait Observer {
    /// Prefill of `new_tokens` (after `cached_tokens` reused ones) is about to run.
    fn prefill_start(&mut self, _cached_tokens: usize, _new_tokens: usize) -> Result<(), EngineError> {
        Ok(())
    }
    /// The first token was sampled; decode steps follow.
    fn decode_start(&mut self) {}
    /// A decode step is about to run.
    fn before_step(&mut self) -> Result<(), EngineError> {
        Ok(())
    }
    /// Whether [`Observer::experts`] wants the router's choices (forward passes are traced then).
    fn wants_experts(&self) -> bool {
        false
    }
    /// MoE layer `layer` chose experts `ids` (top-k per token, flattened).
    fn experts(&mut self, _layer: usize, _ids: &[f32]) {}
    /// MoE layer `layer` routed `counts[e]` token slots to expert `e` (an accelerator reports
    /// its counts once per generation, [`crate::Accelerator::take_expert_counts`], instead of
    /// the choices per token).
    fn expert_counts(&mut self, _layer: usize, _counts: &[u64]) {}
}

/// The observer that watches nothing.
pub struct NoObserver;
impl Observer for NoObserver {}

/// What [`Engine::generate_cached`] did.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    /// Timings and counts.
    pub stats: GenerationStats,
    /// Prompt tokens reused from the prefix cache (not prefilled).
    pub cached_tokens: usize,
}

impl Engine {
    fn forward_observed(
        &self,
        state: &mut State,
        tokens: &[u32],
        obs: &mut dyn Observer,
    ) -> Result<Vec<f32>, EngineError> {
        if !obs.wants_experts() {
            return Ok(self.model.forward(state, tokens, Logits::Last)?);
        }
        let mut tr = |name: &str, x: &[f32]| {
            // blk.{l}.moe.topk_idx
            if let Some(rest) = name.strip_prefix("blk.") {
                if let Some(l) = rest.strip_suffix(".moe.topk_idx") {
                    if let Ok(l) = l.parse::<usize>() {
                        obs.experts(l, x);
                    }
                }
            }
        };
        Ok(self.model.forward_traced(state, tokens, Logits::Last, Some(&mut tr))?)
    }

    /// The state after `prompt` and the logits that follow it, reusing the longest snapshot in
    /// `cache` that `prompt` starts with. Returns the reused token count too. The result is the
    /// same (to f32 round-off of the chunked prefill) as a fresh prefill of `prompt`.
    ///
    /// # Errors
    /// As [`Engine::generate`].
    pub fn prefill_cached(
        &self,
        cache: &mut PrefixCache,
        prompt: &[u32],
        obs: &mut dyn Observer,
    ) -> Result<(State, Vec<f32>, usize), EngineError> {
        self.check_prompt(prompt)?;
        let hit = cache.lookup(prompt).map(|e| (e.tokens.len(), e.state.clone(), e.logits.clone()));
        let (state, logits, cached) = match hit {
            Some((n, state, logits)) if n == prompt.len() => {
                obs.prefill_start(n, 0)?;
                (state, logits, n)
            }
            Some((n, mut state, _)) => {
                obs.prefill_start(n, prompt.len() - n)?;
                let logits = self.forward_observed(&mut state, &prompt[n..], obs)?;
                (state, logits, n)
            }
            None => {
                obs.prefill_start(0, prompt.len())?;
                let mut state = self.new_state();
                let logits = self.forward_observed(&mut state, prompt, obs)?;
                (state, logits, 0)
            }
        };
        if cached > 0 {
            cache.hits += 1;
        } else {
            cache.misses += 1;
        }
        if cache.capacity > 0 {
            cache.insert(prompt.to_vec(), state.clone(), logits.clone());
        }
        Ok((state, logits, cached))
    }

    /// [`Engine::generate`] with prefix reuse and an [`Observer`]. After the run, `cache` holds
    /// the state after the prompt and after prompt + generated tokens, for the next request.
    /// With an accelerator ([`Engine::set_accelerator`]) the generation runs there, with the
    /// accelerator's own snapshots on the device; `cache` gives their number and counts hits.
    ///
    /// # Errors
    /// As [`Engine::generate`], plus whatever the observer injects.
    pub fn generate_cached(
        &self,
        cache: &mut PrefixCache,
        prompt: &[u32],
        params: &GenerateParams,
        obs: &mut dyn Observer,
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<RunOutcome, EngineError> {
        if let Some((acc, _)) = &self.accel {
            let mut acc = acc.lock().unwrap_or_else(|e| e.into_inner());
            return self.generate_accel(&mut **acc, cache, prompt, params, obs, on_token);
        }
        let mut sampler = Sampler::new(params.sampling.clone())?;
        let limit = self.vocab_limit();
        let t0 = Instant::now();
        let (mut state, mut logits, cached_tokens) = self.prefill_cached(cache, prompt, obs)?;
        // Tokens fed to the model after the prompt, and the pristine logits after the last one.
        let mut fed: Vec<u32> = Vec::new();
        let mut last_logits: Option<Vec<f32>> = None;
        let first = sampler.sample(&mut logits, limit);
        let stats = self.run_loop(t0, prompt.len(), params, obs, on_token, first, &mut |obs, id| {
            sampler.accept(id);
            logits = self.forward_observed(&mut state, &[id], obs)?;
            fed.push(id);
            if cache.capacity > 0 {
                last_logits = Some(logits.clone());
            }
            Ok(sampler.sample(&mut logits, limit))
        })?;
        if let Some(l) = last_logits {
            let mut toks = prompt.to_vec();
            toks.extend_from_slice(&fed);
            cache.insert(toks, state, l);
        }
        Ok(RunOutcome { stats, cached_tokens })
    }

    /// [`Engine::generate_cached`] on an accelerator: the same checks, observer calls and loop.
    fn generate_accel(
        &self,
        acc: &mut dyn Accelerator,
        cache: &mut PrefixCache,
        prompt: &[u32],
        params: &GenerateParams,
        obs: &mut dyn Observer,
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<RunOutcome, EngineError> {
        params.sampling.validate()?;
        acc.check_sampling(&params.sampling)?;
        self.check_prompt(prompt)?;
        let vocab = self.model.cfg.vocab_size;
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(EngineError::Unsupported(format!("token id {id} is outside the vocabulary of {vocab}")));
        }
        let t0 = Instant::now();
        let keep = cache.capacity;
        let reuse = if keep > 0 { acc.reusable(prompt) } else { 0 };
        obs.prefill_start(reuse, prompt.len() - reuse)?;
        let (first, cached_tokens) = acc.start(prompt, &params.sampling, keep)?;
        if cached_tokens > 0 {
            cache.hits += 1;
        } else {
            cache.misses += 1;
        }
        let stats = self.run_loop(t0, prompt.len(), params, obs, on_token, first, &mut |_, _| acc.step());
        if obs.wants_experts() {
            if let Some(counts) = acc.take_expert_counts() {
                for (layer, row) in counts.iter().enumerate() {
                    obs.expert_counts(layer, row);
                }
            }
        }
        let stats = stats?;
        if keep > 0 {
            acc.finish(keep);
        }
        Ok(RunOutcome { stats, cached_tokens })
    }

    /// The generation loop both paths share: `first` is the token sampled after the prompt,
    /// `step(obs, id)` feeds `id` and returns the next sampled token. Stops at a stop id (not
    /// reported), at `max_tokens`, when `on_token` returns `false`, or when the context is full.
    #[allow(clippy::too_many_arguments)]
    fn run_loop(
        &self,
        t0: Instant,
        prompt_len: usize,
        params: &GenerateParams,
        obs: &mut dyn Observer,
        mut on_token: impl FnMut(u32) -> bool,
        first: u32,
        step: &mut dyn FnMut(&mut dyn Observer, u32) -> Result<u32, EngineError>,
    ) -> Result<GenerationStats, EngineError> {
        let mut stats = GenerationStats {
            prompt_tokens: prompt_len,
            generated_tokens: 0,
            ttft: t0.elapsed(),
            decode_time: Duration::ZERO,
            finish: FinishReason::Length,
        };
        if params.max_tokens == 0 {
            // nothing to generate: no first token, no decode phase
            stats.ttft = Duration::ZERO;
            return Ok(stats);
        }
        let t_first = Instant::now();
        obs.decode_start();
        let mut id = first;
        while stats.generated_tokens < params.max_tokens {
            if params.stop_on_eos && self.stop_ids.contains(&id) {
                stats.finish = FinishReason::Stop;
                break;
            }
            stats.generated_tokens += 1;
            if !on_token(id) {
                stats.finish = FinishReason::Cancelled;
                break;
            }
            // feeding the token just generated needs position prompt_len + generated - 1 < max_ctx
            if stats.generated_tokens == params.max_tokens || prompt_len + stats.generated_tokens > self.max_ctx {
                break;
            }
            obs.before_step()?;
            id = step(obs, id)?;
        }
        stats.decode_time = t_first.elapsed();
        Ok(stats)
    }
}
