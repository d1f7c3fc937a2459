"""Shipping an edit: the ablated checkpoint, the PEFT adapter (IA3 mask; LoRA for mean ablation), the model card and the Hub push."""
