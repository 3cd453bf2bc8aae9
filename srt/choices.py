"""Names that ServerArgs validates and the layers implement, kept free of torch so that parsing a command line
(and the HTTP process's start) does not load it."""

ATTENTION_BACKENDS = ("torch_native", "triton", "flashinfer")
QUANTIZATION_METHODS = ("auto", "none", "gguf", "fp8")
