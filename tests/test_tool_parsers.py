"""The tool-call parsers and the reasoning splitter against recorded model outputs (calls, no call,
malformed calls, several calls; Qwen2.5/Qwen3's Hermes blocks, Llama 3.1's JSON), whole and cut
into random pieces as a stream cuts them; the forced-call grammar through llguidance; chat
templates with and without a tool format of their own."""

from __future__ import annotations

import json
import random

import pytest

from multilora.server import protocol as P
from multilora.server.chat_output import ChatOutput
from multilora.server.reasoning import ReasoningSplitter
from multilora.server.tool_parsers import ToolCallStream, collect, parse_tool_calls
from multilora.server.tools import call_grammar, template_messages

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["location"], "additionalProperties": False,
    "properties": {"location": {"type": "string", "maxLength": 12}, "unit": {"$ref": "#/$defs/unit"}},
    "$defs": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}

# (parser, output as a model wrote it, content, [(name, arguments as an object)])
RECORDED = [
    ("hermes", '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, '
               'USA", "unit": "celsius"}}\n</tool_call>', None,
     [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"})]),
    ("hermes", "I'll check both for you.\n<tool_call>\n{\"name\": \"get_current_temperature\", \"arguments\": "
               "{\"location\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_temperature_date\", "
               "\"arguments\": {\"location\": \"Paris\", \"date\": \"2024-10-01\"}}\n</tool_call>",
     "I'll check both for you.",
     [("get_current_temperature", {"location": "Paris"}),
      ("get_temperature_date", {"location": "Paris", "date": "2024-10-01"})]),
    ("hermes", "The capital of France is Paris. Use <b>tags</b> freely: a < b.", 
     "The capital of France is Paris. Use <b>tags</b> freely: a < b.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}\n</tool_call>\nsorry',
     '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}\n</tool_call>\nsorry', []),
    ("hermes", '<tool_call>\n{"arguments": {"q": "a}\\"b"}, "name": "search"}\n</tool_call>', None,
     [("search", {"q": 'a}"b'})]),
    ("hermes", '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}\n</tool_call>', None,
     [("search", {"q": "x"})]),
    ("hermes", 'ok <tool_call>\n{"name": "get_time", "arguments": {}}', "ok", [("get_time", {})]),  # cut at EOS
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"location": "Menlo Park", "unit": "fahrenheit"}}',
     None, [("get_weather", {"location": "Menlo Park", "unit": "fahrenheit"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", '
                    '"parameters": {"location": "Oslo"}}', None,
     [("get_time", {}), ("get_weather", {"location": "Oslo"})]),
    ("llama3_json", "Hello! How can I help you today?", "Hello! How can I help you today?", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"location": }}', 
     '{"name": "get_weather", "parameters": {"location": }}', []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
]


def pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        out.append(text[i:i + k])
        i += k
    return out


@pytest.mark.parametrize("parser,text,content,calls", RECORDED)
def test_parsers_on_recorded_outputs_whole_and_streamed(parser, text, content, calls):
    got_content, got = parse_tool_calls(parser, text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert all(c.id.startswith("call_") for c in got) and len({c.id for c in got}) == len(got)
    rng = random.Random(len(text))
    for _ in range(20):  # any cut into pieces gives the same calls and content
        stream = ToolCallStream(parser)
        events = [e for p in pieces(text, rng) for e in stream.feed(p)] + stream.finish()
        c2, calls2 = collect(events)
        assert ((c2 or None) if calls2 else c2) == content
        assert [(c.name, c.arguments) for c in calls2] == [(c.name, c.arguments) for c in got]


def assemble(deltas: list[P.DeltaMessage]) -> dict:
    """A stream's deltas put together as a client does, checking OpenAI's order on the way."""
    out = {"content": "", "reasoning": "", "calls": {}}
    for d in deltas:
        out["content"] += d.content or ""
        out["reasoning"] += d.reasoning_content or ""
        for t in d.tool_calls or []:
            if t.index not in out["calls"]:
                assert t.id and t.type == "function" and t.function.name and t.function.arguments == ""
                assert t.index == len(out["calls"])
                out["calls"][t.index] = [t.function.name, ""]
            else:
                assert t.id is None and t.function.name is None
                out["calls"][t.index][1] += t.function.arguments
    return out


@pytest.mark.parametrize("reasoning", [None, "qwen3", "deepseek_r1"])
def test_chat_output_streams_what_the_whole_message_holds(reasoning):
    """Reasoning first, then calls: the deltas of a stream cut anywhere assemble into the
    non-streamed message; calls make finish_reason "tool_calls". (A malformed call whose name
    was read has been streamed already: the whole message keeps it as text instead.)"""
    rng = random.Random(7)
    for parser, text, _, calls in RECORDED:
        if parser != "hermes" or (not calls and '"arguments"' in text):
            continue
        full = ("<think>\nThe user wants the weather.\n</think>\n\n" if reasoning else "") + text
        msg, reason = ChatOutput(reasoning, "hermes").message(full, "stop")
        assert reason == ("tool_calls" if calls else "stop")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []] == calls
        assert msg.reasoning_content == ("\nThe user wants the weather.\n" if reasoning else None)
        out = ChatOutput(reasoning, "hermes")
        deltas = [d for p in pieces(full, rng) for d in out.feed(p)] + out.finish()
        got = assemble(deltas)
        assert got["content"] == (msg.content or "") and got["reasoning"] == (msg.reasoning_content or "")
        assert [tuple(v) for v in got["calls"].values()] == [(c.function.name, c.function.arguments)
                                                            for c in msg.tool_calls or []]
        assert out.finish_reason("stop") == reason and out.finish_reason("length") == "length"


def test_a_call_streams_its_name_first_then_argument_fragments():
    out = ChatOutput(None, "hermes")
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>'
    deltas = [d for ch in text for d in out.feed(ch)] + out.finish()
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].function.arguments == ""
    assert len(calls) > 3 and all(t.id is None for t in calls[1:])   # fragments as they arrive
    assert "".join(t.function.arguments for t in calls) == '{"location": "Paris", "unit": "celsius"}'
    assert not any(d.content for d in deltas)


