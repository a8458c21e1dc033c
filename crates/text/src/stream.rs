use crate::Tokenizer;

/// Incremental detokeniser for generated ids.
///
/// Feed ids one at a time with [`StreamDecoder::push`]; each call returns only text made of
/// complete UTF-8 characters, so a character split across tokens (emoji, rare CJK, the
/// byte pieces of `ĠÑĤÐ²ÑĬÑĢ`, ...) is held back until its last byte arrives.
/// [`StreamDecoder::finish`] flushes what is left.
///
/// The concatenation of every `push` output and the final `finish` output equals
/// [`Tokenizer::decode`] of the same ids with the same `skip_special` (lossy UTF-8: each
/// maximal invalid byte sequence becomes one U+FFFD, exactly as `String::from_utf8_lossy`
/// does on the whole byte string).
///
/// Ids the tokenizer does not know (≥ [`Tokenizer::vocab_size`]) produce nothing, as in
/// `tokenizers`' own decoding; callers that need to reject them should check the id first.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tok: &'a Tokenizer,
    skip_special: bool,
    /// Bytes not yet emitted: always a (possibly empty) prefix of one UTF-8 character.
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder with nothing pending. With `skip_special`, special added tokens
    /// (`<|im_end|>`, ...) produce no text.
    pub fn new(tok: &'a Tokenizer, skip_special: bool) -> Self {
        StreamDecoder {
            tok,
            skip_special,
            pending: Vec::new(),
        }
    }

    /// Adds one id; returns the newly completed text (possibly empty). Never returns part of
    /// a character. An invalid byte sequence that can no longer become valid is emitted as
    /// U+FFFD as soon as that is certain.
    pub fn push(&mut self, id: u32) -> String {
        if self.skip_special && self.tok.is_special(id) {
            return String::new();
        }
        let Some(bytes) = self.tok.id_to_bytes(id) else {
            return String::new();
        };
        self.pending.extend_from_slice(&bytes);
        self.drain_complete()
    }

    /// Flushes the pending bytes (an incomplete character at the end becomes U+FFFD) and
    /// resets the decoder.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Emits everything except a trailing incomplete-but-still-possible character.
    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // Safe: from_utf8 validated these bytes.
                    out.push_str(std::str::from_utf8(&rest[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // Invalid sequence: it can never complete, replace it now
                        // (same maximal-subpart rule as from_utf8_lossy).
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &rest[valid + n..];
                        }
                        // Incomplete character at the end: keep it for the next push.
                        None => {
                            rest = &rest[valid..];
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
        out
    }
}
