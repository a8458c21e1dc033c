//! Chat-template rendering against testdata/tokenizer/chat_cases.jsonl and request parsing.

mod common;

use serde_json::{json, Map, Value};
use text::{ChatRequest, ChatTemplate, TextError};

use common::{read_jsonl, template, tokenizer};

/// The case's inputs as a ChatRequest (kwargs.add_generation_prompt becomes the field).
fn request_of(case: &Value) -> ChatRequest {
    let mut kwargs: Map<String, Value> = case["kwargs"].as_object().cloned().unwrap_or_default();
    let add_generation_prompt = kwargs
        .remove("add_generation_prompt")
        .map(|v| v.as_bool().expect("bool add_generation_prompt"))
        .unwrap_or(false);
    ChatRequest {
        messages: case["messages"].as_array().expect("messages").clone(),
        tools: case["tools"].as_array().cloned(),
        add_generation_prompt,
        kwargs,
    }
}

/// The case's inputs as an OpenAI request body.
fn openai_body_of(case: &Value) -> Value {
    let mut kwargs: Map<String, Value> = case["kwargs"].as_object().cloned().unwrap_or_default();
    let agp = kwargs
        .remove("add_generation_prompt")
        .unwrap_or(Value::Bool(false));
    json!({
        "model": "Qwen/Qwen3.6-35B-A3B",
        "messages": case["messages"],
        "tools": case["tools"],
        "add_generation_prompt": agp,
        "chat_template_kwargs": kwargs,
        "temperature": 0.7,
    })
}

#[test]
fn every_chat_case_renders_byte_exact() {
    let cases = read_jsonl("chat_cases.jsonl");
    assert_eq!(cases.len(), 9);
    let mut failures = Vec::new();
    let mut renders = 0;
    let mut errors = 0;
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        let req = request_of(case);
        let got = template().render(&req);
        if let Some(expected_err) = case.get("error").and_then(|e| e.as_str()) {
            errors += 1;
            match got {
                Err(TextError::Template(msg)) if msg.contains(expected_err) => {}
                other => failures.push(format!(
                    "{name}: expected error {expected_err:?}, got {other:?}"
                )),
            }
            continue;
        }
        renders += 1;
        let expected = case["rendered"].as_str().unwrap();
        match got {
            Ok(s) if s == expected => {}
            Ok(s) => failures.push(format!(
                "{name}: render differs\n--- got\n{s:?}\n--- want\n{expected:?}"
            )),
            Err(e) => failures.push(format!("{name}: render failed: {e}")),
        }
        if let Some(ids) = case.get("ids").and_then(|v| v.as_array()) {
            let ids: Vec<u32> = ids.iter().map(|v| v.as_u64().unwrap() as u32).collect();
            let got = tokenizer().encode(expected).unwrap();
            if got != ids {
                failures.push(format!("{name}: encode(rendered) differs"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert_eq!((renders, errors), (8, 1));
}

#[test]
fn every_chat_case_via_openai_body() {
    for case in read_jsonl("chat_cases.jsonl") {
        let name = case["name"].as_str().unwrap();
        let req = ChatRequest::from_openai_json(&openai_body_of(&case)).unwrap();
        assert_eq!(req, request_of(&case), "{name}");
        let got = template().render(&req);
        match case.get("error").and_then(|e| e.as_str()) {
            Some(err) => assert!(
                matches!(&got, Err(TextError::Template(m)) if m.contains(err)),
                "{name}: {got:?}"
            ),
            None => assert_eq!(got.unwrap(), case["rendered"].as_str().unwrap(), "{name}"),
        }
    }
}

fn case(name: &str) -> Value {
    read_jsonl("chat_cases.jsonl")
        .into_iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no chat case {name}"))
}

/// Replaces every `tool_calls[].function.arguments` object by its JSON string.
fn stringify_arguments(messages: &mut Value) -> usize {
    let mut n = 0;
    for m in messages.as_array_mut().unwrap() {
        if let Some(calls) = m.get_mut("tool_calls").and_then(|c| c.as_array_mut()) {
            for call in calls {
                let args = &mut call["function"]["arguments"];
                assert!(args.is_object());
                *args = Value::String(serde_json::to_string(args).unwrap());
                n += 1;
            }
        }
    }
    n
}

#[test]
fn string_arguments_render_like_objects() {
    for name in [
        "tool_call_and_response_then_generate",
        "parallel_tool_calls_structured_args_full_transcript",
    ] {
        let c = case(name);
        let mut body = openai_body_of(&c);
        assert!(
            stringify_arguments(&mut body["messages"]) > 0,
            "{name} has no tool call"
        );
        let req = ChatRequest::from_openai_json(&body).unwrap();
        // the string became the very same object again
        assert_eq!(
            req.messages,
            c["messages"].as_array().unwrap().clone(),
            "{name}"
        );
        assert_eq!(
            template().render(&req).unwrap(),
            c["rendered"].as_str().unwrap(),
            "{name}"
        );
    }
}

#[test]
fn empty_or_null_arguments_become_empty_object() {
    for args in [json!(""), json!(null), json!("  ")] {
        let body = json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "now", "arguments": args}}]}
        ]});
        let req = ChatRequest::from_openai_json(&body).unwrap();
        assert_eq!(
            req.messages[1]["tool_calls"][0]["function"]["arguments"],
            json!({})
        );
        let out = template().render(&req).unwrap();
        assert!(
            out.contains("<tool_call>\n<function=now>\n</function>\n</tool_call><|im_end|>\n"),
            "{out:?}"
        );
    }
}