@pytest.mark.parametrize("parser,text,reasoning,content", [
    ("deepseek_r1", "<think>step one</think>\n\nThe answer is 4.", "step one", "The answer is 4."),
    ("deepseek_r1", "step one, the prompt opened the block</think>4", "step one, the prompt opened the block", "4"),
    ("deepseek_r1", "thinking, cut by max_tokens", "thinking, cut by max_tokens", ""),
    ("qwen3", "<think>\nhmm\n</think>\n\nParis.", "\nhmm\n", "Paris."),
    ("qwen3", "Paris, no thinking (enable_thinking false).", "", "Paris, no thinking (enable_thinking false)."),
    ("qwen3", "<think>cut", "cut", ""),
    ("qwen3", "a </think> b", "", "a </think> b"),
])
def test_reasoning_splitter(parser, text, reasoning, content):
    rng = random.Random(3)
    for cut in [[text]] + [pieces(text, rng) for _ in range(20)]:
        split = ReasoningSplitter(parser)
        parts = [split.feed(p) for p in cut] + [split.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == (reasoning, content)
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningSplitter("granite")


@pytest.fixture(scope="module")
def lltok(tmp_path_factory):
    """An llguidance tokenizer over a small byte-level BPE (what the engine's Grammars builds)."""
    import string

    import llguidance
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = sorted({c for w, _ in tok.pre_tokenizer.pre_tokenize_str(string.printable) for c in w})
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(['{"name": "get_weather", "arguments": {"location": "Paris"}}'] * 5, trainer)
    return llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=[0])


