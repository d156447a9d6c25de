"""Make this Python process see an AVX2-only x86 CPU (put this directory first on PYTHONPATH).

vLLM's CPU backend picks its kernels from torch's CPU probes, not from an environment
variable: `torch.cpu._is_avx512_supported()` chooses `vllm._C` / `_C_AVX512` over `_C_AVX2`,
and `_is_amx_tile_supported()` chooses the `amx` attention kernel (and its page order) over
`vec`. Answering those probes False runs the kernels an AVX2 machine runs. ATen's own kernels
follow `ATEN_CPU_CAPABILITY=avx2` and oneDNN's (torch's matmuls) `ONEDNN_MAX_CPU_ISA=AVX2`,
which the test sets next to this file (`tests.cpu_isa.avx2_env`).
"""

import torch

for _probe in (
    "_is_amx_tile_supported",
    "_is_amx_fp16_supported",
    "_is_avx512_supported",
    "_is_avx512_bf16_supported",
    "_is_avx512_vnni_supported",
):
    if hasattr(torch.cpu, _probe):
        setattr(torch.cpu, _probe, lambda: False)
