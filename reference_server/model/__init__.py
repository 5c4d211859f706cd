"""The model the engine runs: GGUF loading (``gguf_loader``), the Llama forward (``model``), weight-only
quantised linears (``quant``), the KV cache's storage (``kv_cache``), CUDA graphs (``cuda_graphs``), the
native decode step (``fused_decode``), the runner that turns a scheduled batch into a forward pass
(``model_runner``), sampling (``sampler``) and the text around it: chat template, detokenizer (``text``)."""
