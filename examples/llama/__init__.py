"""Llama-style example: model, byte tokenizer, corpus loader, single-process reference training.

Framework-independent parts (plain PyTorch) live here so that the parallel
training script can compare itself against ``reference.train_reference``.
"""
