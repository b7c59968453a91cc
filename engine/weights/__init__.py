"""Where the weights come from and what they are kept as: model sources (aliases, GGUF, hub), GGUF and AWQ/GPTQ
checkpoint readers, the checkpoint layer maps, and the linear layers that hold packed or quantized weights.

This room owns checkpoint formats and layer-name maps; pagedq_kernels/quant_layout owns the block layouts they map onto.
Nothing is re-exported here: import the module that owns a name.
"""
