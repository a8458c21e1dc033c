//! Logits processors and samplers for calla (Qwen3.6-35B-A3B).
//!
//! One [`Sampler`] per generation stream turns a row of logits (`&mut [f32]`,
//! 248,320 entries for Qwen3.6, of which ids `>= 248,077` are padding) into the
//! next token id:
//!
//! ```
//! use sampler::{Sampler, SamplingParams};
//!
//! let params = SamplingParams { temperature: 0.7, top_k: 20, top_p: 0.95, seed: Some(1), ..Default::default() };
//! let mut s = Sampler::new(params)?;
//! let mut logits = vec![0.0f32; 8];
//! logits[3] = 5.0;
//! let token = s.sample(&mut logits, 6); // ids 6 and 7 are never chosen
//! s.accept(token); // the penalties see generated tokens only
//! # Ok::<(), sampler::SamplerError>(())
//! ```
//!
//! # Order of processing
//! 1. mask ids `>= vocab_limit` to `-inf`;
//! 2. repetition penalty (CTRL, Keskar et al. 2019; transformers'
//!    `RepetitionPenaltyLogitsProcessor`);
//! 3. presence and frequency penalties (OpenAI's definition);
//! 4. greedy (`temperature == 0`): [`argmax`];
//! 5. temperature;
//! 6. top-k;
//! 7. top-p (nucleus, Holtzman et al. 2019);
//! 8. min-p (Nguyen et al. 2024), relative to the top probability;
//! 9. draw from the renormalised survivors with ChaCha20 seeded from
//!    [`SamplingParams::seed`].
//!
//! Steps 5–8 follow transformers' warper order (`TemperatureLogitsWarper`,
//! `TopKLogitsWarper`, `TopPLogitsWarper`, `MinPLogitsWarper`, as appended by
//! `GenerationMixin._get_logits_processor`). Differences from transformers and
//! vLLM, the exact boundary rules, the handling of NaN / `inf` and the cost are
//! documented on [`Sampler::sample`].
//!
//! # Reproducibility
//! The same seed and the same logits give the same token sequence on every
//! platform: the seed is expanded to a ChaCha20 key with SplitMix64, one
//! 64-bit output is used per sampled token, and the softmax uses a portable
//! exponential (no libm) with sums in a fixed order.

mod math;
mod params;
mod sampler;

pub use math::{argmax, expand_seed, splitmix64};
pub use params::{SamplerError, SamplingParams};
pub use sampler::Sampler;
