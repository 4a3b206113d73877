"""The small policies the trainers train, and fake-quantized execution.

* ``creditlab.models.batched_mlp``: ``M`` independent small MLP policies as one batched tensor
  program.
* ``creditlab.models.tiny_lm``: a tiny causal transformer (and ``StackedTinyLM``, several of them
  as one program) with a KV cache and fake-quantized execution paths.
* ``creditlab.models.quant``: the fake-quantization kernels (FP8, INT8, NVFP4, MXFP4) of the rollout
  engine and of the quantization-aware learner.

Layer: imports nothing of creditlab but ``errors``.
"""
