//! StreamDecoder: streamed text == decode, and no push ever emits part of a character.

mod common;

use common::{tokenizer, vectors};
use text::{StreamDecoder, Tokenizer};

/// Streams `ids`; returns the per-push outputs and the finish output.
fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> (Vec<String>, String) {
    let mut dec = StreamDecoder::new(tok, skip_special);
    let pushes = ids.iter().map(|&id| dec.push(id)).collect();
    (pushes, dec.finish())
}

#[test]
fn every_vector_streams_to_decoded() {
    let tok = tokenizer();
    let all = vectors();
    let mut held_back = 0;
    for v in &all {
        for (skip, want) in [(false, &v.decoded), (true, &v.decoded_skip_special)] {
            let (pushes, tail) = stream(tok, &v.ids, skip);
            let got: String = pushes.concat() + &tail;
            assert_eq!(&got, want, "{}:{} skip_special={skip}", v.file, v.name);
        }
        // Without skipping, the text emitted after token k is exactly the complete UTF-8
        // characters of the first k+1 tokens' bytes (from token_bytes_hex): nothing broken,
        // nothing withheld once complete.
        let (pushes, tail) = stream(tok, &v.ids, false);
        let mut bytes = Vec::new();
        let mut emitted = String::new();
        let mut withheld = false;
        for (k, out) in pushes.iter().enumerate() {
            bytes.extend_from_slice(&v.token_bytes[k]);
            emitted.push_str(out);
            let complete = match std::str::from_utf8(&bytes) {
                Ok(s) => s,
                Err(e) => {
                    assert!(
                        e.error_len().is_none(),
                        "{}: vector bytes are invalid UTF-8",
                        v.name
                    );
                    std::str::from_utf8(&bytes[..e.valid_up_to()]).unwrap()
                }
            };
            assert_eq!(emitted, complete, "{}:{} after token {k}", v.file, v.name);
            assert!(
                !out.contains('\u{FFFD}') || v.decoded.contains('\u{FFFD}'),
                "{}: U+FFFD emitted",
                v.name
            );
            if emitted.len() < bytes.len() {
                withheld = true;
                held_back += 1;
            }
        }
        assert_eq!(
            tail, "",
            "{}: complete text leaves nothing to flush",
            v.name
        );
        if v.has_partial_utf8_tokens {
            assert!(withheld, "{}: a partial token must be held back", v.name);
        }
    }
    assert!(held_back > 0);
}

#[test]
fn emoji_split_across_tokens() {
    let tok = tokenizer();
    let v = vectors()
        .into_iter()
        .find(|v| v.text == "🦙" || v.text.contains('🦙'))
        .expect("a llama vector");
    let (pushes, tail) = stream(tok, &v.ids, false);
    assert!(v.ids.len() > 1 && pushes.iter().any(|p| p.is_empty()));
    assert_eq!(pushes.concat() + &tail, v.decoded);
}

/// xorshift64*: deterministic pseudo-random numbers for the fuzz tests.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Id of the token whose bytes are exactly `[b]`.
fn byte_ids(tok: &Tokenizer) -> Vec<u32> {
    let mut ids = vec![u32::MAX; 256];
    for id in 0..tok.vocab_size() as u32 {
        if let Some(b) = tok.id_to_bytes(id) {
            if b.len() == 1 && ids[b[0] as usize] == u32::MAX {
                ids[b[0] as usize] = id;
            }
        }
    }
    assert!(ids.iter().all(|&i| i != u32::MAX));
    ids
}

#[test]
fn byte_by_byte_random_text() {
    // Random strings of 1- to 4-byte characters, fed one byte token at a time: every push
    // returns "" or exactly the character its byte completed.
    let tok = tokenizer();
    let ids_of_byte = byte_ids(tok);
    let pool: Vec<char> = "aZ9 \n\té߷ह中龘ꙮ가🦙😀👍🏽𝄞\u{10FFFD}".chars().collect();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for _ in 0..200 {
        let s: String = (0..rng.below(40))
            .map(|_| pool[rng.below(pool.len() as u64) as usize])
            .collect();
        let mut dec = StreamDecoder::new(tok, false);
        let mut out = String::new();
        for ch in s.chars() {
            let mut buf = [0u8; 4];
            let bytes = ch.encode_utf8(&mut buf).as_bytes();
            for (i, b) in bytes.iter().enumerate() {
                let piece = dec.push(ids_of_byte[*b as usize]);
                if i + 1 < bytes.len() {
                    assert_eq!(piece, "", "{ch:?}: emitted before its last byte");
                } else {
                    assert_eq!(piece, ch.to_string());
                }
                out.push_str(&piece);
            }
        }
        assert_eq!(dec.finish(), "");
        assert_eq!(out, s);
    }
}

#[test]
fn random_ids_stream_like_decode() {
    // Random ids: byte tokens (mostly non-ASCII, so lots of partial and invalid UTF-8),
    // ordinary tokens, added tokens and unknown ids. After every push the emitted text is a
    // prefix of decode(ids so far) that lacks at most the U+FFFD of an incomplete tail;
    // the final text equals decode of the known ids.
    let tok = tokenizer();
    let ids_of_byte = byte_ids(tok);
    let n = tok.vocab_size() as u64;
    let mut rng = Rng(0xD1B5_4A32_D192_ED03);
    for round in 0..120 {
        let skip = round % 2 == 1;
        let len = rng.below(60) as usize;
        let ids: Vec<u32> = (0..len)
            .map(|_| match rng.below(10) {
                0..=4 => ids_of_byte[(0x80 + rng.below(0x80)) as usize],
                5 => ids_of_byte[rng.below(0x80) as usize],
                6 => 248_044 + rng.below(33) as u32,
                7 => n as u32 + rng.below(300) as u32, // unknown: ignored by the stream
                _ => rng.below(n) as u32,
            })
            .collect();
        let known: Vec<u32> = ids.iter().copied().filter(|&id| (id as u64) < n).collect();
        let mut dec = StreamDecoder::new(tok, skip);
        let mut emitted = String::new();
        let mut seen = Vec::new();
        for &id in &ids {
            emitted.push_str(&dec.push(id));
            if (id as u64) < n {
                seen.push(id);
            }
            let full = tok.decode(&seen, skip).unwrap();
            assert!(
                full.starts_with(&emitted),
                "round {round}: {emitted:?} not a prefix of {full:?}"
            );
            let rest = &full[emitted.len()..];
            assert!(
                rest.is_empty() || rest == "\u{FFFD}",
                "round {round}: withheld {rest:?}"
            );
        }
        emitted.push_str(&dec.finish());
        assert_eq!(emitted, tok.decode(&known, skip).unwrap(), "round {round}");
        // the decoder is reusable after finish
        assert_eq!(dec.push(9419), "Hello");
    }
}
