"""Moving the bytes: the engine that runs a plan's rounds (`engine`), the exact checksum
(`checksum`, `mixing`), transports (gloo in `transport`, NCCL in `nccl` and `nccl_transport`,
CUDA IPC in `cuda_ipc`) and the choice between them (`backend`)."""
