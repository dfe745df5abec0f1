"""The tiny random models' sizes, shared by the fixtures (conftest.py) and tests that build their own."""

# Small enough to build in well under a second, but with GQA (4 heads over 2 KV heads), a head_dim of 16, and
# inner sizes that are multiples of the 32-wide GGUF quantization blocks.
TINY_SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}
