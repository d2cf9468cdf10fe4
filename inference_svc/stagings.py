"""How an inference rank stages an update (`InferenceWorker(staging=...)`, `Hello.staging`), without
torch: the controller reads them from its workers' hellos. inference_svc/worker.py says what each does."""

STAGINGS = ("shadow", "inplace", "bounded", "staged")
POOLED = ("bounded", "staged")  # received through a pool: the buffers given hold no copy of the weights
TEARS = ("inplace", *POOLED)  # a failed transfer leaves a rank torn: NOT_SERVING until a full update
STANDALONE = ("shadow", "inplace", "bounded")  # a worker holding its own buffers (`staged` needs an engine's copy)
