"""The rollout engines: `base` declares the interface and the registry keyed by `rollout.engine`;
one module per engine (`hf`: transformers, `vllm`: vLLM)."""
