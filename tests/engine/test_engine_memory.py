"""An engine's memory comes back when the engine goes: a process that makes engine after engine (the test suite, a
benchmark comparing settings) must not keep every one. Only a process's first engine is frozen out of the
collector's sight (engine.llm_engine._freeze_first_engine)."""

import gc
import weakref


def test_engines_after_the_first_are_freed(make_engine):
    make_engine()  # the process's first engine, if no other test made one yet
    for config in ({}, {"speculative": "ngram"}):
        eng = make_engine(**config)
        gone = weakref.ref(eng)
        del eng
        gc.collect()
        assert gone() is None, config
