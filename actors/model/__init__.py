"""The model: its shape and presets, the torch decoder, paged execution, checkpoints."""
