"""Update policies: how a trainer's update meets a standalone engine's streaming clients (serve.update_policy).
`base` declares the interface and the registry; one module per policy (`pause`, `stage`)."""
