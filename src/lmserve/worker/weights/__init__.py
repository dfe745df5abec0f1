"""A model's weights, from the file to the kernels (docs/architecture.md, "Part 2: one model load").

The file formats themselves, torch-free, are lmserve/formats/ (the GGUF reader; BLOCK_TYPES, the table of block
types). Here, in the order a load meets them:
  choice.py         what each matrix loads into under the settings, and the block layers' kernel paths after
  loader.py         the checkpoint's tensors under Hugging Face names (a GGUF's blocks as StoredBlocks)
  stored_formats.py a stored block type converted, value for value, into the kernel format that holds it
  shards.py         a tensor rank's rows and columns of a float or block weight
  pending.py        layers built before their weights (PendingBlockLinear), finished into their format's layer
  layer_types.py    every layer format by name: the families' tables gathered (layer_format.py: a row)
  float16.py, block_linear.py, kquants.py
                    the families, each with one table of its formats (layer, kernel, packing, cost)
  block_packing.py, batched_copies.py, row_segments.py, block_embedding.py
                    q4_1/q8_0 blocks and their packing, the float copies for prompts and large batches, a fused
                    layer in several formats, the token embedding kept in the file's blocks
  kernel_choice.py  which kernels run on this CPU, and what `auto` resolves each setting to
"""
