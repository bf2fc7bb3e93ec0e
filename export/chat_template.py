"""The export's chat template: plain text turns that suit a base model.

    [system text]\\n\\n
    User: [text]\\n\\n
    Assistant: [text]\\n\\n
    ...
    Assistant:                      <- with add_generation_prompt (vLLM's chat endpoint sets it)

No special tokens: Laplace is a base model trained on plain documents, whose only special token
(<|endoftext|>) separates documents, so the conversation is one document of labelled turns.  A
reply ends where the model starts the next turn: clients pass `"stop": ["\\nUser:"]` (vLLM's
defaults from generation_config.json cannot carry stop strings).  Each turn's rendering is a prefix
of the next one's, so a resent conversation hits vLLM's prefix cache up to its last whole block.
"""
import json
from pathlib import Path

# whitespace control ({%- ... %}) strips template text only, so the separators are expressions
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' %}{{ 'User: ' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] }}"
    "{%- else %}{{ raise_exception('chat roles are system, user and assistant, not ' + message['role']) }}"
    "{%- endif %}{{ '\\n\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ 'Assistant:' }}{%- endif %}"
)


def add_chat_template(folder: Path) -> None:
    """Write CHAT_TEMPLATE into `folder`/tokenizer_config.json (the file every transformers and
    vLLM version reads it from)."""
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2) + "\n")
