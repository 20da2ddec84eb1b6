"""Data preparation: readers, corpus, tokenizer, input order, numpy masks, encoding."""
