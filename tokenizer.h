// tokenizer.h — the Qwen2/Qwen3 byte-level BPE tokenizer and chat template (placeholder; see issue 3).
#pragma once
struct Tokenizer {};
