//! The `calla` binary end to end: id-based commands against the transformers fixtures, the
//! text commands on the built-in default model, and bad input (clear error, non-zero exit,
//! never a panic).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::SafeTensors;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn fixture(name: &str) -> PathBuf {
    root().join("testdata/fixtures").join(name)
}

fn calla(args: &[&str], home: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_calla"))
        .args(args)
        .env("CALLA_HOME", home)
        .env_remove("CALLA_MODEL")
        .output()
        .expect("run calla")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A failing command: non-zero exit, the message contains every needle, no panic.
fn assert_fails(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success; stderr: {err}");
    assert!(!err.contains("panicked"), "panic instead of an error: {err}");
    for n in needles {
        assert!(err.contains(n), "error message {err:?} does not mention {n:?}");
    }
}

fn ids_of(refs: &SafeTensors<'_>, name: &str) -> Vec<u32> {
    refs.tensor(name).unwrap().data().chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32).collect()
}

fn join(ids: &[u32]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

#[test]
fn logits_and_generate_match_the_fixture() {
    let dir = fixture("tiny-a");
    let home = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(dir.join("references.safetensors")).unwrap();
    let refs = SafeTensors::deserialize(&bytes).unwrap();
    for p in [2, 5] {
        let ids = ids_of(&refs, &format!("p{p}.prompt_ids"));
        let out = home.path().join(format!("p{p}.safetensors"));
        let o = calla(&["logits", "--model", dir.to_str().unwrap(), "--ids", &join(&ids), "--out", out.to_str().unwrap()], home.path());
        assert!(o.status.success(), "{}", stderr(&o));
        let got_bytes = std::fs::read(&out).unwrap();
        let got = SafeTensors::deserialize(&got_bytes).unwrap();
        let t = got.tensor("logits").unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::F32);
        assert_eq!(t.shape(), &[ids.len(), 512]);
        let want = refs.tensor(&format!("p{p}.prompt_logits")).unwrap();
        let err = t
            .data()
            .chunks_exact(4)
            .zip(want.data().chunks_exact(4))
            .map(|(a, b)| (f32::from_le_bytes(a.try_into().unwrap()) - f32::from_le_bytes(b.try_into().unwrap())).abs())
            .fold(0.0f32, f32::max);
        assert!(err <= 1e-4, "p{p}: max |Δ| {err}");

        let gen = ids_of(&refs, &format!("p{p}.gen_ids"));
        let o = calla(
            &["generate", "--model", dir.to_str().unwrap(), "--ids", &join(&ids), "--max-tokens", &gen.len().to_string(), "--greedy"],
            home.path(),
        );
        assert!(o.status.success(), "{}", stderr(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let got: Vec<u32> = v["ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
        assert_eq!(got, gen, "p{p} greedy ids");
    }
}

#[test]
fn text_commands_on_the_default_model() {
    let home = tempfile::tempdir().unwrap();
    // The default (demo) model has a compact vocabulary: `tokenize` prints its model ids, the
    // rows that calla_vocab.json assigns to the tokenizer's ids [9419, 11, 1814].
    let o = calla(&["tokenize", "--text", "Hello, world"], home.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let map: serde_json::Value = serde_json::from_slice(&std::fs::read(root().join("assets/demo/calla_vocab.json")).unwrap()).unwrap();
    let ids: Vec<i64> = map["tokenizer_ids"].as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect();
    let rows: Vec<usize> = [9419i64, 11, 1814].iter().map(|t| ids.iter().position(|x| x == t).unwrap()).collect();
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), serde_json::to_string(&rows).unwrap());

    let req = home.path().join("req.json");
    std::fs::write(
        &req,
        r#"{"model": "x", "messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": false}, "temperature": 0.3}"#,
    )
    .unwrap();
    let o = calla(&["template", "--request", req.to_str().unwrap()], home.path());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8(o.stdout).unwrap(), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");

    // A template error exits non-zero with the template's message.
    std::fs::write(
        &req,
        r#"{"messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]}"#,
    )
    .unwrap();
    let o = calla(&["template", "--request", req.to_str().unwrap()], home.path());
    assert_fails(&o, &["System message must be at the beginning."]);

    let o = calla(&["run", "--prompt", "Say something.", "--max-tokens", "8", "--seed", "3"], home.path());
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(err.contains("prompt ") && err.contains("TTFT") && err.contains("tok/s"), "summary line missing: {err}");
    // Same seed, same text.
    let o2 = calla(&["run", "--prompt", "Say something.", "--max-tokens", "8", "--seed", "3"], home.path());
    assert_eq!(o.stdout, o2.stdout);
}

#[test]
fn bad_prompts_are_refused() {
    let home = tempfile::tempdir().unwrap();
    let o = calla(&["run", "--prompt", "   "], home.path());
    assert_fails(&o, &["empty"]);
    let o = calla(&["run"], home.path());
    assert_fails(&o, &["--prompt"]);
    let f = home.path().join("bad.txt");
    std::fs::write(&f, b"hello \xff\xfe world").unwrap();
    let o = calla(&["run", "--prompt-file", f.to_str().unwrap()], home.path());
    assert_fails(&o, &["not valid UTF-8", "offset 6"]);
    let long = "word ".repeat(200);
    let o = calla(&["run", "--prompt", &long, "--max-context", "64"], home.path());
    assert_fails(&o, &["context limit of 64 tokens"]);
    let o = calla(&["generate", "--model", fixture("tiny-a").to_str().unwrap(), "--ids", "1,x,3"], home.path());
    assert_fails(&o, &["`x`"]);
    let o = calla(&["generate", "--model", fixture("tiny-a").to_str().unwrap(), "--ids", "1,99999"], home.path());
    assert_fails(&o, &["99999", "vocabulary"]);
    let o = calla(&["run", "--model", "/nonexistent/model", "--prompt", "hi"], home.path());
    assert_fails(&o, &["/nonexistent/model"]);
    // the tests build without the CUDA backend: asking for it says how to get it
    let o = calla(&["generate", "--model", fixture("tiny-a").to_str().unwrap(), "--ids", "1,2", "--device", "cuda"], home.path());
    assert_fails(&o, &["without the CUDA backend", "--features cuda"]);
    let o = calla(&["run", "--prompt", "hi", "--device", "tpu"], home.path());
    assert_fails(&o, &["tpu", "cpu", "cuda"]);
}

/// Copies tiny-a into a temp folder so it can be damaged.
fn copy_fixture(to: &Path) {
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        std::fs::copy(fixture("tiny-a").join(f), to.join(f)).unwrap();
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

/// Rewrites model.safetensors with `f` applied to the tensor list.
fn edit_tensors(dir: &Path, f: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>)) {
    let p = dir.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> =
        st.tensors().into_iter().map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec())).collect();
    f(&mut ts);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = ts
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &p).unwrap();
}

