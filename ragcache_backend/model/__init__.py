"""The model: weight loading, the runner (our forward pass over paged KV), kernels, sampling."""
