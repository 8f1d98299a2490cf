"""Quantized weights as data: GGUF block formats kept as stored (QuantTensor over the mmap'd file, run by the C++
VNNI kernel), their dequantizer, int8 blocks for HF checkpoints. The model side is model/quantized_linear.py."""
