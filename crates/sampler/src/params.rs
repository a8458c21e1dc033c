//! [`SamplingParams`]: the per-request sampling settings, and their validation.

use serde::{Deserialize, Serialize};

/// Why a [`SamplingParams`] was rejected.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplerError {
    /// A field of [`SamplingParams`] lies outside its allowed range.
    ///
    /// `field` is the Rust (and serde) name of the field, e.g. `"top_p"`.
    #[error("invalid sampling parameter `{field}` = {value}: must be {expected}")]
    InvalidParam {
        /// Name of the offending field.
        field: &'static str,
        /// The value given, as text.
        value: String,
        /// The allowed range, in words.
        expected: &'static str,
    },
}

impl SamplerError {
    /// Name of the [`SamplingParams`] field that was rejected.
    pub fn field(&self) -> &'static str {
        match self {
            SamplerError::InvalidParam { field, .. } => field,
        }
    }
}

/// Sampling settings of one request.
///
/// Each filter has an "off" value, and [`Default`] turns everything off except
/// the temperature, which is 1.0 (plain sampling from the model's softmax).
/// Use [`SamplingParams::greedy`] for argmax decoding.
///
/// With serde, missing fields take their [`Default`] values
/// (`#[serde(default)]`), so `{"temperature": 0.7}` is a complete request.
///
/// The order in which the fields are applied is documented on
/// [`Sampler::sample`](crate::Sampler::sample) and at the crate root.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature: logits are divided by it before the softmax
    /// (transformers' `TemperatureLogitsWarper`). `0.0` means greedy decoding
    /// (argmax after the penalties). Must be finite and `>= 0`.
    pub temperature: f32,
    /// Keep only the `top_k` highest logits (Fan et al. 2018, "Hierarchical
    /// Neural Story Generation"; transformers' `TopKLogitsWarper`). Tokens tied
    /// with the k-th highest logit are kept too, as in transformers and vLLM.
    /// `0` turns it off, as does any value `>=` the vocabulary.
    pub top_k: usize,
    /// Nucleus sampling (Holtzman et al. 2019, "The Curious Case of Neural Text
    /// Degeneration"; transformers' `TopPLogitsWarper`): keep the smallest set
    /// of most likely tokens whose probability mass is `>= top_p` (always at
    /// least one token). Must lie in `(0, 1]`; `1.0` turns it off.
    pub top_p: f32,
    /// Min-p sampling (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling
    /// for Creative and Coherent LLM Outputs"; transformers' `MinPLogitsWarper`):
    /// drop tokens whose probability is below `min_p` times the probability of
    /// the most likely token. Must lie in `[0, 1]`; `0.0` turns it off.
    pub min_p: f32,
    /// OpenAI presence penalty: subtracted once from the logit of every distinct
    /// token generated so far. Must lie in `[-2, 2]` (OpenAI's range); `0.0` is off.
    pub presence_penalty: f32,
    /// OpenAI frequency penalty: `count * frequency_penalty` is subtracted from the
    /// logit of a token generated `count` times so far. Must lie in `[-2, 2]`;
    /// `0.0` is off.
    pub frequency_penalty: f32,
    /// CTRL repetition penalty (Keskar et al. 2019, "CTRL: A Conditional
    /// Transformer Language Model for Controllable Generation", §4.1;
    /// transformers' `RepetitionPenaltyLogitsProcessor`): the logit of every
    /// token generated so far is divided by it when positive and multiplied by
    /// it otherwise. Must be finite and `> 0`; `1.0` is off.
    pub repetition_penalty: f32,
    /// Seed of the ChaCha20 random stream. `None` draws a seed from the
    /// operating system's entropy (see [`Sampler::seed`](crate::Sampler::seed)
    /// to read it back).
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    /// Temperature 1.0, every filter and penalty off, seed from OS entropy.
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
        }
    }
}

/// Inclusive bound of OpenAI's presence and frequency penalties.
const OPENAI_PENALTY_LIMIT: f32 = 2.0;

fn invalid(field: &'static str, value: impl ToString, expected: &'static str) -> SamplerError {
    SamplerError::InvalidParam {
        field,
        value: value.to_string(),
        expected,
    }
}

impl SamplingParams {
    /// Greedy decoding: temperature 0 (argmax), no filters, no penalties.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// True when [`Sampler::sample`](crate::Sampler::sample) takes the argmax,
    /// i.e. when `temperature == 0`. Penalties still apply before the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Checks every field's range; the error names the first bad field.
    ///
    /// Rules: `temperature` finite and `>= 0`; `top_p` in `(0, 1]`; `min_p` in
    /// `[0, 1]`; `presence_penalty` and `frequency_penalty` in `[-2, 2]` (OpenAI);
    /// `repetition_penalty` finite and `> 0` (transformers rejects `<= 0` too).
    /// NaN fails every rule. `top_k` and `seed` accept any value.
    ///
    /// # Errors
    /// [`SamplerError::InvalidParam`] naming the field.
    pub fn validate(&self) -> Result<(), SamplerError> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(invalid(
                "temperature",
                t,
                "a finite number >= 0 (0 means greedy)",
            ));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(invalid("top_p", p, "in (0, 1] (1 turns it off)"));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return Err(invalid("min_p", m, "in [0, 1] (0 turns it off)"));
        }
        let lim = -OPENAI_PENALTY_LIMIT..=OPENAI_PENALTY_LIMIT;
        if !lim.contains(&self.presence_penalty) {
            return Err(invalid(
                "presence_penalty",
                self.presence_penalty,
                "in [-2, 2] (0 turns it off)",
            ));
        }
        if !lim.contains(&self.frequency_penalty) {
            return Err(invalid(
                "frequency_penalty",
                self.frequency_penalty,
                "in [-2, 2] (0 turns it off)",
            ));
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(invalid(
                "repetition_penalty",
                r,
                "a finite number > 0 (1 turns it off)",
            ));
        }
        Ok(())
    }
}
