"""Benchmarks: pagedq against transformers peers, measured in one run on one model. Not tests.

`run_bench(...)` (bench.run) does the work; `pagedq bench` and `python -m bench` are its command line.
"""


def __getattr__(name: str):
    # run_bench pulls in torch; `import bench` (the CLI's import of bench.cli) stays light.
    if name == "run_bench":
        from bench.run import run_bench

        return run_bench
    raise AttributeError(name)


__all__ = ["run_bench"]
