//! The generation loop: prompt → prefill → sample → decode steps → stop, streaming text.
//!
//! An [`Engine`] owns one loaded model with its tokenizer, chat template and generation
//! defaults. It is used from one thread; the server puts it behind a queue.

pub mod prefix;
pub mod worker;

use std::path::{Path, PathBuf};
use std::time::Duration;

use model::{Model, ModelError, State};
use sampler::SamplingParams;
use spec::GenerationConfig;
use text::{ChatRequest, ChatTemplate, StreamDecoder, TextError, Tokenizer};

pub use prefix::{Observer, PrefixCache, RunOutcome};

/// Why a generation could not run.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// Loading or running the model failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Tokenizer, template or request error.
    #[error(transparent)]
    Text(#[from] TextError),
    /// Invalid sampling parameters.
    #[error(transparent)]
    Sampler(#[from] sampler::SamplerError),
    /// The prompt has no tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// The prompt does not fit the context limit.
    #[error("prompt of {prompt_tokens} tokens does not fit the context limit of {limit} tokens")]
    PromptTooLong {
        /// Prompt length.
        prompt_tokens: usize,
        /// The limit.
        limit: usize,
    },
    /// The snapshot has no tokenizer.json, but text was given.
    #[error("{0} has no tokenizer.json: use the id-based commands (`generate --ids`, `logits --ids`) or add the tokenizer files")]
    NoTokenizer(PathBuf),
    /// The snapshot has no chat template, but a chat was given.
    #[error("{0} has no chat template (chat_template.jinja or tokenizer_config.json `chat_template`)")]
    NoTemplate(PathBuf),
    /// A fault injected through [`worker::Faults`] (tests and drills).
    #[error("injected engine fault: {0}")]
    Injected(String),
    /// The request asks for something the accelerator cannot do (e.g. a `top_k` beyond what
    /// its device sampler takes): the request's fault, not the engine's.
    #[error("{0}")]
    Unsupported(String),
    /// The accelerator failed (driver error, out of device memory).
    #[error("accelerator error: {0}")]
    Accelerator(String),
}

impl EngineError {
    /// Whether the request itself is at fault (HTTP 400) rather than the engine (HTTP 500).
    pub fn is_client_error(&self) -> bool {
        matches!(
            self,
            EngineError::PromptTooLong { .. } | EngineError::EmptyPrompt | EngineError::Sampler(_) | EngineError::Unsupported(_)
        )
    }
}

/// A device that runs whole sequences with its own sampler, so that a decode step's token
/// never has to come back to the host before the next step is queued (the CUDA backend;
/// Apple Metal later). [`Engine::set_accelerator`] routes every generation through it; the
/// engine keeps the tokenizer, the template, the stop ids and the loop.
///
/// One sequence at a time: [`Accelerator::start`] begins a new one (dropping the old),
/// [`Accelerator::step`] continues it. Sampling must follow [`sampler::Sampler`]'s arithmetic
/// and random stream, so that a seed means the same on every backend.
pub trait Accelerator: Send {
    /// One line for logs: the backend and the device, e.g. `cuda · NVIDIA H200`.
    fn describe(&self) -> String;
    /// Checks `params` before any work is done (called after [`SamplingParams::validate`]).
    ///
    /// # Errors
    /// [`EngineError::Unsupported`] naming the parameter the device sampler cannot take.
    fn check_sampling(&self, params: &SamplingParams) -> Result<(), EngineError>;
    /// Prompt tokens [`Accelerator::start`] would reuse from its prefix cache: the longest
    /// kept snapshot whose tokens `prompt` extends by at least one token, or equals when the
    /// snapshot kept the logits that followed them (0: none).
    fn reusable(&self, prompt: &[u32]) -> usize;
    /// Starts a sequence: prefills `prompt` (`1 <= len < max_ctx` of the engine, ids below
    /// the vocabulary: the engine checks), continuing from the snapshot
    /// [`Accelerator::reusable`] names, and samples the first token with `params`. With
    /// `keep > 0` it keeps a snapshot of the state after the prompt, and at most `keep`
    /// snapshots in all (the oldest go first); with 0 it neither reuses nor keeps any.
    /// Returns the first token and the prompt tokens reused.
    ///
    /// # Errors
    /// [`EngineError::Accelerator`] on device errors; [`EngineError::Unsupported`] for
    /// parameters [`Accelerator::check_sampling`] would refuse.
    fn start(&mut self, prompt: &[u32], params: &SamplingParams, keep: usize) -> Result<(u32, usize), EngineError>;
    /// The sequence is over: with `keep > 0`, keeps a snapshot of the state after the prompt
    /// and every token fed back by [`Accelerator::step`] (the next turn of a chat starts with
    /// them), at most `keep` in all. Best effort: a snapshot that does not fit the device is
    /// not kept, and the generation it follows stands.
    fn finish(&mut self, keep: usize);
    /// Runs one decode step on the token returned last and returns the next one. The engine
    /// calls it only while the context has room (prompt plus generated tokens `<= max_ctx`).
    ///
    /// # Errors
    /// [`EngineError::Accelerator`] on device errors, or when no sequence was started.
    fn step(&mut self) -> Result<u32, EngineError>;
    /// Per MoE layer and expert, the token slots routed to it on the device (each token once
    /// for each of its top-k experts: prompt tokens prefilled and tokens fed back) since the
    /// last call, which resets them; `None` (the default) when the device keeps no counts.
    /// Expert-load telemetry: the engine passes them to [`Observer::expert_counts`] after each
    /// generation.
    fn take_expert_counts(&mut self) -> Option<Vec<Vec<u64>>> {
        None
    }
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token was sampled (it is not part of the output).
    Stop,
    /// `max_tokens` reached, or the context limit.
    Length,
    /// The caller asked to stop.
    Cancelled,
}

impl FinishReason {
    /// OpenAI's `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        }
    }
}

