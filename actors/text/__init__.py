"""Text apart from the model: tokenizers, chat templates, grammars, tool calls. No torch."""
