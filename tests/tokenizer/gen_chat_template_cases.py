"""Writes chat_template_cases.inc: real chat templates of several model families, conversations,
and what Python's jinja2 renders for them with the settings transformers uses (sandboxed,
trim_blocks, lstrip_blocks, loop controls, raise_exception, its own tojson). The C++ test compares
lt2::ChatTemplate against these strings, so it needs no Python.

Run: python3 tests/tokenizer/gen_chat_template_cases.py > tests/tokenizer/chat_template_cases.inc
"""
import json

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception

TOKENS = {
    "chatml": dict(bos_token="<|im_start|>", eos_token="<|im_end|>"),
    "llama3": dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"),
    "llama2": dict(bos_token="<s>", eos_token="</s>"),
    "gemma": dict(bos_token="<bos>", eos_token="<eos>"),
    "phi3": dict(bos_token="<s>", eos_token="<|endoftext|>"),
}

QWEN3 = r'''{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
'''

# (name, token set, template). Published chat templates of each model's tokenizer_config.json
# (Qwen3's as its official template; SmolLM's verbatim, with newlines inside its string literals,
# where the others may differ in writing a newline as a literal's \n escape); "ouro-thinking" is a
# public Ouro-1.4B-Thinking template with an enable_thinking switch; "features" and "whitespace"
# exercise the rest of the supported subset.
TEMPLATES = [
    ("smollm-instruct", "chatml",
     "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    ("qwen2-instruct", "chatml",
     "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"),
    ("llama3-instruct", "llama3",
     "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"),
    ("llama2-chat", "llama2",
     "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"),
    ("mistral-instruct", "llama2",
     "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"),
    ("gemma-it", "gemma",
     "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"),
    ("phi3-mini", "phi3",
     "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}"),
    ("qwen3", "chatml", QWEN3),
    ("ouro-thinking", "chatml",
     "{# Ouro chat template with enable_thinking support. #}\n{# When enable_thinking=True, prepends <think>\\n to trigger CoT reasoning. #}\n{%- if messages[0]['role'] == 'system' -%}\n    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n{%- endif -%}\n{%- for message in messages -%}\n    {%- if message.role == 'system' and loop.first -%}\n        {# Skip #}\n    {%- else -%}\n        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n    {%- endif -%}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking is defined and enable_thinking is true -%}\n        {{- '<think>\\n' }}\n    {%- endif -%}\n{%- endif -%}\n"),
    ("features", "chatml",
     """{%- set ns = namespace(n_user=0, last_user=-1, sys='') -%}
{%- macro turn(role, text, suffix='\\n') -%}
<|{{ role | upper }}|>{{ text }}{{ suffix }}
{%- endmacro -%}
{%- for m in messages if m.role != 'system' -%}
  {%- if m.role == 'user' %}{% set ns.n_user = ns.n_user + 1 %}{% set ns.last_user = loop.index0 %}{% endif -%}
{%- endfor -%}
{%- if messages[0].role == 'system' %}{% set ns.sys = messages[0].content %}{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif -%}
{{ bos_token ~ '#' ~ ns.n_user ~ '/' ~ (rest | length) ~ ' last=' ~ ns.last_user }}
{{ {'system': ns.sys, 'n': ns.n_user, 'f': 2.5, 'ok': true, 'none': none, 'list': [1, 'a"b', 'é']} | tojson }}
{{ rest | map(attribute='role') | join(',') }} {{ rest | selectattr('role', 'equalto', 'user') | list | length }}
{{ messages[-1].content[:5] ~ '|' ~ messages[-1]['content'][::-1] ~ '|' ~ ('a,b,,c'.split(',')) ~ '|' ~ ' x y '.strip() }}
{% for m in rest %}
  {% if loop.first %}[{% endif %}{{ turn(m.role, m.content | trim, suffix=(';' if not loop.last else '')) }}{% if loop.last %}]{% endif %}
{% else %}
  empty
{% endfor %}
{% for k, v in {'a': 1, 'b': [2, 3]}.items() %}{{ k }}={{ v }}{{ ', ' if not loop.last }}{% endfor %}

{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 1.0 }} {{ 1e20 }} {{ 3 * 'ab' }} {{ 'x' in 'xyz' }} {{ 3 not in [1, 2] }}
{{ (none | default('dflt')) }} {{ undefined_thing | default('dflt') }} {{ '' | default('e', true) }} {{ 'Hello World' | lower | replace('o', '0') }}
{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{{ loop.index }}{{ loop.revindex }}{% endfor %}

{{ 'yes' if messages | length > 2 else 'no' }} {{ messages[0].content.startswith(('Be', 'You')) }} {{ (messages | last).role }} {{ 'a-b' is string }} {{ 4 is divisibleby 2 }} {{ nothing is not defined }}
{% set block %}captured {{ messages | length }}{% endset %}{{ block | title }} {{ [3, 1, 2] | sort | list }} {{ {'b': 1, 'a': 2} | tojson(indent=2, sort_keys=true) }}
{%- if add_generation_prompt %}

{{ turn('assistant', '') }}
{%- endif %}"""),
    ("whitespace", "chatml",
     """<start>
  {% for m in messages %}
    {# a comment on its own line #}
    {{ m.role }}:
    {%- if m.content %} {{ m.content }}{% endif %}

  {%+ if loop.last %}  (last){% endif %}
  {% endfor %}
  {{- ' after' -}}
     {% if add_generation_prompt %}
GEN
{% endif %}
end
"""),
]

CONVERSATIONS = {
    "system": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello, who are you?"},
        {"role": "assistant", "content": " I am a looped model. "},
        {"role": "user", "content": "Say \"hi\" in\tFrench\n, please."},
    ],
    "no_system": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "What's 2+2? Ünïcödé ✓"},
    ],
    "thinking": [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6."},
    ],
    "wrong_order": [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two"},
    ],
}


def cpp(s):
    assert ")lt2\"" not in s
    return 'R"lt2(' + s + ')lt2"'


print("// Generated by gen_chat_template_cases.py (Python jinja2 " + __import__("jinja2").__version__ + "); do not edit.")
print("// {template name, its token set's bos/eos, the template}")
print("const ChatTemplateSource kTemplates[] = {")
for name, toks, source in TEMPLATES:
    t = TOKENS[toks]
    print(f'    {{"{name}", {cpp(t["bos_token"])}, {cpp(t["eos_token"])}, {cpp(source)}}},')
print("};")
print("const ChatConversation kConversations[] = {")
for name, msgs in CONVERSATIONS.items():
    print(f'    {{"{name}", {{')
    for m in msgs:
        print(f'        {{{cpp(m["role"])}, {cpp(m["content"])}}},')
    print("    }},")
print("};")
print("// {template, conversation, add_generation_prompt, extra variables (JSON), rendered, or the error}")
print("const ChatTemplateCase kCases[] = {")
for name, toks, source in TEMPLATES:
    for conv, msgs in CONVERSATIONS.items():
        for gen in (False, True):
            extras = {"ouro-thinking": ({}, {"enable_thinking": True}), "qwen3": ({}, {"enable_thinking": False})}
            for extra in extras.get(name, ({},)):
                ctx = dict(TOKENS[toks], messages=msgs, add_generation_prompt=gen, tools=None, documents=None, **extra)
                try:
                    out, err = env.from_string(source).render(**ctx), ""
                except TemplateError as e:
                    out, err = "", str(e)
                g = "true" if gen else "false"
                print(f'    {{"{name}", "{conv}", {g}, {cpp(json.dumps(extra))}, {cpp(out)}, {cpp(err)}}},')
print("};")
