"""`lmserve bench`: a load generator for OpenAI-compatible servers, with `vllm bench serve`'s definitions."""
