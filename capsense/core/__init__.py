"""The model side of capsense: head names and sets, the architecture table, the ablation hook, model loading."""
