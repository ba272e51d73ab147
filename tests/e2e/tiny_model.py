"""Build a tiny Llama model folder locally (no hub): config, a trained tokenizer, a chat template.

The tokenizer is a byte-level BPE trained with ``tokenizers`` on text this repository ships
(its README and Python sources, in sorted order), so it is the same on every machine for a
given commit. vLLM serves the folder with ``--load-format dummy`` (seeded random weights:
two engines give identical greedy output).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 (eos = 2)
VOCAB_SIZE = 4096
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
REPO = Path(__file__).resolve().parents[2]


def corpus_files(repo: Path = REPO) -> list[str]:
    files = [repo / "README.md", *sorted((repo / "infera").rglob("*.py"))]
    return [str(f) for f in files if f.is_file()]


def train_tokenizer(files: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    return tok


def build_tiny_model(dest: Path | str, *, layers: int = 2, hidden: int = 256, heads: int = 4,
                     max_positions: int = 4096) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    train_tokenizer(corpus_files()).save(str(dest / "tokenizer.json"))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads,
        "vocab_size": VOCAB_SIZE, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 2, "pad_token_id": 0,
    }
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    (dest / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 2}))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": max_positions,
        "add_bos_token": False, "add_eos_token": False, "chat_template": CHAT_TEMPLATE,
    }, indent=1))
    (dest / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return dest


if __name__ == "__main__":
    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
