"""The chat templates a made model can carry: ``plain`` (role lines, no tools), and two
with tools support in the styles open models use, so the tool-call path runs end to end on
a made model: ``qwen`` (Hermes-style ``<tool_call>`` blocks, tools listed in the system
turn, results as ``<tool_response>`` in a user turn) and ``llama3`` (Llama 3.1's custom
tools: the functions in the first user turn, a call as one JSON object with
``parameters``, results in an ``ipython`` turn).

The markers are plain text (the shipped tokenizers have no chat tokens) and each turn ends
with the model's EOS token, so a made model's EOS ends its turn. The tool-call format the
gateway reads is chosen from the template itself (producer/wire/tools/formats.py).
"""

from __future__ import annotations

PLAIN = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

# Hermes/Qwen style: a tool call is <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>.
QWEN = """{{ bos_token }}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' %}
{%- if tools %}
{{- '<|im_start|>system\\n' }}{% if system %}{{ system + '\\n\\n' }}{% endif %}
{{- '# Tools\\n\\nYou may call one or more functions to help with the request. The functions, '
    'one JSON signature a line, within <tools></tools>:\\n<tools>\\n' }}
{%- for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}
{{- '</tools>\\n\\nFor each call, write a JSON object with the function name and arguments '
    'within <tool_call></tool_call>:\\n<tool_call>\\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\\n</tool_call>' + eos_token + '\\n' }}
{%- elif system %}
{{- '<|im_start|>system\\n' + system + eos_token + '\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{ eos_token + '\\n' }}{% endif %}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}{% if message.content %}{{ '\\n' + message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson }}{{ '}\\n</tool_call>' }}
{%- endfor %}
{{- eos_token + '\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + eos_token + '\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"""

# Llama 3.1 style: a call is the whole answer, {"name": ..., "parameters": {...}}, one a turn.
LLAMA3 = """{{ bos_token }}
{%- set system = messages[0].content if messages and messages[0].role == 'system' else '' %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}{{ 'Environment: ipython\\n\\n' }}{% endif %}
{{- system + eos_token }}
{%- set tools_at = namespace(done=not tools) %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'user' and not tools_at.done %}
{%- set tools_at.done = true %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, respond '
    'with a JSON for a function call with its proper arguments that best answers the '
    'prompt.\\n\\nRespond in the format {"name": function name, "parameters": dictionary of '
    'argument name and its value}. Do not use variables.\\n\\n' }}
{%- for tool in tools %}{{ tool | tojson(indent=4) }}{{ '\\n\\n' }}{% endfor %}
{{- message.content + eos_token }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{%- if message.tool_calls | length != 1 %}
{{- raise_exception('this template holds one tool call a turn') }}
{%- endif %}
{%- set call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n{"name": "' + call.name + '", '
    '"parameters": ' }}{{ call.arguments | tojson }}{{ '}' + eos_token }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + eos_token }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content
    + eos_token }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

TEMPLATES = {"plain": PLAIN, "qwen": QWEN, "llama3": LLAMA3}
