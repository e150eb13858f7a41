"""Tokenizing the sentences once: the prefix-token rule and the tensor cache."""
