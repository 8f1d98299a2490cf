"""Quantized weights as data: GGUF block formats kept as stored (QuantTensor over the mmap'd file, run by the C++
VNNI kernel), their dequantizer, int8 blocks for HF checkpoints. The model side is model/quantized_linear.py."""

# The names LLM(quantization=...), the CLI and the loader accept (torch-free, for the CLI's parser). "auto": GGUF
# blocks as stored where the kernels multiply them fast, else dequantized where that fits (model/loader.py);
# "gguf": as stored on every CPU; "none": dequantized (the oracle); "int8": HF float weights in int8 blocks.
QUANTIZATION = ("auto", "gguf", "none", "int8")
