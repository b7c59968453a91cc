"""`pagedq gpu-check` (`python -m bench.gpu_check`): the one command to run on a GPU; command.py's docstring is its
help. One module per section, run cheapest first: kernels (with quant, the quantized matmul), bandwidth, graphs, e2e,
tensor_parallel; models picks and prepares their model, report makes the table, common holds what they share.
Modules import common, models and each other downwards (tensor_parallel uses graphs', kernels uses quant), never this
package: it only names what callers use."""

from bench.gpu_check.bandwidth import attention_bandwidth
from bench.gpu_check.command import OPTIONS, default_out, exit_status, main, parse_budgets, run, run_options
from bench.gpu_check.common import (
                                    BUDGETS,
                                    FAILED,
                                    NO_GPU,
                                    OK,
                                    SECTIONS,
                                    SHORT,
                                    TOL,
                                    USAGE,
                                    Budget,
                                    _tail,
                                    sweep,
)
from bench.gpu_check.e2e import end_to_end
from bench.gpu_check.graphs import compare, graph_check, steady
from bench.gpu_check.kernels import (
                                    KERNEL_DTYPES,
                                    SMOKE_DTYPES,
                                    KernelCase,
                                    _constexprs,
                                    check_kernels,
                                    kernel_cases,
                                    run_kernel_case,
)
from bench.gpu_check.models import SHAPE_FOLDER, TINY_FOLDER, model_folder, prepare, random_weights
from bench.gpu_check.report import table, targets
from bench.gpu_check.tensor_parallel import tensor_parallel_check

__all__ = ["BUDGETS", "FAILED", "KERNEL_DTYPES", "NO_GPU", "OK", "OPTIONS", "SECTIONS", "SHAPE_FOLDER", "SHORT",
           "SMOKE_DTYPES", "TINY_FOLDER", "TOL", "USAGE", "Budget", "KernelCase", "_constexprs", "_tail",
           "attention_bandwidth", "check_kernels", "compare", "default_out", "end_to_end", "exit_status",
           "graph_check", "kernel_cases", "main", "model_folder", "parse_budgets", "prepare", "random_weights", "run",
           "run_kernel_case", "run_options", "steady", "sweep", "table", "targets", "tensor_parallel_check"]
