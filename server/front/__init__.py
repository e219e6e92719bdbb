"""The front-end process: the gRPC service and its streams, the transports that send batches,
the shared-batch cache, limits, auth, TLS, the HTTP control plane and its metrics.
"""
