"""GPU kernels: CuPy RawKernels (CUDA C compiled by NVRTC) and Numba CUDA, each file a launcher
that checks shapes, the kernel, and a torch reference. `runtime` is their shared plumbing
(lazy CuPy / Numba, compile cache, launches on torch's current stream, argument checks).

    gemv_fp32_act       quantized GEMV on fp32 activations, every format of quant_weight
    gemv_bf16_fused     BF16 GEMV, two rows a warp, fused epilogues (gated act; QKV + RoPE + KV write)
    gemv_int8_act       quantized GEMV on int8 activations (dp4a)
    gemm_int8_act       quantized GEMM on int8 activations (int8 tensor cores; its tiles: gemm_int8_act_tiles)
    quantize_act_int8   activations to int8 per block of 32, alone or fused into add+RMSNorm / gated act
    quant_weight        the quantized weight: formats, repacked layout, references
    add_rmsnorm, gated_act, rope, kv_write, gathered_mv, token_mask, sampling, fill_pending_tokens
    paged_decode_attention, paged_prefill_attention, prefill_attention_sdpa

Nothing here imports imp.kernels.cpu (tests/test_architecture.py).
"""
