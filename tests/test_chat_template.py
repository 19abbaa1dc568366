"""A chat template renders as transformers' `apply_chat_template` renders it (the oracle: its
`render_jinja_template`), down to the helpers templates call: `tojson`, `raise_exception`, `strftime_now`, loop
controls and `{% generation %}`."""

from __future__ import annotations

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from wkvm.chat_template import ChatTemplate, ChatTemplateError

# a tool-calling template in the style of Llama 3.1's and Qwen's: the date, the tools as JSON, turns that must
# alternate, a loop that stops at the first tool result, and the assistant's text marked for training masks
TEMPLATE = """{{ bos_token }}Today: {{ strftime_now("%d %b %Y") }}
{% if tools %}Tools:
{% for t in tools %}{{ t | tojson }}
{{ t | tojson(indent=2) }}
{% endfor %}{% endif %}
{% for m in messages %}
{% if m['role'] == 'tool' %}(tool answered){% break %}{% endif %}
{% if m['role'] == 'system' %}{% continue %}{% endif %}
{% if (m['role'] == 'user') != (loop.index0 % 2 == (1 if messages[0]['role'] == 'system' else 0)) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% if m['role'] == 'assistant' %}{% generation %}<a>{{ m['content'] }}</a>{% endgeneration %}
{% else %}<u>{{ m['content'] }}</u>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<a>{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Gets the user's weather <now> & "
                                                                           "tomorrow in Zürich",  # fmt: skip
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def hf(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    rendered, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=TEMPLATE,
                                        add_generation_prompt=add_generation_prompt, bos_token="<s>")  # fmt: skip
    return rendered[0]


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Rain?"}],
    [{"role": "user", "content": "Rain?"}, {"role": "assistant", "content": "Let me look."},
     {"role": "tool", "content": "{}"}, {"role": "user", "content": "never rendered"}],
])  # fmt: skip
def test_a_template_renders_as_transformers_renders_it(messages):
    template = ChatTemplate(TEMPLATE, special_tokens={"bos_token": "<s>"})
    for tools in (None, TOOLS):
        ours = template.render(messages, tools=tools)
        assert ours == hf(messages, tools)
    # the tool's JSON as written: its keys in their order, no HTML or ASCII escapes (Jinja's own tojson sorted the
    # keys and wrote the apostrophe as \\u0027, < as \\u003c, ü as \\u00fc)
    assert '"description": "Gets the user\'s weather <now> & tomorrow in Zürich", "parameters": {"type": "object"' in (
        template.render(messages, tools=TOOLS))


def test_raise_exception_is_the_templates_own_message():
    messages = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(Exception, match="roles must alternate"):
        hf(messages)
    with pytest.raises(ChatTemplateError, match="the model's chat template failed: Conversation roles must "
                                                "alternate user/assistant/user/assistant/..."):  # fmt: skip
        ChatTemplate(TEMPLATE, special_tokens={"bos_token": "<s>"}).render(messages)


def test_a_template_that_cannot_take_the_messages_is_a_chat_template_error():
    """Not only TemplateError: a TypeError or OverflowError inside a template (tojson of something that is no JSON, a
    huge range) is the template's failure on this input, a 400, not a 500."""
    for source in ("{{ foo | tojson }}", "{{ range(10 ** 9) | list | length }}"):
        with pytest.raises(ChatTemplateError, match="the model's chat template failed on these messages"):
            ChatTemplate(source).render([{"role": "user", "content": "hi"}])


