//! Encode/decode against testdata/tokenizer/vectors.jsonl and llamacpp_vectors.jsonl.

mod common;

use common::{tokenizer, vectors, Vector};
use text::{TextError, Tokenizer};

/// Checks one vector; returns the mismatches found.
fn check(tok: &Tokenizer, v: &Vector) -> Vec<String> {
    let mut bad = Vec::new();
    let who = format!("{}:{}", v.file, v.name);
    match tok.encode(&v.text) {
        Ok(ids) if ids == v.ids => {}
        Ok(ids) => bad.push(format!("{who}: encode {ids:?} != {:?}", v.ids)),
        Err(e) => bad.push(format!("{who}: encode failed: {e}")),
    }
    match tok.decode(&v.ids, false) {
        Ok(s) if s == v.decoded => {}
        other => bad.push(format!("{who}: decode {other:?} != {:?}", v.decoded)),
    }
    match tok.decode(&v.ids, true) {
        Ok(s) if s == v.decoded_skip_special => {}
        other => bad.push(format!(
            "{who}: decode(skip_special) {other:?} != {:?}",
            v.decoded_skip_special
        )),
    }
    for (i, (id, want)) in v.ids.iter().zip(&v.token_bytes).enumerate() {
        if tok.id_to_bytes(*id).as_ref() != Some(want) {
            bad.push(format!("{who}: id_to_bytes({id}) at {i} != {want:02x?}"));
        }
    }
    if v.ids.len() != v.token_bytes.len() {
        bad.push(format!("{who}: token_bytes_hex length differs from ids"));
    }
    bad
}

#[test]
fn every_vector_encodes_and_decodes_exactly() {
    let tok = tokenizer();
    let all = vectors();
    assert_eq!(all.len(), 61 + 46);
    let failures: Vec<String> = all.iter().flat_map(|v| check(tok, v)).collect();
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn vectors_from_several_threads_at_once() {
    let tok = tokenizer();
    let all = vectors();
    let failures: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let all = &all;
                s.spawn(move || {
                    let mut bad = Vec::new();
                    for round in 0..3 {
                        // each thread walks the vectors in a different order
                        for k in 0..all.len() {
                            let v = &all[(k * (2 * t + 1) + round * 7) % all.len()];
                            bad.extend(check(tok, v));
                        }
                    }
                    bad
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("thread panicked"))
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn vocabulary_layout() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 248_077);
    assert_eq!(tok.token_to_id("<|endoftext|>"), Some(248_044));
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(248_045));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(248_046));
    assert_eq!(tok.token_to_id("<think>"), Some(248_068));
    assert_eq!(tok.token_to_id("</think>"), Some(248_069));
    assert_eq!(tok.token_to_id("<|audio_pad|>"), Some(248_076));
    assert_eq!(tok.token_to_id("Ġthe"), Some(279));
    assert_eq!(tok.token_to_id("no such token"), None);
    assert_eq!(
        tok.id_to_bytes(248_046).as_deref(),
        Some(&b"<|im_end|>"[..])
    );
    assert_eq!(tok.id_to_bytes(198).as_deref(), Some(&b"\n"[..]));
    assert_eq!(tok.id_to_bytes(248_077), None);
    assert!(tok.is_special(248_046) && tok.is_special(248_044));
    assert!(!tok.is_special(248_068) && !tok.is_special(248_058) && !tok.is_special(279));
    // every id has bytes; the 256 single bytes are all present
    let mut single = std::collections::HashSet::new();
    for id in 0..tok.vocab_size() as u32 {
        let b = tok
            .id_to_bytes(id)
            .unwrap_or_else(|| panic!("id {id} has no bytes"));
        assert!(!b.is_empty(), "id {id}");
        if b.len() == 1 {
            single.insert(b[0]);
        }
    }
    assert_eq!(single.len(), 256);
}

#[test]
fn added_tokens_in_text_and_nfc() {
    let tok = tokenizer();
    assert_eq!(tok.encode("Hello, world").unwrap(), vec![9419, 11, 1814]);
    // README "Known divergences": tokenizers extracts added tokens before NFC.
    assert_eq!(
        tok.encode("x<|im_end|>\u{0338}y").unwrap(),
        vec![87, 248_046, 136, 116, 88]
    );
    // NFD input is normalised: "é" as e + U+0301 encodes like the precomposed form
    assert_eq!(
        tok.encode("caf\u{65}\u{301}").unwrap(),
        tok.encode("café").unwrap()
    );
    assert_eq!(tok.encode("").unwrap(), Vec::<u32>::new());
}

#[test]
fn unknown_ids_are_errors_not_panics() {
    let tok = tokenizer();
    for bad in [248_077u32, 248_319, u32::MAX] {
        for skip in [false, true] {
            match tok.decode(&[9419, bad], skip) {
                Err(TextError::Tokenizer(msg)) => assert!(msg.contains(&bad.to_string()), "{msg}"),
                other => panic!("decode({bad}) gave {other:?}"),
            }
        }
    }
    assert_eq!(tok.decode(&[], false).unwrap(), "");
}

#[test]
fn loading_errors() {
    let dir = tempfile::tempdir().unwrap();
    assert!(Tokenizer::from_dir(dir.path()).unwrap().is_none());
    assert!(matches!(
        Tokenizer::from_file(&dir.path().join("tokenizer.json")),
        Err(TextError::Io { .. })
    ));
    std::fs::write(
        dir.path().join("tokenizer.json"),
        "{\"not\": \"a tokenizer\"}",
    )
    .unwrap();
    assert!(matches!(
        Tokenizer::from_dir(dir.path()),
        Err(TextError::Tokenizer(_))
    ));
    assert!(matches!(
        Tokenizer::from_dir(&dir.path().join("missing")),
        Err(TextError::Io { .. })
    ));
    let tok = Tokenizer::from_dir(&common::asset_dir())
        .unwrap()
        .expect("repo tokenizer");
    assert_eq!(tok.vocab_size(), 248_077);
}

#[test]
fn shared_types_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<text::ChatTemplate>();
    assert_send_sync::<text::ChatRequest>();
    assert_send_sync::<TextError>();
}
