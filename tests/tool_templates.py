"""Chat templates and reply texts of each tool-call format, written from the published
formats (Qwen3-Coder's, GLM's, Mistral's, Kimi K2's, Hermes/Qwen 2.5's, Gemma 4's,
LFM2's pythonic, gpt-oss's Harmony), for tokenizers and tiny model folders that stand
in for those families: mlx-lm infers each format from its template as it would from
the real one.

`TEMPLATES[name]` is a ChatML-shaped template whose tools section and earlier calls
are rendered in that format; `emit(name, calls, before)` is the text such a model
writes for `calls` ([(name, arguments)]) after the text `before`.
"""

from __future__ import annotations

import json

# Every format's markers; the ones real vocabularies hold as special tokens are special.
SPECIAL = ["<|im_start|>", "<|im_end|>", "[UNK]", "<tool_call>", "</tool_call>",
           "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "[TOOL_CALLS]", "[ARGS]",
           "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_call>", "<tool_call|>",
           '<|"|>', "<|tool_call_start|>", "<think>", "</think>"]  # fmt: skip
HARMONY_SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                   "<|return|>", "<|call|>", "[UNK]"]  # fmt: skip

_CALLS = {
    "qwen3_coder": (  # HF renders with trim_blocks: a newline after a block tag goes
        "<tool_call>\n<function={{ tool_call.name }}>\n"
        "{% for k, v in tool_call.arguments.items() %}{{ '<parameter=' + k + '>\\n' }}"
        "{{ v if v is string else v | tojson }}{{ '\\n</parameter>\\n' }}{% endfor %}"
        "{{ '</function>\\n</tool_call>' }}"
    ),
    "glm47": (
        "<tool_call>{{ tool_call.name }}{% for k, v in tool_call.arguments.items() %}"
        "<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson }}"
        "</arg_value>{% endfor %}</tool_call>"
    ),
    "mistral": "[TOOL_CALLS]{{ tool_call.name }}[ARGS]{{ tool_call.arguments | tojson }}",
    "kimi_k2": (
        "<|tool_calls_section_begin|><|tool_call_begin|>{{ call.id }}"  # the model's own id
        "<|tool_call_argument_begin|>{{ tool_call.arguments | tojson }}<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    ),
    "json_tools": (
        '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
        "{{ tool_call.arguments | tojson }}}\n</tool_call>"
    ),
    "gemma4": (
        "<|tool_call>call:{{ tool_call.name }}{{ '{' }}{% for k, v in "
        'tool_call.arguments.items() %}{{ k }}:{% if v is string %}<|"|>{{ v }}<|"|>'
        "{% else %}{{ v | tojson }}{% endif %}{% if not loop.last %},{% endif %}{% endfor %}"
        "{{ '}' }}<tool_call|>"
    ),
    "pythonic": (
        "<|tool_call_start|>[{{ tool_call.name }}({% for k, v in tool_call.arguments.items() %}"
        "{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %})]"
        "<|tool_call_end|>"
    ),
    "llama3_json": (
        "{{ '{\"name\": \"' + tool_call.name + '\", ' }}{{ '\"parameters\": ' }}"
        "{{ tool_call.arguments | tojson }}{{ '}' }}"
    ),
    "harmony": (
        "<|start|>assistant<|channel|>commentary to=functions.{{ tool_call.name }} "
        "<|constrain|>json<|message|>{{ tool_call.arguments | tojson }}<|call|>"
    ),
}


def template(name: str) -> str:
    """A ChatML-shaped template whose tools and earlier calls are in format `name`."""
    if name == "harmony":
        return _harmony_template()
    call = _CALLS[name]
    return (
        "{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n"
        "{% endfor %}<|im_end|>\n{% endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
        "{% if m.content %}{{ m.content }}{% endif %}"
        "{%- for call in m.tool_calls %}"
        "{%- set tool_call = call.function if call.function else call %}"
        f"{call}{{% endfor %}}<|im_end|>\n"
        "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _harmony_template() -> str:
    call = _CALLS["harmony"]
    return (
        "{%- if tools %}<|start|>developer<|message|># Tools\n{% for t in tools %}"
        "{{ t | tojson }}\n{% endfor %}Reasoning: {{ reasoning_effort | default('medium') }}"
        "<|end|>{% endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'assistant' and m.tool_calls %}"
        "{%- for tool_call in m.tool_calls %}"
        "{%- if tool_call.function %}{% set tool_call = tool_call.function %}{% endif %}"
        f"{call}{{% endfor %}}"
        "{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
        "{{ m.content }}<|end|>"
        "{%- elif m.role == 'tool' %}<|start|>functions.x to=assistant<|channel|>commentary"
        "<|message|>{{ m.content }}<|end|>"
        "{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}"
        "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
    )


def _text(v) -> str:
    return v if isinstance(v, str) else json.dumps(v)


def emit(name: str, calls: list[tuple[str, dict]], before: str = "") -> str:
    """What a model of format `name` writes for `calls` after the text `before`."""
    if name == "qwen3_coder":
        body = "\n".join(
            f"<tool_call>\n<function={n}>\n"
            + "".join(f"<parameter={k}>\n{_text(v)}\n</parameter>\n" for k, v in a.items())
            + "</function>\n</tool_call>"
            for n, a in calls
        )
    elif name == "glm47":
        body = "".join(
            f"<tool_call>{n}"
            + "".join(
                f"<arg_key>{k}</arg_key><arg_value>{_text(v)}</arg_value>" for k, v in a.items()
            )
            + "</tool_call>"
            for n, a in calls
        )
    elif name == "mistral":
        body = "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    elif name == "kimi_k2":
        body = (
            "<|tool_calls_section_begin|>"
            + "".join(
                f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a)}"
                "<|tool_call_end|>"
                for i, (n, a) in enumerate(calls)
            )
            + "<|tool_calls_section_end|>"
        )
    elif name == "json_tools":
        body = "\n".join(
            f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>"
            for n, a in calls
        )
    elif name == "gemma4":

        def value(v):
            return f'<|"|>{v}<|"|>' if isinstance(v, str) else json.dumps(v)

        body = "".join(
            f"<|tool_call>call:{n}{{"
            + ",".join(f"{k}:{value(v)}" for k, v in a.items())
            + "}<tool_call|>"
            for n, a in calls
        )
    elif name == "pythonic":
        body = (
            "<|tool_call_start|>["
            + ", ".join(
                f"{n}(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items()) + ")"
                for n, a in calls
            )
            + "]<|tool_call_end|>"
        )
    elif name == "llama3_json":  # one call a reply
        [(n, a)] = calls
        body = json.dumps({"name": n, "parameters": a})
    elif name == "harmony":  # one call a reply: <|call|> ends generation
        [(n, a)] = calls
        lead = f"<|channel|>final<|message|>{before}<|end|><|start|>assistant" if before else ""
        return (
            f"{lead}<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>"
            + json.dumps(a)
        )
    else:
        raise KeyError(name)
    return before + body
