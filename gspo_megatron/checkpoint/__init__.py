"""Checkpoint formats and their safety: safe metadata reading, integrity checks (more formats move
here from converters/, see ../shared/DESIGN.md). Imports nothing from converters/ or train/."""
