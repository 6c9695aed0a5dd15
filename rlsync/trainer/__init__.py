"""The trainer: the GRPO step, its offload to host memory, data parallel, the task."""
