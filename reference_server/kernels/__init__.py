"""Compute kernels: the native CPU kernels (``csrc/cpu_kernels.c``, built and loaded by ``native``), the
packed quantised weight they read (``quant_weight``) and the Triton paged attention for the GPU
(``triton_attention``)."""
