"""Quantized weights: GGUF block formats run as stored (mmap'd, C++ VNNI kernels), int8 for HF checkpoints."""