#[test]
fn add_generation_prompt_default_true_and_false() {
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    let on = ChatRequest::from_openai_json(&json!({"messages": msgs})).unwrap();
    assert!(on.add_generation_prompt);
    assert_eq!(
        template().render(&on).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    );

    let null =
        ChatRequest::from_openai_json(&json!({"messages": msgs, "add_generation_prompt": null}))
            .unwrap();
    assert!(null.add_generation_prompt);

    let off =
        ChatRequest::from_openai_json(&json!({"messages": msgs, "add_generation_prompt": false}))
            .unwrap();
    assert!(!off.add_generation_prompt);
    assert_eq!(
        template().render(&off).unwrap(),
        "<|im_start|>user\nHi<|im_end|>\n"
    );

    // vLLM: chat_template_kwargs override the top-level value
    let over = ChatRequest::from_openai_json(
        &json!({"messages": msgs, "add_generation_prompt": true, "chat_template_kwargs": {"add_generation_prompt": false}}),
    )
    .unwrap();
    assert!(!over.add_generation_prompt);
    assert!(over.kwargs.is_empty());
}

#[test]
fn enable_thinking_false_closes_the_think_block() {
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": false}});
    let req = ChatRequest::from_openai_json(&body).unwrap();
    assert_eq!(req.kwargs.get("enable_thinking"), Some(&json!(false)));
    let out = template().render(&req).unwrap();
    assert!(
        out.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{out:?}"
    );
    // explicitly true (or absent) keeps the open think block
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"enable_thinking": true}});
    let out = template()
        .render(&ChatRequest::from_openai_json(&body).unwrap())
        .unwrap();
    assert!(out.ends_with("<|im_start|>assistant\n<think>\n"), "{out:?}");
}

fn request_error(body: Value) -> (String, String) {
    match ChatRequest::from_openai_json(&body) {
        Err(TextError::Request { field, reason }) => (field, reason),
        other => panic!("expected a request error for {body}, got {other:?}"),
    }
}

#[test]
fn wrong_types_name_the_field() {
    let user = json!({"role": "user", "content": "Hi"});
    let cases: Vec<(Value, &str)> = vec![
        (json!([]), "body"),
        (json!({}), "messages"),
        (json!({"messages": "Hi"}), "messages"),
        (json!({"messages": {"role": "user"}}), "messages"),
        (json!({"messages": [user, 3]}), "messages[1]"),
        (json!({"messages": [{"content": "x"}]}), "messages[0].role"),
        (
            json!({"messages": [{"role": 1, "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": [user], "tools": {"type": "function"}}),
            "tools",
        ),
        (json!({"messages": [user], "tools": ["f"]}), "tools[0]"),
        (
            json!({"messages": [user], "add_generation_prompt": "yes"}),
            "add_generation_prompt",
        ),
        (
            json!({"messages": [user], "chat_template_kwargs": [1]}),
            "chat_template_kwargs",
        ),
        (
            json!({"messages": [user], "chat_template_kwargs": {"add_generation_prompt": 1}}),
            "chat_template_kwargs.add_generation_prompt",
        ),
        (
            json!({"messages": [user], "chat_template_kwargs": {"messages": []}}),
            "chat_template_kwargs.messages",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": {}}]}),
            "messages[1].tool_calls",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": [1]}]}),
            "messages[1].tool_calls[0]",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": [{"function": "f"}]}]}),
            "messages[1].tool_calls[0].function",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]}]}),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1, 2]"}}]}]}),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            json!({"messages": [user, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]}),
            "messages[1].tool_calls[0].function.arguments",
        ),
    ];
    for (body, want) in cases {
        let (field, reason) = request_error(body.clone());
        assert_eq!(field, want, "{body}: {reason}");
        let shown = ChatRequest::from_openai_json(&body)
            .unwrap_err()
            .to_string();
        assert!(shown.contains(want), "{shown}");
    }
}

