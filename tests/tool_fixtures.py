"""Tool-aware chat templates for the tiny test tokenizer, written in the style of the models' own (Hermes /
Qwen 2.5: tools in <tools></tools>, calls in <tool_call></tool_call>, results in <tool_response>; Llama 3.1:
tools as JSON in the system turn, calls as {"name", "parameters"} JSON, results in an ipython turn), the
tools the tests call, and a tiny model whose tokenizer carries one of the templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|end|>\n'
    "{%- elif messages[0].role == 'system' %}<|system|>\n{{ messages[0].content }}<|end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' and loop.first %}"
    "{%- elif m.role == 'assistant' %}<|assistant|>\n{{ m.content or '' }}"
    "{%- for call in m.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|end|>\n"
    "{%- elif m.role == 'tool' %}<|user|>\n<tool_response>\n{{ m.content }}\n</tool_response><|end|>\n"
    "{%- else %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{%- if tools %}<|system|>\nEnvironment: ipython\n"
    "You have access to the following functions. To call a function, respond with JSON for a function call "
    'in the form {"name": function name, "parameters": dictionary of argument name and its value}.\n'
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n"
    "{%- for call in m.tool_calls %}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{%- if not loop.last %}; {% endif %}{%- endfor %}<|end|>\n"
    "{%- elif m.role == 'tool' %}<|ipython|>\n{{ m.content }}<|end|>\n"
    "{%- else %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TEMPLATES = {"hermes": HERMES_TEMPLATE, "llama3_json": LLAMA3_TEMPLATE}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                           "b": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def with_chat_template(model_dir: Path, dest: Path, template: str) -> Path:
    """A copy of `model_dir` whose tokenizer carries `template`."""
    shutil.copytree(model_dir, dest)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (dest / extra).unlink(missing_ok=True)
    return dest