def test_a_chat_template_json_beside_the_jinja_is_read_strictly(tmp_path):
    """Review (session 38): `{"stop": "</s>"}` had become four one-character stop strings (answers cut at every
    "s"), a JSON list was an AttributeError traceback, and a file that is not JSON a message naming no file."""
    from wkvm.chat_template import load_chat_template

    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}")
    extra = tmp_path / "chat_template.json"
    extra.write_text('{"stop": ["</s>"]}')
    assert load_chat_template(tmp_path).stop == ["</s>"]
    extra.write_text('{"stop": "</s>"}')
    with pytest.raises(ValueError, match="must be a list of non-empty strings"):
        load_chat_template(tmp_path)
    extra.write_text("{stop")
    with pytest.raises(ValueError, match="chat_template.json: not JSON"):
        load_chat_template(tmp_path)
    extra.write_text("[1, 2]")
    assert load_chat_template(tmp_path).stop == []
    # a template file that is not UTF-8, and tokenizer_config's chat_template of no template's type, are errors
    # naming the file (the codec's message named none; the number had been dropped without a word; loading hunt,
    # session 49)
    (tmp_path / "chat_template.jinja").write_bytes(b"{{ messages }}\xff")
    with pytest.raises(ValueError, match="chat_template.jinja: not UTF-8 text"):
        load_chat_template(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": 5}')
    with pytest.raises(ValueError, match="tokenizer_config.json: \"chat_template\" must be a template"):
        load_chat_template(tmp_path)


def test_named_templates_render_as_transformers_chooses_them(tmp_path):
    """tokenizer_config.json's `chat_template` as transformers' list of named templates had been ignored (the
    family's default format rendered instead): "default" renders a chat, "tool_use" one with tools, as
    `apply_chat_template` chooses; with no "default" both refuse. transformers' own choice is the oracle."""
    import json

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from wkvm.chat_template import load_chat_template

    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    named = [{"name": "default", "template": "D:{% for m in messages %}{{ m['content'] }}{% endfor %}"},
             {"name": "tool_use", "template": TEMPLATE}]  # fmt: skip
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": named, "bos_token": "<s>"}))
    ours = load_chat_template(tmp_path)
    ours.special_tokens = {"bos_token": "<s>"}
    theirs = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    messages = [{"role": "user", "content": "Hi"}]
    for tools in (None, TOOLS):
        want = theirs.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.render(messages, tools=tools) == want
    assert ours.render(messages, tools=TOOLS).startswith("<s>Today") and ours.render(messages) == "D:Hi"
    config.write_text(json.dumps({"chat_template": named[1:]}))
    with pytest.raises(ValueError, match="named tool_use and none \"default\""):
        load_chat_template(tmp_path)
    with pytest.raises(ValueError, match="No chat template is set|default"):
        PreTrainedTokenizerFast.from_pretrained(str(tmp_path)).apply_chat_template(messages, tokenize=False)
    # transformers' newer layout: chat_template.jinja and additional_chat_templates/tool_use.jinja
    config.unlink()
    (tmp_path / "chat_template.jinja").write_text(named[0]["template"])
    (tmp_path / "additional_chat_templates").mkdir()
    (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(TEMPLATE)
    ours = load_chat_template(tmp_path)
    assert ours.render(messages) == "D:Hi" and ours.render(messages, tools=TOOLS).startswith("Today")


def test_no_tool_arguments_render_as_an_empty_object_and_variables_win_over_special_tokens():
    """Review (session 39): an earlier call's missing, null, "" or "null" arguments rendered as `null` (vLLM gives the
    template {}); a chat_template_kwargs name that is a special token (bos_token) was a TypeError 400 (transformers
    lets the request's value win)."""
    from wkvm.chat_template import template_messages

    for arguments in (None, "", "null", "  "):
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        m = template_messages([{"role": "assistant", "content": "", "tool_calls": [call]}])
        assert m[0]["tool_calls"][0]["function"]["arguments"] == {}, arguments
    t = ChatTemplate("{{ bos_token }}{{ messages[0].content }}", special_tokens={"bos_token": "<s>"})
    assert t.render([{"role": "user", "content": "x"}]) == "<s>x"
    assert t.render([{"role": "user", "content": "x"}], variables={"bos_token": "B"}) == "Bx"
    from wkvm.chat_template import TemplateVariableError

    with pytest.raises(TemplateVariableError, match="chat_template_kwargs must be a dict"):  # it had blamed the
        t.render([{"role": "user", "content": "x"}], variables="x")  # type: ignore[arg-type]  # messages (hunt, 49)
