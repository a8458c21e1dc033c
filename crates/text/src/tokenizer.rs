use std::collections::{HashMap, HashSet};
use std::path::Path;

use tokenizers::DecoderWrapper;

use crate::TextError;

/// Name of the tokenizer file inside a model snapshot folder.
const TOKENIZER_FILE: &str = "tokenizer.json";

/// A byte-level BPE tokenizer loaded from a Hugging Face `tokenizer.json`
/// (for Qwen3.6: NFC normaliser, Qwen3.5 split regex, ByteLevel, 248,044 BPE tokens +
/// 33 added tokens).
///
/// Cheap to share: all methods take `&self` and the type is `Send + Sync`, so one instance
/// can serve many threads.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Inverse of the GPT-2 byte→char table used by the ByteLevel pre-tokenizer/decoder.
    char_to_byte: HashMap<char, u8>,
    /// Ids of added tokens flagged `special: true` (dropped by `decode(.., true)`).
    special_ids: HashSet<u32>,
    vocab_size: usize,
    /// A compact vocabulary (`calla_vocab.json`): when set, every id this type takes or
    /// returns is a model row, mapped to and from the tokenizer's ids.
    map: Option<spec::VocabMap>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size)
            .field("special_ids", &self.special_ids.len())
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json` file.
    ///
    /// Errors: [`TextError::Io`] when the file cannot be read; [`TextError::Tokenizer`] when it
    /// is not a valid `tokenizers` file or its decoder is not `ByteLevel` (every byte-level
    /// function of this type — [`Tokenizer::id_to_bytes`], [`crate::StreamDecoder`] — relies
    /// on the ByteLevel byte mapping, as in all Qwen tokenizers).
    pub fn from_file(path: &Path) -> Result<Self, TextError> {
        let bytes = std::fs::read(path).map_err(|e| TextError::io(path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| TextError::Tokenizer(format!("{}: {e}", path.display())))?;
        Self::from_tokenizer(inner)
            .map_err(|e| TextError::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// Loads `tokenizer.json` from a model snapshot folder.
    ///
    /// Returns `Ok(None)` when the folder has no `tokenizer.json`. Errors: [`TextError::Io`]
    /// when `dir` is not a readable folder, otherwise as [`Tokenizer::from_file`].
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, TextError> {
        check_dir(dir)?;
        let path = dir.join(TOKENIZER_FILE);
        if !path.exists() {
            return Ok(None);
        }
        let mut t = Self::from_file(&path)?;
        t.map = spec::VocabMap::from_dir(dir).map_err(|e| TextError::Tokenizer(e.to_string()))?;
        Ok(Some(t))
    }

    /// The compact vocabulary, when the snapshot has one (ids are then model rows).
    pub fn vocab_map(&self) -> Option<&spec::VocabMap> {
        self.map.as_ref()
    }

    /// Model id (row) → tokenizer id; `None` for rows that stand for no token.
    fn raw(&self, id: u32) -> Option<u32> {
        match &self.map {
            None => Some(id),
            Some(m) => m.id(id),
        }
    }

    fn from_tokenizer(inner: tokenizers::Tokenizer) -> Result<Self, String> {
        match inner.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => {}
            other => {
                return Err(format!(
                    "the decoder must be ByteLevel (byte-level BPE, as in Qwen), found {}",
                    match other {
                        None => "none".to_string(),
                        Some(d) => serde_json::to_value(d)
                            .ok()
                            .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(String::from))
                            .unwrap_or_else(|| "another decoder".to_string()),
                    }
                ))
            }
        }
        let special_ids = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, tok)| tok.special)
            .map(|(id, _)| id)
            .collect();
        let char_to_byte = byte_level_chars()
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let vocab_size = inner.get_vocab_size(true);
        Ok(Tokenizer {
            inner,
            char_to_byte,
            special_ids,
            vocab_size,
            map: None,
        })
    }

    /// Encodes `text` into token ids.
    ///
    /// The text is NFC-normalised (by the `tokenizer.json` normaliser); no special tokens are
    /// added (`add_special_tokens = false`), but added tokens that occur literally in the text
    /// (`<|im_start|>`, `<think>`, ...) are matched and produce their single id.
    /// Errors: [`TextError::Tokenizer`] if the `tokenizers` pipeline fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| TextError::Tokenizer(e.to_string()))?;
        Ok(match &self.map {
            None => enc.get_ids().to_vec(),
            Some(m) => enc.get_ids().iter().map(|&id| m.row(id)).collect(),
        })
    }

    /// Decodes ids into text, like `tokenizers`' `decode`: the token bytes are concatenated and
    /// converted with lossy UTF-8 (an invalid byte sequence becomes U+FFFD). With
    /// `skip_special`, added tokens flagged special (`<|im_start|>`, `<|im_end|>`,
    /// `<|endoftext|>`, ...) are dropped; `<think>`, `</think>`, `<tool_call>`, ... are not
    /// special in Qwen3.6 and are kept.
    ///
    /// Errors: [`TextError::Tokenizer`] naming the first id the tokenizer does not know
    /// (id ≥ [`Tokenizer::vocab_size`], e.g. an embedding padding row).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        if let Some((pos, id)) = ids
            .iter()
            .enumerate()
            .find(|(_, &id)| self.raw(id).and_then(|r| self.inner.id_to_token(r)).is_none())
        {
            return Err(TextError::Tokenizer(format!(
                "unknown token id {id} at position {pos} (the tokenizer knows {} ids)",
                self.vocab_size()
            )));
        }
        let raw: Vec<u32> = ids.iter().map(|&id| self.raw(id).expect("checked above")).collect();
        self.inner
            .decode(&raw, skip_special)
            .map_err(|e| TextError::Tokenizer(e.to_string()))
    }

    /// Id of a token given in its vocabulary spelling (byte-level form, e.g. `"Ġthe"` for
    /// `" the"`), or of an added token given by its content (e.g. `"<|im_end|>"`).
    /// `None` when the vocabulary has no such entry.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        let id = self.inner.token_to_id(token)?;
        match &self.map {
            None => Some(id),
            Some(m) => m.row_of(id),
        }
    }

    /// Raw bytes of one token: the ByteLevel character mapping undone, exactly as the
    /// decoder does it, so concatenating the bytes of a sequence and decoding them as UTF-8
    /// equals [`Tokenizer::decode`] without `skip_special`. Added tokens give their content's
    /// UTF-8 bytes. A single token's bytes may be an incomplete UTF-8 character.
    /// `None` for an unknown id.
    pub fn id_to_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let token = self.inner.id_to_token(self.raw(id)?)?;
        // Same rule as tokenizers' ByteLevel decoder: map every char back to its byte; a
        // token containing a char outside the table (an added token such as `<think>` never
        // does, being ASCII) is taken as its own UTF-8 bytes.
        let mapped: Option<Vec<u8>> = token
            .chars()
            .map(|c| self.char_to_byte.get(&c).copied())
            .collect();
        Some(mapped.unwrap_or_else(|| token.into_bytes()))
    }

    /// Number of ids the tokenizer knows, added tokens included (248,077 for Qwen3.6; the
    /// model's 248,320 logit rows beyond that are padding that the tokenizer cannot decode).
    pub fn vocab_size(&self) -> usize {
        match &self.map {
            None => self.vocab_size,
            Some(m) => m.rows(),
        }
    }

    /// Whether `id` is an added token flagged `special` (dropped by `skip_special` decoding).
    pub fn is_special(&self, id: u32) -> bool {
        self.raw(id).is_some_and(|r| self.special_ids.contains(&r))
    }
}

/// Errors unless `dir` is an existing folder.
pub(crate) fn check_dir(dir: &Path) -> Result<(), TextError> {
    let meta = std::fs::metadata(dir).map_err(|e| TextError::io(dir, e))?;
    if !meta.is_dir() {
        return Err(TextError::io(
            dir,
            std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
        ));
    }
    Ok(())
}

/// GPT-2's byte → printable-char table (`bytes_to_unicode` in openai/gpt-2 `encoder.py`),
/// the mapping the ByteLevel pre-tokenizer applies and the decoder undoes.
fn byte_level_chars() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let cp = if printable {
            u32::from(b)
        } else {
            let cp = next;
            next += 1;
            cp
        };
        // cp < 256 + 256, always a valid scalar value.
        table[usize::from(b)] = char::from_u32(cp).unwrap_or(char::REPLACEMENT_CHARACTER);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::byte_level_chars;

    #[test]
    fn byte_table_matches_gpt2() {
        let t = byte_level_chars();
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[0], 'Ā');
        assert_eq!(t[b'A' as usize], 'A');
        assert_eq!(t[0xA0], 'ł');
        assert_eq!(t[0xAD], 'Ń');
        let set: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(set.len(), 256);
    }
}
