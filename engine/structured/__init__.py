"""Structured output: the Constraint a request carries (constraints) and the grammars compiled from it (grammars).

Nothing is re-exported here: import the module that owns a name.
"""
