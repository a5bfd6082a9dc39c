"""Real chat templates, as their models ship them in tokenizer_config.json's `chat_template`, for
tests/test_chat_template.py (one string literal per template line).

QWEN2_5: Qwen/Qwen2.5-7B-Instruct (the whole Qwen2.5 Instruct family ships the same template).
LLAMA3_1: meta-llama/Llama-3.1-8B-Instruct.
Both copied from the test suite of huggingface.js's Jinja port (packages/jinja/test/e2e.test.js),
which pins each model's template string as published on the Hub.
"""

QWEN2_5 = (
    '{%- if tools %}\n'
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    '    {%- else %}\n'
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    '    {%- endif %}\n'
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    '    {%- for tool in tools %}\n'
    '        {{- "\\n" }}\n'
    '        {{- tool | tojson }}\n'
    '    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    '{%- else %}\n'
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    '    {%- else %}\n'
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    '    {%- endif %}\n'
    '{%- endif %}\n'
    '{%- for message in messages %}\n'
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    '        {%- if message.content %}\n'
    "            {{- '\\n' + message.content }}\n"
    '        {%- endif %}\n'
    '        {%- for tool_call in message.tool_calls %}\n'
    '            {%- if tool_call.function is defined %}\n'
    '                {%- set tool_call = tool_call.function %}\n'
    '            {%- endif %}\n'
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    '            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n'
    '            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n"
    '        {%- endfor %}\n'
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    '        {%- endif %}\n'
    "        {{- '\\n<tool_response>\\n' }}\n"
    '        {{- message.content }}\n'
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    '        {%- endif %}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '{%- if add_generation_prompt %}\n'
    "    {{- '<|im_start|>assistant\\n' }}\n"
    '{%- endif %}\n'
)


LLAMA3_1 = (
    '{{- bos_token }}\n'
    '{%- if custom_tools is defined %}\n'
    '    {%- set tools = custom_tools %}\n'
    '{%- endif %}\n'
    '{%- if not tools_in_user_message is defined %}\n'
    '    {%- set tools_in_user_message = true %}\n'
    '{%- endif %}\n'
    '{%- if not date_string is defined %}\n'
    '    {%- set date_string = "26 Jul 2024" %}\n'
    '{%- endif %}\n'
    '{%- if not tools is defined %}\n'
    '    {%- set tools = none %}\n'
    '{%- endif %}\n'
    '\n'
    '{#- This block extracts the system message, so we can slot it into the right place. #}\n'
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    '    {%- set messages = messages[1:] %}\n'
    '{%- else %}\n'
    '    {%- set system_message = "" %}\n'
    '{%- endif %}\n'
    '\n'
    '{#- System message + builtin tools #}\n'
    '{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}\n'
    '{%- if builtin_tools is defined or tools is not none %}\n'
    '    {{- "Environment: ipython\\n" }}\n'
    '{%- endif %}\n'
    '{%- if builtin_tools is defined %}\n'
    '    {{- "Tools: " + builtin_tools | reject(\'equalto\', \'code_interpreter\') | join(", ") + "\\n\\n"}}\n'
    '{%- endif %}\n'
    '{{- "Cutting Knowledge Date: December 2023\\n" }}\n'
    '{{- "Today Date: " + date_string + "\\n\\n" }}\n'
    '{%- if tools is not none and not tools_in_user_message %}\n'
    '    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '    {{- "Do not use variables.\\n\\n" }}\n'
    '    {%- for t in tools %}\n'
    '        {{- t | tojson(indent=4) }}\n'
    '        {{- "\\n\\n" }}\n'
    '    {%- endfor %}\n'
    '{%- endif %}\n'
    '{{- system_message }}\n'
    '{{- "<|eot_id|>" }}\n'
    '\n'
    '{#- Custom tools are passed in a user message with some extra guidance #}\n'
    '{%- if tools_in_user_message and not tools is none %}\n'
    '    {#- Extract the first user message so we can plug it in here #}\n'
    '    {%- if messages | length != 0 %}\n'
    "        {%- set first_user_message = messages[0]['content']|trim %}\n"
    '        {%- set messages = messages[1:] %}\n'
    '    {%- else %}\n'
    '        {{- raise_exception("Cannot put tools in the first user message when there\'s no first user message!") }}\n'
    '{%- endif %}\n'
    "    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}\n"
    '    {{- "Given the following functions, please respond with a JSON for a function call " }}\n'
    '    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}\n'
    '    {{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\' }}\n'
    '    {{- "Do not use variables.\\n\\n" }}\n'
    '    {%- for t in tools %}\n'
    '        {{- t | tojson(indent=4) }}\n'
    '        {{- "\\n\\n" }}\n'
    '    {%- endfor %}\n'
    '    {{- first_user_message + "<|eot_id|>"}}\n'
    '{%- endif %}\n'
    '\n'
    '{%- for message in messages %}\n'
    "    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n"
    "        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n"
    "    {%- elif 'tool_calls' in message %}\n"
    '        {%- if not message.tool_calls|length == 1 %}\n'
    '            {{- raise_exception("This model only supports single tool-calls at once!") }}\n'
    '        {%- endif %}\n'
    '        {%- set tool_call = message.tool_calls[0].function %}\n'
    '        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n'
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    '            {{- "<|python_tag|>" + tool_call.name + ".call(" }}\n'
    '            {%- for arg_name, arg_val in tool_call.arguments | items %}\n'
    '                {{- arg_name + \'="\' + arg_val + \'"\' }}\n'
    '                {%- if not loop.last %}\n'
    '                    {{- ", " }}\n'
    '                {%- endif %}\n'
    '                {%- endfor %}\n'
    '            {{- ")" }}\n'
    '        {%- else  %}\n'
    "            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n"
    '            {{- \'{"name": "\' + tool_call.name + \'", \' }}\n'
    '            {{- \'"parameters": \' }}\n'
    '            {{- tool_call.arguments | tojson }}\n'
    '            {{- "}" }}\n'
    '        {%- endif %}\n'
    '        {%- if builtin_tools is defined %}\n'
    "            {#- This means we're in ipython mode #}\n"
    '            {{- "<|eom_id|>" }}\n'
    '        {%- else %}\n'
    '            {{- "<|eot_id|>" }}\n'
    '        {%- endif %}\n'
    '    {%- elif message.role == "tool" or message.role == "ipython" %}\n'
    '        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}\n'
    '        {%- if message.content is mapping or message.content is iterable %}\n'
    '            {{- message.content | tojson }}\n'
    '        {%- else %}\n'
    '            {{- message.content }}\n'
    '        {%- endif %}\n'
    '        {{- "<|eot_id|>" }}\n'
    '    {%- endif %}\n'
    '{%- endfor %}\n'
    '{%- if add_generation_prompt %}\n'
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    '{%- endif %}\n'
)
