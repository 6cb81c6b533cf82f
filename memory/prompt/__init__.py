"""What the model is given: the context builder, the prompt templates, token counts."""