#[test]
fn unknown_fields_are_ignored() {
    let body = json!({"messages": [{"role": "user", "content": "Hi", "name": "bob"}], "stream": true, "top_k": 20, "logprobs": null});
    let req = ChatRequest::from_openai_json(&body).unwrap();
    assert_eq!(req.messages.len(), 1);
    assert_eq!(req.tools, None);
}

fn template_error(messages: Value) -> String {
    let req = ChatRequest {
        messages: messages.as_array().unwrap().clone(),
        tools: None,
        add_generation_prompt: true,
        kwargs: Map::new(),
    };
    match template().render(&req) {
        Err(TextError::Template(msg)) => msg,
        other => panic!("expected a template error, got {other:?}"),
    }
}

#[test]
fn raise_exception_messages_are_verbatim() {
    assert_eq!(template_error(json!([])), "No messages provided.");
    assert_eq!(
        template_error(
            json!([{"role": "user", "content": "<tool_response>\nx\n</tool_response>"}])
        ),
        "No user query found in messages."
    );
    // raised inside the render_content macro
    assert_eq!(
        template_error(
            json!([{"role": "system", "content": [{"type": "image", "image": "a.png"}]}, {"role": "user", "content": "Hi"}])
        ),
        "System message cannot contain images."
    );
    assert_eq!(
        template_error(json!([{"role": "user", "content": 42}])),
        "Unexpected content type."
    );
    assert_eq!(
        template_error(
            json!([{"role": "user", "content": "Hi"}, {"role": "robot", "content": "x"}])
        ),
        "Unexpected message role."
    );
}

#[test]
fn multimodal_content_lists_render_placeholders() {
    // Expected text follows the template by hand: a content list concatenates its items.
    let req = ChatRequest {
        messages: vec![json!({"role": "user", "content": [
            {"type": "image", "image": "a.png"},
            {"type": "text", "text": "What is this?"},
            {"type": "video", "video": "b.mp4"}
        ]})],
        tools: None,
        add_generation_prompt: false,
        kwargs: json!({"add_vision_id": true}).as_object().unwrap().clone(),
    };
    assert_eq!(
        template().render(&req).unwrap(),
        "<|im_start|>user\nPicture 1: <|vision_start|><|image_pad|><|vision_end|>What is this?Video 1: <|vision_start|><|video_pad|><|vision_end|><|im_end|>\n"
    );
}

#[test]
fn reserved_kwargs_are_rejected() {
    for key in ["messages", "tools", "documents", "add_generation_prompt"] {
        let mut kwargs = Map::new();
        kwargs.insert(key.into(), json!(true));
        let req = ChatRequest {
            messages: vec![json!({"role": "user", "content": "Hi"})],
            tools: None,
            add_generation_prompt: true,
            kwargs,
        };
        match template().render(&req) {
            Err(TextError::Request { field, .. }) => assert_eq!(field, format!("kwargs.{key}")),
            other => panic!("{key}: {other:?}"),
        }
    }
}

fn render_src(src: &str, kwargs: Value) -> Result<String, TextError> {
    let t = ChatTemplate::from_source(src.to_string())?;
    t.render(&ChatRequest {
        messages: vec![],
        tools: None,
        add_generation_prompt: false,
        kwargs: kwargs.as_object().unwrap().clone(),
    })
}

#[test]
fn tojson_is_python_json_dumps() {
    let x =
        json!({"b": 1, "a": [1, 2.5, 1e16, 0.00001, null, true], "s": "Zürich <b>&'\"\n", "e": {}});
    // Expected strings from CPython json.dumps with the same arguments.
    assert_eq!(
        render_src("{{ x|tojson }}", json!({"x": x})).unwrap(),
        r#"{"b": 1, "a": [1, 2.5, 1e+16, 1e-05, null, true], "s": "Zürich <b>&'\"\n", "e": {}}"#
    );
    assert_eq!(
        render_src(
            "{{ x|tojson(indent=2, sort_keys=true) }}",
            json!({"x": {"b": [1], "a": {}}})
        )
        .unwrap(),
        "{\n  \"a\": {},\n  \"b\": [\n    1\n  ]\n}"
    );
    assert_eq!(
        render_src("{{ x|tojson(ensure_ascii=true) }}", json!({"x": "é"})).unwrap(),
        "\"\\u00e9\""
    );
    assert_eq!(
        render_src(
            "{{ x|tojson(separators=(',', ':')) }}",
            json!({"x": [1, {"k": 2}]})
        )
        .unwrap(),
        "[1,{\"k\":2}]"
    );
    assert!(render_src("{{ x|tojson(bogus=1) }}", json!({"x": 1})).is_err());
}

