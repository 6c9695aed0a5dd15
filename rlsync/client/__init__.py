"""The client of a standalone engine (`python -m rlsync.serve`): client.py the trainer's `RemoteEngine`
and its session, messages.py the typed messages of its control plane, stream.py the streaming clients'
messages and client. Used by the update's broadcast transport, the engine's server and the stall benchmark."""
