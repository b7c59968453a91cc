"""Speculative decoding: proposers of draft tokens (proposer: the interface; ngram: prompt lookup) and the verify
step's bookkeeping (verify).

Nothing is re-exported here: import the module that owns a name.
"""
