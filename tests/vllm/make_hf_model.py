"""Random float32 weights for a config-only Hugging Face model directory (run with
.venv-vllm's python, whose transformers knows every architecture vLLM 0.32 serves): kvtier keys
its tier by the weight files, so a model vLLM loads with dummy weights has no identity."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = Path(sys.argv[1])
    fields = json.loads((out / "config.json").read_text())
    fields.pop("architectures", None)
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)


if __name__ == "__main__":
    main()