def matches(lltok, grammar: str, text: str) -> bool:
    from llguidance import LLMatcher
    m = LLMatcher(lltok, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(lltok.tokenize_str(text)) and not m.is_error() and m.is_accepting()


def test_forced_call_grammar_takes_exactly_the_valid_calls(lltok):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris", "unit": "celsius"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    one = call_grammar([WEATHER, TIME], "hermes", one=True)
    many = call_grammar([WEATHER, TIME], "hermes", one=False)
    assert matches(lltok, one, call) and matches(lltok, one, other)
    assert not matches(lltok, one, call + "\n" + other) and matches(lltok, many, call + "\n" + other)
    for bad in (call.replace("celsius", "kelvin"), call.replace("get_weather", "get_wether"),
                call.replace('"Paris"', '"Paris, in France"'), call.replace(', "unit": "celsius"', ', "x": 1'),
                call.replace(": ", ":"), "I will call " + call):
        assert not matches(lltok, many, bad), bad
    qwen3, r1 = (call_grammar([WEATHER, TIME], "hermes", True, reasoning) for reasoning in ("qwen3", "deepseek_r1"))
    think = "<think>\nthe user wants </tool_call> the time\n</think>\n\n"
    assert matches(lltok, qwen3, other) and matches(lltok, qwen3, think + other)
    assert matches(lltok, r1, think + other) and matches(lltok, r1, "opened in the prompt</think>" + other)
    assert not matches(lltok, r1, other) and not matches(lltok, qwen3, "<think>x</think>text" + other)
    llama = call_grammar([WEATHER], "llama3_json", one=False)
    assert matches(lltok, llama, '{"name": "get_weather", "parameters": {"location": "Oslo"}}; '
                                 '{"name": "get_weather", "parameters": {"location": "Rome"}}')
    assert not matches(lltok, llama, '{"name": "get_weather", "arguments": {"location": "Oslo"}}')


def test_templates_with_and_without_a_tool_format(tmp_path):
    """The fallback (a template that ignores tools): the tools in the system turn, a call in
    Hermes' syntax, answers in <tool_response> user turns; a template that reads tools gets them
    natively (arguments as objects, tojson unescaped); an adapter's list of named templates."""
    from multilora.engine.tokenizer import Tokenizer, read_chat_template, template_has_tools
    plain = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    native = ("{% for t in tools or [] %}{{ t | tojson }}\n{% endfor %}{% for m in messages %}{{ m.role }}: "
              "{{ m.content }}{% for c in m.tool_calls or [] %}[{{ c.function.arguments | tojson }}]{% endfor %}"
              "\n{% endfor %}")
    assert not template_has_tools(plain) and template_has_tools(native)
    call = P.ToolCall(id="call_1", function=P.FunctionCall(name="get_time", arguments="{}"))
    msgs = [P.ChatMessage(role="user", content="time?"), P.ChatMessage(role="assistant", tool_calls=[call]),
            P.ChatMessage(role="tool", tool_call_id="call_1", content="<noon>"),
            P.ChatMessage(role="tool", tool_call_id="call_2", content="ok")]

    class Plan:
        tools, parser = [TIME], "hermes"
        native = False
    rendered, tools = template_messages(msgs, Plan)
    assert tools is None and rendered[0]["role"] == "system" and rendered[0]["content"].startswith("# Tools")
    assert json.dumps(TIME) in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant",
                           "content": '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'}
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n<noon>\n</tool_response>\n"
                                                      "<tool_response>\nok\n</tool_response>"}
    in_user, _ = template_messages(msgs, Plan, preamble_in_user=True)
    assert in_user[0]["role"] == "user" and in_user[0]["content"].startswith("# Tools") \
        and in_user[0]["content"].endswith("\n\ntime?")
    Plan.native = True
    rendered, tools = template_messages(msgs, Plan)
    assert tools == [TIME] and rendered[1]["tool_calls"][0]["function"]["arguments"] == {}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": native}, {"name": "rag", "template": plain}]}))
    assert read_chat_template(tmp_path) == native
    tok = Tokenizer.__new__(Tokenizer)
    tok.chat_template, tok.bos_token, tok.eos_token = plain, None, None
    text = tok.apply_chat_template(rendered, tools=tools, template=native, add_generation_prompt=False)
    assert text.startswith(json.dumps(TIME) + "\n") and "assistant: [{}]" in text and "tool: <noon>" in text
    # what transformers gives templates: tojson's arguments, strftime_now, {% generation %}, loop controls
    extras = ("{{ tools[0] | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}|{% for m in messages %}"
              "{% if m.role == 'tool' %}{% break %}{% endif %}{% generation %}{{ m.role }},{% endgeneration %}"
              "{% endfor %}")
    text = tok.apply_chat_template(rendered, tools=tools, template=extras)
    assert text == json.dumps(TIME, indent=2) + "|4|user,assistant,"


