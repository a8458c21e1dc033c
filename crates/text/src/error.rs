use std::path::PathBuf;

/// Every failure of the `text` crate.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file could not be read (or a snapshot folder is not a folder).
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file or folder that was being read.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A snapshot file was read but its content is unusable (malformed JSON, wrong field type).
    #[error("invalid {}: {reason}", path.display())]
    Config {
        /// The offending file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The `tokenizers` library failed (bad `tokenizer.json`, unknown id in `decode`, ...).
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to compile or render. For a template `raise_exception(msg)`
    /// the string is exactly `msg`.
    #[error("chat template: {0}")]
    Template(String),
    /// A chat request is malformed; `field` names the offending field as a JSON path
    /// (e.g. `messages`, `messages[2].tool_calls[0].function.arguments`).
    #[error("invalid request field `{field}`: {reason}")]
    Request {
        /// JSON path of the offending field.
        field: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl TextError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TextError::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn request(field: impl Into<String>, reason: impl Into<String>) -> Self {
        TextError::Request {
            field: field.into(),
            reason: reason.into(),
        }
    }
}