/// What one generation did, with timings.
#[derive(Debug, Clone)]
pub struct GenerationStats {
    /// Prompt tokens prefilled.
    pub prompt_tokens: usize,
    /// Tokens generated (the stop token excluded).
    pub generated_tokens: usize,
    /// Time to first token: prefill plus the first sample.
    pub ttft: Duration,
    /// Time spent in decode steps after the first token.
    pub decode_time: Duration,
    /// Why it stopped.
    pub finish: FinishReason,
}

impl GenerationStats {
    /// Decode speed in tokens per second over the tokens after the first (0 when fewer than 2).
    pub fn decode_tokens_per_s(&self) -> f64 {
        let n = self.generated_tokens.saturating_sub(1);
        if n == 0 || self.decode_time.is_zero() {
            0.0
        } else {
            n as f64 / self.decode_time.as_secs_f64()
        }
    }

    /// Prefill speed in tokens per second (prompt tokens over TTFT).
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.ttft.as_secs_f64().max(1e-9)
    }

    /// One line for people: `prompt N tokens · TTFT x ms · decode y tok/s · M tokens (finish)`.
    pub fn summary(&self) -> String {
        format!(
            "prompt {} tokens · TTFT {:.1} ms · decode {:.1} tok/s · {} tokens ({})",
            self.prompt_tokens,
            self.ttft.as_secs_f64() * 1e3,
            self.decode_tokens_per_s(),
            self.generated_tokens,
            self.finish.as_str()
        )
    }
}

/// Per-request generation settings.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Whether to stop on the model's end-of-turn / end-of-text ids.
    pub stop_on_eos: bool,
}

/// A loaded model with everything needed to generate text.
pub struct Engine {
    /// The model.
    pub model: Model,
    /// The tokenizer, when the snapshot has one.
    pub tokenizer: Option<Tokenizer>,
    /// The chat template, when the snapshot has one.
    pub template: Option<ChatTemplate>,
    /// `generation_config.json` (defaults when absent).
    pub generation: GenerationConfig,
    /// Ids that end a generation.
    pub stop_ids: Vec<u32>,
    /// Context limit in tokens for a sequence.
    pub max_ctx: usize,
    dir: PathBuf,
    /// Runs the generations when set (see [`Engine::set_accelerator`]), with its description.
    accel: Option<(std::sync::Mutex<Box<dyn Accelerator>>, String)>,
}