@pytest.mark.parametrize("parser,sep,call", [
    ("hermes", "\n", '<tool_call>\n{"name": "get_weather", "arguments": {"location": "Paris"}}\n</tool_call>'),
    ("llama3_json", "; ", '{"name": "get_weather", "parameters": {"location": "Paris"}}'),
])
def test_a_repeated_call_ends_the_output(parser, sep, call):
    """A small model given room for several calls repeats one: the repeat is dropped unsent,
    with all that follows, and the output is over; a call that only starts like an earlier one
    is held back until it differs, then sent."""
    other = call.replace("Paris", "Pau")
    text = sep.join([call, other, call, other]) + sep + call[:20]
    content, calls = parse_tool_calls(parser, text)
    assert content is None and [json.loads(c.arguments)["location"] for c in calls] == ["Paris", "Pau"]
    out = ChatOutput(None, parser)
    deltas, over_at = [], None
    for i, ch in enumerate(text):
        deltas += out.feed(ch)
        if out.over and over_at is None:
            over_at = i
    assert over_at == len(sep.join([call, other, call])) - 1
    got = assemble(deltas + out.finish())
    assert [json.loads(a)["location"] for _, a in got["calls"].values()] == ["Paris", "Pau"]
    msg, reason = out.result("stop")
    assert reason == "tool_calls" and len(msg.tool_calls) == 2
    one = ToolCallStream(parser, max_calls=1)  # parallel_tool_calls false: over after the first call
    content, calls = collect(one.feed(text) + one.finish())
    assert one.over and content == "" and [c.name for c in calls] == ["get_weather"]


def test_forced_arguments_take_no_properties_their_schema_does_not_list(lltok):
    """An object schema silent on additionalProperties is closed for a forced call (xgrammar's
    strict mode does the same), nested ones and $defs included; one that says otherwise keeps it."""
    from multilora.server.tools import closed
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "object", "additionalProperties": True, "properties": {}}},
              "$defs": {"d": {"type": "object", "properties": {"e": {"type": "string"}}}}}
    got = closed(schema)
    assert got["additionalProperties"] is False and got["properties"]["a"]["additionalProperties"] is False
    assert got["properties"]["c"]["additionalProperties"] is True and got["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # not changed in place
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    grammar = call_grammar([tool], "hermes", one=True)
    wrap = '<tool_call>\n{{"name": "f", "arguments": {}}}\n</tool_call>'.format
    assert matches(lltok, grammar, wrap('{"a": {"b": 1}, "c": {"x": 2}}'))
    assert not matches(lltok, grammar, wrap('{"a": {"b": 1}, "z": 1}'))
    assert not matches(lltok, grammar, wrap('{"a": {"b": 1, "z": 1}}'))


def test_fuzzed_outputs_never_break_the_readers():
    """Hypothesis over outputs made of the syntaxes' pieces, cut anywhere: the readers never
    raise, every call they report has an object of arguments, and the reasoning split of a
    stream is the whole text's."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings, strategies as st
    pieces_ = st.sampled_from(["<tool_call>", "</tool_call>", "<tool_", "\n", " ", '{"name": "f", ', '"arguments": ',
                               '"parameters": ', '{"a": "}\\""}', "}", "{", "]", '"', "\\", ";", "<|python_tag|>",
                               "<think>", "</think>", "</th", "text", "é"])
    texts = st.lists(pieces_, max_size=14).map("".join)

    @settings(max_examples=150, deadline=None, database=None, derandomize=True)
    @given(texts, st.lists(st.integers(1, 7), min_size=1, max_size=8))
    def one(text, cuts):
        parts, i, k = [], 0, 0
        while i < len(text):
            parts.append(text[i:i + cuts[k % len(cuts)]])
            i += cuts[k % len(cuts)]
            k += 1
        for parser in ("hermes", "llama3_json"):
            _, calls = parse_tool_calls(parser, text)
            stream = ToolCallStream(parser)
            _, streamed = collect([e for p in parts for e in stream.feed(p)] + stream.finish())
            for c in calls + streamed:
                assert isinstance(json.loads(c.arguments), dict)
        for reasoning in ("qwen3", "deepseek_r1"):
            whole, split = ReasoningSplitter(reasoning), ReasoningSplitter(reasoning)
            w = [whole.feed(text), whole.finish()]
            s = [split.feed(p) for p in parts] + [split.finish()]
            assert ("".join(r for r, _ in w), "".join(c for _, c in w)) == \
                ("".join(r for r, _ in s), "".join(c for _, c in s))
    one()