fn generate_err(dir: &Path, home: &Path) -> Output {
    calla(&["generate", "--model", dir.to_str().unwrap(), "--ids", "1,2,3", "--max-tokens", "2"], home)
}

#[test]
fn damaged_checkpoints_give_clear_errors() {
    let home = tempfile::tempdir().unwrap();
    let h = home.path();

    // Truncated safetensors.
    let d = tempfile::tempdir().unwrap();
    copy_fixture(d.path());
    let p = d.path().join("model.safetensors");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() / 2]).unwrap();
    assert_fails(&generate_err(d.path(), h), &["model.safetensors", "not a valid safetensors file"]);

    // Missing shard of a sharded checkpoint.
    let d = tempfile::tempdir().unwrap();
    copy_fixture(d.path());
    std::fs::rename(d.path().join("model.safetensors"), d.path().join("model-00001-of-00002.safetensors")).unwrap();
    let bytes = std::fs::read(d.path().join("model-00001-of-00002.safetensors")).unwrap();
    let names: Vec<String> = SafeTensors::deserialize(&bytes).unwrap().names().iter().map(|s| s.to_string()).collect();
    let mut map = serde_json::Map::new();
    for n in names {
        map.insert(n, "model-00001-of-00002.safetensors".into());
    }
    map.insert("model.extra.weight".into(), "model-00002-of-00002.safetensors".into());
    std::fs::write(d.path().join("model.safetensors.index.json"), serde_json::json!({"weight_map": map}).to_string()).unwrap();
    assert_fails(&generate_err(d.path(), h), &["model-00002-of-00002.safetensors", "missing"]);

    // Missing tensor.
    let d = tempfile::tempdir().unwrap();
    copy_fixture(d.path());
    edit_tensors(d.path(), |ts| ts.retain(|t| t.0 != "model.layers.5.linear_attn.dt_bias"));
    assert_fails(&generate_err(d.path(), h), &["model.layers.5.linear_attn.dt_bias", "missing"]);

    // Wrong shape.
    let d = tempfile::tempdir().unwrap();
    copy_fixture(d.path());
    edit_tensors(d.path(), |ts| {
        let t = ts.iter_mut().find(|t| t.0 == "model.layers.3.self_attn.k_proj.weight").unwrap();
        t.2 = vec![64, 256];
    });
    assert_fails(&generate_err(d.path(), h), &["model.layers.3.self_attn.k_proj.weight", "[64, 256]", "[128, 128]"]);

    // Wrong dtype (integers where floats belong).
    let d = tempfile::tempdir().unwrap();
    copy_fixture(d.path());
    edit_tensors(d.path(), |ts| {
        let t = ts.iter_mut().find(|t| t.0 == "model.norm.weight").unwrap();
        t.1 = safetensors::Dtype::I16;
    });
    assert_fails(&generate_err(d.path(), h), &["model.norm.weight", "dtype"]);

    // Config with a different expert count.
    let d = tempfile::tempdir().unwrap();
    copy_fixture(d.path());
    edit_config(d.path(), |v| v["num_experts"] = 8.into());
    assert_fails(&generate_err(d.path(), h), &["num_experts", "8 experts"]);

    // Config with a different layer pattern (layer 3 said to be linear attention).
    let d = tempfile::tempdir().unwrap();
    copy_fixture(d.path());
    edit_config(d.path(), |v| {
        v["layer_types"][3] = "linear_attention".into();
    });
    assert_fails(&generate_err(d.path(), h), &["layer_types[3]"]);

    // Config with an invalid head ratio.
    let d = tempfile::tempdir().unwrap();
    copy_fixture(d.path());
    edit_config(d.path(), |v| v["num_key_value_heads"] = 3.into());
    assert_fails(&generate_err(d.path(), h), &["num_key_value_heads"]);

    // Not JSON.
    let d = tempfile::tempdir().unwrap();
    copy_fixture(d.path());
    std::fs::write(d.path().join("config.json"), "{ nope").unwrap();
    assert_fails(&generate_err(d.path(), h), &["config.json", "not valid JSON"]);
}