impl Engine {
    /// Loads a snapshot folder: config, weights, tokenizer and template when present,
    /// generation config. `max_ctx` bounds the sequence length in tokens.
    ///
    /// # Errors
    /// [`EngineError`] naming the file, tensor or field at fault.
    pub fn open(dir: &Path, max_ctx: usize) -> Result<Self, EngineError> {
        let model = Model::open(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        let template = ChatTemplate::from_dir(dir)?;
        let generation = GenerationConfig::from_dir(dir).map_err(ModelError::from)?;
        let mut stop_ids: Vec<u32> = generation.eos_token_ids.iter().chain(&model.cfg.eos_token_ids).copied().collect();
        if let Some(tok) = &tokenizer {
            for s in ["<|im_end|>", "<|endoftext|>"] {
                stop_ids.extend(tok.token_to_id(s));
            }
        }
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let max_ctx = max_ctx.min(model.cfg.max_position_embeddings);
        Ok(Engine { model, tokenizer, template, generation, stop_ids, max_ctx, dir: dir.to_path_buf(), accel: None })
    }

    /// Runs every later generation on `acc` instead of the CPU model (which stays loaded: the
    /// accelerator is built from its weights). The prefix cache then lives on the device
    /// ([`Accelerator::start`]); the [`PrefixCache`] passed to [`Engine::generate_cached`]
    /// gives its capacity and counts its hits.
    pub fn set_accelerator(&mut self, acc: Box<dyn Accelerator>) {
        let name = acc.describe();
        self.accel = Some((std::sync::Mutex::new(acc), name));
    }

    /// The accelerator's [`Accelerator::describe`], or `cpu` when generations run on the CPU.
    pub fn backend_name(&self) -> String {
        match &self.accel {
            Some((_, name)) => name.clone(),
            None => format!("cpu · {:?}", self.model.backend),
        }
    }

    /// The snapshot folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tokenizer, or an error saying the snapshot has none.
    ///
    /// # Errors
    /// [`EngineError::NoTokenizer`].
    pub fn tokenizer(&self) -> Result<&Tokenizer, EngineError> {
        self.tokenizer.as_ref().ok_or_else(|| EngineError::NoTokenizer(self.dir.clone()))
    }

    /// Renders a chat request with the snapshot's template.
    ///
    /// # Errors
    /// [`EngineError::NoTemplate`] or the template's own error.
    pub fn render(&self, req: &ChatRequest) -> Result<String, EngineError> {
        let t = self.template.as_ref().ok_or_else(|| EngineError::NoTemplate(self.dir.clone()))?;
        Ok(t.render(req)?)
    }

    /// Ids the sampler may choose: the tokenizer's ids when known (padding rows of the LM head
    /// are never sampled), else every row.
    pub fn vocab_limit(&self) -> usize {
        match &self.tokenizer {
            Some(t) => t.vocab_size().min(self.model.cfg.vocab_size),
            None => self.model.cfg.vocab_size,
        }
    }

    /// Sampling settings from `generation_config.json` (greedy when `do_sample` is false),
    /// before any per-request override.
    pub fn default_sampling(&self) -> SamplingParams {
        sampling_defaults(&self.generation)
    }

    /// Checks that `prompt` has tokens and leaves room in the context limit.
    ///
    /// # Errors
    /// [`EngineError::EmptyPrompt`], [`EngineError::PromptTooLong`].
    pub fn check_prompt(&self, prompt: &[u32]) -> Result<(), EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        if prompt.len() >= self.max_ctx {
            return Err(EngineError::PromptTooLong { prompt_tokens: prompt.len(), limit: self.max_ctx });
        }
        Ok(())
    }

    /// A fresh sequence state sized to this engine's context limit.
    pub fn new_state(&self) -> State {
        self.model.new_state(self.max_ctx)
    }

    /// Generates from `prompt` ids. `on_token(id)` is called for each generated token as soon
    /// as it is sampled; returning `false` cancels. The stop token is not reported.
    ///
    /// # Errors
    /// [`EngineError::EmptyPrompt`], [`EngineError::PromptTooLong`], sampler or model errors.
    pub fn generate(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
        on_token: impl FnMut(u32) -> bool,
    ) -> Result<GenerationStats, EngineError> {
        self.check_prompt(prompt)?;
        // The same loop as the server's, without a prefix cache or observer.
        let mut no_cache = prefix::PrefixCache::new(0);
        Ok(self.generate_cached(&mut no_cache, prompt, params, &mut prefix::NoObserver, on_token)?.stats)
    }

    /// [`Engine::generate`] with streaming text: `on_text` receives complete UTF-8 pieces (never
    /// a broken character) and returns `false` to cancel. Special tokens are skipped in the text.
    ///
    /// # Errors
    /// As [`Engine::generate`], plus [`EngineError::NoTokenizer`].
    pub fn generate_text(
        &self,
        prompt: &[u32],
        params: &GenerateParams,
        mut on_text: impl FnMut(&str) -> bool,
    ) -> Result<(Vec<u32>, GenerationStats), EngineError> {
        let tok = self.tokenizer()?;
        let mut dec = StreamDecoder::new(tok, false);
        let mut ids = Vec::new();
        let stats = self.generate(prompt, params, |id| {
            ids.push(id);
            let piece = dec.push(id);
            piece.is_empty() || on_text(&piece)
        })?;
        let rest = dec.finish();
        if !rest.is_empty() {
            on_text(&rest);
        }
        Ok((ids, stats))
    }
}

/// Sampling settings from a `generation_config.json` (greedy when `do_sample` is false); what
/// [`Engine::default_sampling`] returns, usable before a model is loaded.
pub fn sampling_defaults(g: &GenerationConfig) -> SamplingParams {
    let mut p = SamplingParams::default();
    if let Some(t) = g.temperature {
        p.temperature = t;
    }
    if let Some(k) = g.top_k {
        p.top_k = k;
    }
    if let Some(x) = g.top_p {
        p.top_p = x;
    }
    if let Some(x) = g.min_p {
        p.min_p = x;
    }
    if let Some(x) = g.repetition_penalty {
        p.repetition_penalty = x;
    }
    if let Some(x) = g.presence_penalty {
        p.presence_penalty = x;
    }
    if g.do_sample == Some(false) {
        p.temperature = 0.0;
    }
    p
}
