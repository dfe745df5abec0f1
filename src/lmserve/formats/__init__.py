"""Weight formats as files store them, without torch: a GGUF file's header and blocks (gguf_file.py) and the table of
llama.cpp's block types, what each takes in memory and which kernel formats hold it (block_formats.py). The worker's
weight layers (worker/weights/) and the planner (plan/, which never loads a model) both read these."""
