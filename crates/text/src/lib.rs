//! Text side of calla: token ids ⇄ text for Qwen3.6-35B-A3B, and chat requests → prompt string.
//!
//! * [`Tokenizer`] wraps a Hugging Face `tokenizers` byte-level BPE tokenizer (`tokenizer.json`).
//!   Encoding never adds special tokens (Qwen adds no BOS); added tokens written inside the
//!   text (e.g. `<|im_start|>`) are matched.
//! * [`StreamDecoder`] turns a stream of generated ids into text without ever emitting a
//!   broken UTF-8 character.
//! * [`ChatTemplate`] renders the model's Jinja chat template exactly as transformers'
//!   `apply_chat_template` does (Jinja2 `trim_blocks`/`lstrip_blocks`, `loopcontrols`,
//!   `raise_exception`, `strftime_now`, Python-style `tojson`, Python string methods).
//! * [`ChatRequest`] is the template input, buildable from an OpenAI chat-completions body.
//!
//! Nothing in this crate panics on user input; every failure is a [`TextError`].

#![warn(missing_docs)]

mod error;
mod pyjson;
mod request;
mod stream;
mod template;
mod tokenizer;

pub use error::TextError;
pub use request::ChatRequest;
pub use stream::StreamDecoder;
pub use template::ChatTemplate;
pub use tokenizer::Tokenizer;
