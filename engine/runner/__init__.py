"""One step on the device: the model runner, the step's host inputs and their staging, the padded decode buffers
and CUDA graphs, the sampler, and the KV cache's host memory.

Nothing is re-exported here: import the module that owns a name.
"""
