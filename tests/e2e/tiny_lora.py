"""Build a tiny LoRA adapter for the tiny Llama (``tiny_model.py``) locally: PEFT's folder layout
(``adapter_config.json`` + ``adapter_model.safetensors``), rank-8 ``q_proj``/``v_proj`` weights from a
seeded generator, written in the safetensors format directly (an 8-byte header length, a JSON header,
the raw little-endian float32 data), so it needs neither torch nor peft."""
from __future__ import annotations

import json
import random
import struct
from array import array
from pathlib import Path


def _write_safetensors(path: Path, tensors: dict[str, tuple[list[int], array]]) -> None:
    header: dict[str, dict] = {}
    offset = 0
    blobs = []
    for name, (shape, data) in tensors.items():
        raw = data.tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # (the format pads the header to 8 bytes)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def build_tiny_lora(dest: Path | str, base_model: str, *, seed: int, layers: int = 2, hidden: int = 256,
                    rank: int = 8) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    tensors: dict[str, tuple[list[int], array]] = {}
    for layer in range(layers):
        for proj in ("q_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = ([rank, hidden], array("f", (rng.gauss(0, 0.02)
                                                                              for _ in range(rank * hidden))))
            tensors[f"{prefix}.lora_B.weight"] = ([hidden, rank], array("f", (rng.gauss(0, 0.02)
                                                                              for _ in range(hidden * rank))))
    _write_safetensors(dest / "adapter_model.safetensors", tensors)
    (dest / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": rank,
        "lora_alpha": 2 * rank, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "inference_mode": True,
    }, indent=1))
    return dest
