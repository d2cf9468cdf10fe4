"""The control plane: gRPC helpers (`rpc`), credentials (`security`), a controller's hub of
worker streams (`hub`), the worker core embedded in engines (`worker`), the supervisor of
standalone workers (`supervisor`), and fault injection for tests (`faults`)."""
