"""Shipping an edit: the ablated checkpoint, the IA3 mask adapter, the model card and the Hub push."""
