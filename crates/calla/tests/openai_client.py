"""The official `openai` client against a running `calla serve` (argv[1]: base URL with /v1).

Run by crates/calla/tests/serve.rs; prints OK at the end.
"""
import json
import sys

import openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
M = "Qwen3.6-35B-A3B"
msgs = [{"role": "user", "content": "Say hello."}]
tools = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                       "required": ["city"]},
    },
}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def extra(obj, name):
    return (getattr(obj, "model_extra", None) or {}).get(name)


# 1. Non-streaming, thinking on (default): reasoning_content and usage with cached tokens.
r = client.chat.completions.create(model=M, messages=msgs, max_tokens=6, temperature=0)
c = r.choices[0]
assert r.object == "chat.completion", r
assert c.message.role == "assistant"
assert c.finish_reason in ("stop", "length", "tool_calls"), c.finish_reason
assert r.usage.completion_tokens <= 6 and r.usage.prompt_tokens > 0
assert r.usage.prompt_tokens_details is not None and r.usage.prompt_tokens_details.cached_tokens >= 0
if c.finish_reason == "length":
    # 6 tokens end inside the reasoning: nothing is content yet.
    assert c.message.content is None and extra(c.message, "reasoning_content") is not None, r
r2 = client.chat.completions.create(model=M, messages=msgs, max_tokens=6, temperature=0)
assert r2.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens, r2.usage
assert r2.choices[0].message.content == c.message.content

# 2. Streaming, thinking off, with usage.
stream = client.chat.completions.create(model=M, messages=msgs, max_tokens=6, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body=NO_THINK)
text, finish, usage, n = "", None, None, 0
for ch in stream:
    n += 1
    if ch.usage:
        usage = ch.usage
    for ch_c in ch.choices:
        text += ch_c.delta.content or ""
        assert extra(ch_c.delta, "reasoning_content") is None, "thinking is off"
        finish = ch_c.finish_reason or finish
assert n >= 2 and finish in ("stop", "length"), (n, finish)
assert usage is not None and usage.completion_tokens <= 6
whole = client.chat.completions.create(model=M, messages=msgs, max_tokens=6, temperature=0, extra_body=NO_THINK)
assert (whole.choices[0].message.content or "") == text, (whole, text)

# 3. Tools, streaming and not, thinking on and off.
for think in (True, False):
    kw = {} if think else {"extra_body": NO_THINK}
    r = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=tools,
                                       tool_choice="auto", max_tokens=5, temperature=0, **kw)
    m = r.choices[0].message
    for tc in m.tool_calls or []:
        json.loads(tc.function.arguments)
    s = client.chat.completions.create(model=M, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=tools,
                                       max_tokens=5, temperature=0, stream=True, **kw)
    got = "".join((ch.choices[0].delta.content or "") for ch in s if ch.choices)
    assert got == (m.content or ""), (got, m.content)

# 4. A tool result fed back (arguments as a JSON string, then as an object in a raw request).
history = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 3}"},
]
r = client.chat.completions.create(model=M, messages=history, tools=tools, max_tokens=4, temperature=0, extra_body=NO_THINK)
assert r.choices[0].message.role == "assistant"

# 5. Errors surface as the client's exception types.
try:
    client.chat.completions.create(model=M, messages=msgs, n=2, max_tokens=2)
    raise SystemExit("n=2 was accepted")
except openai.BadRequestError as e:
    assert "n" in str(e), e
try:
    client.chat.completions.create(model=M, messages=msgs, max_tokens=2, temperature="hot")
    raise SystemExit("a string temperature was accepted")
except openai.BadRequestError as e:
    assert "temperature" in str(e), e

# 6. Completions and models.
r = client.completions.create(model=M, prompt="The sea is", max_tokens=3, temperature=0)
assert r.object == "text_completion" and isinstance(r.choices[0].text, str)
assert any(m.id == M for m in client.models.list().data)
print("OK")