#[test]
fn trim_and_strip_use_python_whitespace() {
    // Python: "\x1c\u3000 a b\u00a0\x1f".strip() == "a b"
    let kw = json!({"s": "\u{1c}\u{3000} a b\u{a0}\u{1f}"});
    assert_eq!(render_src("[{{ s|trim }}]", kw.clone()).unwrap(), "[a b]");
    assert_eq!(
        render_src(
            "[{{ s.strip() }}|{{ s.lstrip()|length }}|{{ s.rstrip()|length }}]",
            kw
        )
        .unwrap(),
        "[a b|5|6]"
    );
    assert_eq!(
        render_src(
            "[{{ 'xxaxx'.strip('x') }}{{ '\n\na\n'.lstrip('\n') }}]",
            json!({})
        )
        .unwrap(),
        "[aa\n]"
    );
    // zero-width space is not whitespace for Python either
    assert_eq!(
        render_src("[{{ s|trim }}]", json!({"s": "\u{200b}a "})).unwrap(),
        "[\u{200b}a]"
    );
}

#[test]
fn python_methods_and_loop_helpers_work() {
    let src = "{% for m in msgs %}{{ loop.previtem.x if loop.previtem is defined else '-' }}{% endfor %}|{{ 'a</think>b'.split('</think>')[-1] }}|{{ d.items()|list|length }}|{{ 'abc'.startswith('ab') }}";
    assert_eq!(
        render_src(
            src,
            json!({"msgs": [{"x": 1}, {"x": 2}, {"x": 3}], "d": {"k": 1, "j": 2}})
        )
        .unwrap(),
        "-12|b|2|True"
    );
    let year = render_src("{{ strftime_now('%Y') }}", json!({})).unwrap();
    assert!(
        year.len() == 4 && year.chars().all(|c| c.is_ascii_digit()),
        "{year}"
    );
}

#[test]
fn syntax_error_is_a_template_error() {
    assert!(matches!(
        ChatTemplate::from_source("{% if %}".into()),
        Err(TextError::Template(_))
    ));
    assert!(matches!(
        ChatTemplate::from_source("{{ x ".into()),
        Err(TextError::Template(_))
    ));
}

#[test]
fn from_dir_reads_tokenizer_config_string_template() {
    let dir = tempfile::tempdir().unwrap();
    // no template at all
    assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        r#"{"eos_token": "<|im_end|>"}"#,
    )
    .unwrap();
    assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());

    // the official template as the `chat_template` string, with special tokens in the config
    let official =
        std::fs::read_to_string(common::asset_dir().join("chat_template.jinja")).unwrap();
    let config = json!({
        "add_bos_token": false,
        "bos_token": null,
        "eos_token": {"content": "<|im_end|>", "special": true},
        "pad_token": "<|endoftext|>",
        "chat_template": official,
    });
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    let t = ChatTemplate::from_dir(dir.path())
        .unwrap()
        .expect("template");
    let c = case("tools_with_system_thinking_enabled");
    assert_eq!(
        t.render(&request_of(&c)).unwrap(),
        c["rendered"].as_str().unwrap()
    );

    // special tokens reach the template; chat_template.jinja wins over the config field
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}",
    )
    .unwrap();
    let t = ChatTemplate::from_dir(dir.path())
        .unwrap()
        .expect("template");
    assert_eq!(
        t.render(&request_of(&c)).unwrap(),
        "<|im_end|>|<|endoftext|>|False"
    );
}

#[test]
fn from_dir_list_form_uses_default() {
    let dir = tempfile::tempdir().unwrap();
    let config = json!({"chat_template": [
        {"name": "tool_use", "template": "tool"},
        {"name": "default", "template": "default {{ messages|length }}"}
    ]});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    let req =
        ChatRequest::from_openai_json(&json!({"messages": [{"role": "user", "content": "x"}]}))
            .unwrap();
    assert_eq!(t.render(&req).unwrap(), "default 1");

    let config = json!({"chat_template": [{"name": "tool_use", "template": "tool"}]});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    assert!(matches!(
        ChatTemplate::from_dir(dir.path()),
        Err(TextError::Config { .. })
    ));

    std::fs::write(dir.path().join("tokenizer_config.json"), "{not json").unwrap();
    assert!(matches!(
        ChatTemplate::from_dir(dir.path()),
        Err(TextError::Config { .. })
    ));

    let missing = dir.path().join("nope");
    assert!(matches!(
        ChatTemplate::from_dir(&missing),
        Err(TextError::Io { .. })
    ));
}

#[test]
fn from_dir_on_the_repo_assets() {
    let t = ChatTemplate::from_dir(&common::asset_dir())
        .unwrap()
        .expect("chat_template.jinja");
    let c = case("single_user_default_thinking");
    assert_eq!(
        t.render(&request_of(&c)).unwrap(),
        c["rendered"].as_str().unwrap()
    );
}
