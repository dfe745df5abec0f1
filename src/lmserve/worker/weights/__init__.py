"""A model's weights, from the file to the kernels (docs/architecture.md, "Part 2: one model load")."""
